"""Progress through a long step: rank-0 lines per block and phase, phase times, the run's ETA.

At millions of tokens one step runs for tens of minutes, and TorchTitan logs ``step: N`` only
when it ends. :class:`StepProgress` follows a step through hooks on the model's transformer
blocks (``model.layers``, :func:`watch_blocks`) and marks from the trainer
(each adapter's ``trainer.ContextParallelTrainer``: TorchTitan 0.2.2 and 0.3 alike):

==========  ==========================================================================
phase       from … to …
==========  ==========================================================================
forward     a microbatch's start to the model's forward hook (blocks: each block's forward hook)
backward    the model's output to the next microbatch or the optimizer (loss, head and blocks:
            a hook on the gradient of each block's input, i.e. that block's backward done)
optimizer   gradient clipping, the optimizer and LR steps
==========  ==========================================================================

Once a step has run ``metrics.progress_after_seconds`` (or the previous step did; 0: every
step), rank 0 logs at most :data:`LINES_PER_PHASE` block lines per phase and one when the
optimizer starts, each with the step's elapsed time and an estimate of the step
(:func:`step_estimate`)::

    step 3/10  backward  block 16/32  elapsed 12m04s  step ~25m40s, 13m36s left (from step 2)

and the phase times go to TensorBoard (``progress/forward_seconds``, ``…backward…``,
``…optimizer…``) with the step's metrics. Every logged step ends with a line on rank 0 with the
run's ETA (:func:`run_eta`)::

    step 3/10  25m40s (forward 8m02s, backward 17m26s, optimizer 12.0s)  run ETA 3h00m at 25m44s/step (last 2)

What the times mean: the host clock (``time.monotonic``). On a GPU, without a synchronization,
that is when the host *launched* the work, not when the device finished it, so a short step
adds no synchronization at all (the hooks only count). Once the progress is on (the step is
known long), the device is synchronized before each printed line and at each phase boundary:
the times are then the device's, at a cost of a few synchronizations per phase, nothing against
a step of minutes. Times taken before a step turned long (its first minute) are launch times.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torchtitan.tools.logging import logger

PHASES = ("forward", "backward", "optimizer")
BLOCK_PHASES = ("forward", "backward")
LINES_PER_PHASE = 10
"""Block lines per phase of a step, at most (every ``ceil(blocks / 10)``-th block and the last)."""
BACKWARD_PER_FORWARD = 2.0
"""A step's first estimate, before its backward started and with no earlier step: backward takes
twice the forward (two matmuls per forward one; more under full activation checkpointing)."""
RECENT_STEPS = 10
"""Steps the run's ETA averages over."""


# ---------------------------------------------------------------- pure arithmetic and formats


def report_every(units: int, lines: int = LINES_PER_PHASE) -> int:
    """Blocks between two lines, so that ``units`` blocks give at most ``lines`` lines."""
    return max(1, math.ceil(units / lines))


def is_report_point(done: int, units: int, lines: int = LINES_PER_PHASE) -> bool:
    """Whether the ``done``-th of ``units`` blocks gets a line (every few, and the last)."""
    return done == units or done % report_every(units, lines) == 0


