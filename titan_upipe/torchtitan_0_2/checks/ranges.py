"""Job check of the numbers in TorchTitan's own sections: each setting against its valid range.

TorchTitan 0.2.2 checks few of them, and late: a batch of 0 after the process group starts, a
``keep_latest_k`` of 1 when the checkpointer is built, a ``gc_freq`` of 0 by an assert. Most
pass silently and do harm: ``training.max_norm = -1`` flips every gradient (torch scales them
by ``max_norm / norm``), a NaN or infinite ``optimizer.lr`` turns the weights into NaN at the
first step, ``comm.train_timeout_seconds = 0`` fails the first collective after step 1.

:data:`RANGES` lists each setting with what it means, its valid values and the fix; one check
(:func:`check_ranges`) raises the first value out of range. Counts the other checks own are not
repeated here: ``[training]`` steps, seq_len and batch sizes (``checks.training``), the
``[parallelism]`` degrees (``checks.parallelism``), ``[validation]`` batch and length when
enabled (``checks.training.check_validation``). The plugin's sections check themselves
(``torchtitan_0_2/config.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from titan_upipe.errors import ConfigError

Accepts = Callable[[object], bool]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def at_least(minimum: int, *also: int) -> Accepts:
    """Integers ``>= minimum``, and the special values ``also`` (``-1``: "the newest")."""
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and (v >= minimum or v in also)


def between(low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False) -> Accepts:
    """Numbers in ``[low, high]``; ``low_open``/``high_open``: that bound excluded (``high = inf``
    with ``high_open``: finite numbers only). NaN never."""
    def accepts(v: object) -> bool:
        if not _is_number(v) or math.isnan(v):
            return False
        return (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    return accepts


def unset_or(accepts: Accepts) -> Accepts:
    """None (the setting left out), or what ``accepts`` accepts."""
    return lambda v: v is None or accepts(v)


def one_of(*choices: str) -> Accepts:
    return lambda v: v in choices


@dataclass(frozen=True)
class Range:
    """One setting's valid values, in words for the message."""

    key: str
    """``section.field`` (``training.dataloader.num_workers``: a nested field)."""
    meaning: str
    accepts: Accepts
    valid: str
    fix: str

    def value(self, job_config) -> object:
        node = job_config
        for part in self.key.split("."):
            node = getattr(node, part)
        return node

    def problem(self, job_config) -> str | None:
        """The message for this setting's value, or None when it is valid."""
        value = self.value(job_config)
        if self.accepts(value):
            return None
        return f"{self.key} = {value!r} is invalid ({self.meaning}): valid values are {self.valid}; {self.fix}"


FINITE_POSITIVE = "finite numbers > 0"