def format_duration(seconds: float) -> str:
    """``12.3s``, ``4m05s``, ``2h07m``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes}m{int(seconds % 60):02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def step_estimate(elapsed: float, phase_seconds: dict[str, float], fractions: dict[str, float],
                  previous: dict[str, float] | None) -> float | None:
    """Seconds the whole step will take, ``elapsed`` of them gone.

    ``phase_seconds``: time spent so far in each phase; ``fractions``: the share of each phase done
    (blocks done / blocks of the step, the optimizer 0 or 1). With the previous step's phase times
    (``previous``) the rest is what the same work took then: ``Σ previous[p] · (1 − fractions[p])``.
    Without, each block phase extrapolates its own blocks (``phase_seconds[p] · (1 − f) / f``), a
    backward not started yet takes :data:`BACKWARD_PER_FORWARD` forwards, and the optimizer is not
    counted; None before the first block."""
    if previous is not None:
        return elapsed + sum(previous.get(p, 0.0) * (1 - fractions.get(p, 0.0)) for p in PHASES)
    forward, backward = fractions.get("forward", 0.0), fractions.get("backward", 0.0)
    if forward <= 0:
        return None
    forward_total = phase_seconds.get("forward", 0.0) / forward
    backward_total = phase_seconds.get("backward", 0.0) / backward if backward > 0 else BACKWARD_PER_FORWARD * forward_total
    return elapsed + forward_total * (1 - forward) + backward_total * (1 - backward)


def run_eta(recent_step_seconds: Sequence[float], step: int, total_steps: int) -> float | None:
    """Seconds left in the run after ``step`` of ``total_steps``: the mean of the recent steps' wall
    times (checkpoint saves and validation between them included) times the steps left."""
    if not recent_step_seconds:
        return None
    return sum(recent_step_seconds) / len(recent_step_seconds) * max(total_steps - step, 0)


def progress_line(step: int, total_steps: int, phase: str, elapsed: float, estimate: float | None,
                  basis: str, blocks: tuple[int, int] | None = None) -> str:
    """``step 3/10  backward  block 16/32  elapsed 12m04s  step ~25m40s, 13m36s left (from step 2)``."""
    where = f"  block {blocks[0]}/{blocks[1]}" if blocks else ""
    guess = (f"step ~{format_duration(estimate)}, {format_duration(max(estimate - elapsed, 0.0))} left ({basis})"
             if estimate is not None else "step estimate after the first block")
    return f"step {step}/{total_steps}  {phase:<9}{where}  elapsed {format_duration(elapsed)}  {guess}"


def step_end_line(step: int, total_steps: int, seconds: float, phase_seconds: dict[str, float] | None,
                  recent_step_seconds: Sequence[float]) -> str:
    """``step 3/10  25m40s (forward …, backward …, optimizer …)  run ETA 3h00m at 25m44s/step (last 2)``;
    the phases only when they were timed with the device synchronized (the progress was on)."""
    phases = ""
    if phase_seconds is not None:
        phases = " (" + ", ".join(f"{p} {format_duration(phase_seconds[p])}" for p in PHASES) + ")"
    eta = run_eta(recent_step_seconds, step, total_steps)
    tail = ""
    if eta is not None:
        mean = sum(recent_step_seconds) / len(recent_step_seconds)
        tail = f"  run ETA {format_duration(eta)} at {format_duration(mean)}/step (last {len(recent_step_seconds)})"
    return f"step {step}/{total_steps}  {format_duration(seconds)}{phases}{tail}"


# ---------------------------------------------------------------- one step, followed


class StepProgress:
    """A step's phases and blocks, told by the trainer (:meth:`begin_step`, :meth:`begin_microbatch`,
    :meth:`begin_optimizer`, :meth:`end_step`) and by the hooks of :func:`watch_blocks`
    (:meth:`block_forward_done`, :meth:`forward_done`, :meth:`block_backward_done`).

    ``emit`` prints a line (None: a rank that prints nothing), ``sync`` waits for the device
    (None on CPU), ``clock`` reads the time. Events outside a step (validation), and forward
    events in backward (activation-checkpoint recomputation), are ignored."""

    def __init__(self, n_blocks: int, after_seconds: float, total_steps: int, *,
                 emit: Callable[[str], None] | None = None, sync: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.n_blocks, self.after_seconds, self.total_steps = n_blocks, after_seconds, total_steps
        self.emit, self.sync, self.clock = emit, sync, clock
        self.previous: dict[str, float] | None = None
        """The phase times of the last step timed with the progress on (the estimates' basis)."""
        self.previous_step = 0
        self.last_step_seconds = 0.0
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)
        """Wall times of the recent steps, from one step's end to the next's."""
        self.phase: str | None = None
        self.active = False
        self._last_end: float | None = None

    # -- marks from the trainer

    def begin_step(self, step: int, microbatches: int = 1) -> None:
        self.step, self.microbatches = step, microbatches
        self.active = self.after_seconds == 0 or bool(self.recent) and self.recent[-1] >= self.after_seconds
        self.started = self._now()
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)
        self.blocks_done = dict.fromkeys(BLOCK_PHASES, 0)
        self.phase, self._phase_started, self._optimizer_done = None, self.started, False

    def begin_microbatch(self) -> None:
        self._enter("forward")

    def begin_optimizer(self) -> None:
        self._enter("optimizer")
        if self._turned_long():
            self._report("optimizer")

    def end_step(self) -> dict[str, float]:
        """Closes the step; returns its ``progress/<phase>_seconds`` scalars (none when the progress
        was off: unsynchronized times on a GPU are launch times)."""
        now = self._enter(None)
        self._optimizer_done = True
        self.last_step_seconds = now - self.started
        # Step end to step end: what the run's ETA needs (saves and validation included), and what
        # the host waited for on a GPU (the next step's decision to synchronize).
        self.recent.append(now - self._last_end if self._last_end is not None else self.last_step_seconds)
        self._last_end = now
        if not self.active:
            return {}
        self.previous, self.previous_step = dict(self.phase_seconds), self.step
        return {f"progress/{phase}_seconds": seconds for phase, seconds in self.phase_seconds.items()}

    def report_step_end(self) -> None:
        """The end-of-step line (after the step's metrics), with the run's ETA."""
        if self.emit is not None:
            phases = self.phase_seconds if self.active else None
            self.emit(step_end_line(self.step, self.total_steps, self.last_step_seconds, phases, list(self.recent)))

    # -- events from the hooks

    def block_forward_done(self) -> None:
        if self.phase == "forward":
            self.blocks_done["forward"] += 1
            self._maybe_report("forward")

    def forward_done(self) -> None:
        if self.phase == "forward":
            self._enter("backward")

    def block_backward_done(self) -> None:
        if self.phase == "backward":
            self.blocks_done["backward"] += 1
            self._maybe_report("backward")

    # -- internals

    def _now(self) -> float:
        """The clock, after the device caught up when the progress is on."""
        if self.active and self.sync is not None:
            self.sync()
        return self.clock()

    def _enter(self, phase: str | None) -> float:
        """Closes the current phase, opens ``phase`` (None: between steps); returns the time."""
        now = self._now()
        if self.phase is not None:
            self.phase_seconds[self.phase] += now - self._phase_started
        self.phase, self._phase_started = phase, now
        return now

    def _turned_long(self) -> bool:
        """On for this step: it was from the start, or the step has now run past the threshold."""
        if not self.active and self.clock() - self.started >= self.after_seconds:
            self.active = True
        return self.active

    def _maybe_report(self, phase: str) -> None:
        units = self.n_blocks * self.microbatches
        if self._turned_long() and is_report_point(self.blocks_done[phase], units):
            self._report(phase, (self.blocks_done[phase], units))

    def fractions(self) -> dict[str, float]:
        """The share of each phase done: blocks over ``blocks × microbatches``, the optimizer 0 or 1."""
        units = max(self.n_blocks * self.microbatches, 1)
        done = {phase: min(self.blocks_done[phase] / units, 1.0) for phase in BLOCK_PHASES}
        return {**done, "optimizer": 1.0 if self._optimizer_done else 0.0}

    def _report(self, phase: str, blocks: tuple[int, int] | None = None) -> None:
        if self.emit is None:
            return
        now = self._now()
        spent = dict(self.phase_seconds)
        spent[self.phase] = spent.get(self.phase, 0.0) + now - self._phase_started
        estimate = step_estimate(now - self.started, spent, self.fractions(), self.previous)
        basis = f"from step {self.previous_step}" if self.previous is not None else "from this step's blocks"
        self.emit(progress_line(self.step, self.total_steps, phase, now - self.started, estimate, basis, blocks))


# ---------------------------------------------------------------- hooks and construction


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks as TorchTitan lays them out (``model.layers``, after AC/compile wrapping);
    none for a model without them."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def _watch_block_backward(progress: StepProgress, module: nn.Module, args: tuple) -> None:
    """Forward pre-hook: when the gradient of the block's input is complete, its backward is done."""
    x = args[0] if args else None
    if progress.phase == "forward" and isinstance(x, torch.Tensor) and x.requires_grad:
        x.register_hook(lambda grad: progress.block_backward_done())


def watch_blocks(model: nn.Module, progress: StepProgress) -> list[RemovableHandle]:
    """Hooks reporting ``model``'s blocks and the end of its forward to ``progress``; their handles."""
    handles = [model.register_forward_hook(lambda module, args, output: progress.forward_done())]
    for block in transformer_blocks(model):
        handles.append(block.register_forward_pre_hook(lambda module, args: _watch_block_backward(progress, module, args)))
        handles.append(block.register_forward_hook(lambda module, args, output: progress.block_forward_done()))
    return handles


def device_sync(device: torch.device) -> Callable[[], None] | None:
    """What waits for ``device``'s queued work (None on CPU, where the work is done on return)."""
    if device.type == "cpu":
        return None
    return lambda: torch.accelerator.synchronize(device)


def build_step_progress(after_seconds: float, total_steps: int, model_parts: Iterable[nn.Module],
                        device: torch.device) -> StepProgress:
    """A :class:`StepProgress` watching ``model_parts`` (``metrics.progress_after_seconds``, ``training.steps``);
    only global rank 0 prints."""
    parts = list(model_parts)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    progress = StepProgress(sum(len(transformer_blocks(m)) for m in parts), after_seconds, total_steps,
                            emit=logger.info if rank == 0 else None, sync=device_sync(device))
    for model in parts:
        watch_blocks(model, progress)
    return progress