RANGES: tuple[Range, ...] = (
    # [optimizer]
    Range("optimizer.lr", "the peak learning rate; NaN or infinite makes the weights NaN at the first step, "
          "negative climbs the loss", between(0, low_open=True, high_open=True), FINITE_POSITIVE, "set e.g. 3e-4"),
    Range("optimizer.beta1", "AdamW's decay of the gradient average", between(0, 1, high_open=True),
          "0 or more and below 1", "set e.g. 0.9"),
    Range("optimizer.beta2", "AdamW's decay of the squared-gradient average", between(0, 1, high_open=True),
          "0 or more and below 1", "set e.g. 0.95"),
    Range("optimizer.eps", "AdamW's term added to the denominator; 0 divides by zero where a gradient is 0",
          between(0, low_open=True, high_open=True), FINITE_POSITIVE, "set e.g. 1e-8"),
    Range("optimizer.weight_decay", "the decoupled weight decay; negative grows the weights",
          between(0, high_open=True), "finite numbers >= 0", "set 0 (none) or e.g. 0.1"),
    # [lr_scheduler]
    Range("lr_scheduler.warmup_steps", "steps of linear warm-up to optimizer.lr", at_least(0), "0 (no warm-up) or more",
          "set e.g. 200, or 0"),
    Range("lr_scheduler.total_steps", "the steps the schedule spans", unset_or(at_least(1)),
          "unset (training.steps) or 1 or more", "remove it to follow training.steps"),
    Range("lr_scheduler.decay_ratio", "the share of the steps spent decaying", unset_or(between(0, 1)),
          "unset (decay right after warm-up) or 0 to 1", "remove it, or set e.g. 0.2"),
    Range("lr_scheduler.decay_type", "the shape of the decay", one_of("linear", "sqrt", "cosine"),
          "linear, sqrt, cosine", 'set e.g. "linear"'),
    Range("lr_scheduler.min_lr_factor", "the last learning rate as a fraction of optimizer.lr", between(0, 1),
          "0 to 1", "set 0, or e.g. 0.1"),
    # [training]
    Range("training.max_norm", "the gradient-norm clip: gradients are scaled to at most this norm; a negative "
          "value flips them, 0 zeroes them", between(0, low_open=True),
          "numbers > 0 (inf: no clipping)", "set e.g. 1.0"),
    Range("training.gc_freq", "steps between Python garbage collections", at_least(1), "1 or more", "set e.g. 50"),
    Range("training.dataloader.num_workers", "data-loading worker processes", at_least(0), "0 (load in the trainer) "
          "or more", "set 0"),
    Range("training.dataloader.prefetch_factor", "batches each worker loads ahead", unset_or(at_least(1)),
          "unset or 1 or more", "remove it"),
    Range("validation.dataloader.num_workers", "data-loading worker processes", at_least(0), "0 (load in the trainer) "
          "or more", "set 0"),
    Range("validation.dataloader.prefetch_factor", "batches each worker loads ahead",
          unset_or(at_least(1)), "unset or 1 or more", "remove it"),
    # [comm]
    Range("comm.init_timeout_seconds", "how long a collective may wait during start-up and the first step; below "
          "the slowest model build, checkpoint load or first step the job fails with a collective timeout",
          at_least(1), "1 or more seconds", "set e.g. 300"),
    Range("comm.train_timeout_seconds", "how long a collective may wait after the first step; below the slowest "
          "step, checkpoint save or validation pass the job fails with a collective timeout", at_least(1),
          "1 or more seconds", "set e.g. 100, more than the slowest step"),
    Range("comm.trace_buf_size", "the flight recorder's entries", at_least(0), "0 (off) or more", "set e.g. 20000"),
    # [checkpoint]
    Range("checkpoint.interval", "steps between checkpoints", at_least(1), "1 or more",
          "set e.g. 500 (checkpoint.enable = false turns saving off)"),
    Range("checkpoint.keep_latest_k", "checkpoints kept; 1 is refused by TorchTitan, since the newest may still be "
          "saving", at_least(2, 0), "0 (keep all) or 2 or more", "set e.g. 10, or 0"),
    Range("checkpoint.load_step", "the step to resume from", at_least(0, -1), "-1 (the newest) or 0 or more",
          "set -1"),
    # [metrics], [validation], [profiling]
    Range("metrics.log_freq", "steps between logged metrics", at_least(1), "1 or more", "set e.g. 10"),
    Range("validation.freq", "steps between validation passes", at_least(1), "1 or more",
          "set e.g. 100 (validation.enable = false turns it off)"),
    Range("validation.steps", "batches per validation pass", at_least(1, -1), "-1 (the whole dataset) or 1 or more",
          "set e.g. 4"),
    Range("profiling.profile_freq", "steps between profiles", at_least(1), "1 or more", "set e.g. 10"),
    Range("profiling.profiler_active", "steps each profile records", at_least(1), "1 or more", "set e.g. 1"),
    Range("profiling.profiler_warmup", "steps before each profile records", at_least(0), "0 or more", "set e.g. 3"),
    # [activation_checkpoint]
    Range("activation_checkpoint.memory_budget", "the compiler's memory trade-off in mode \"memory_budget\"",
          between(0, 1), "0 (recompute all) to 1", "set e.g. 0.5"),
)
"""Every range-checked setting, by section, in the order a message is given."""


def range_problems(job_config) -> list[str]:
    """Every setting of :data:`RANGES` out of its range, as messages."""
    return [problem for rule in RANGES if (problem := rule.problem(job_config)) is not None]


def check_ranges(job_config, world_size: int) -> None:
    """The first setting out of its range (:data:`RANGES`)."""
    if problems := range_problems(job_config):
        raise ConfigError(problems[0])
