"""Searches over plans: the longest sequence that fits, the UPipe head chunk U to use, and how many
blocks keep their attention (``size_keep_attention``).

Both rely on the peak growing with the sequence length (every activation term is linear in
``S``, the state is constant) and, for UPipe, with U (larger stages, larger buffers).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace

from titan_upipe.plan.job import UPIPE_MODES, PlanInput
from titan_upipe.plan.step import plan
from titan_upipe.spec.cp_layout import valid_heads_per_stage
from titan_upipe.spec.keep_attention import KeepAttentionPlan


def longest_multiple(fits: Callable[[int], bool], start: int = 1, limit: int = 1 << 30) -> int:
    """The largest ``k`` in ``[start, limit]`` with ``fits(k)``, for a ``fits`` that holds up to some
    ``k`` and fails beyond (0 when ``fits(start)`` fails): doubling, then bisection between the
    last ``k`` that fits and the first that does not."""
    if not fits(start):
        return 0
    lo, hi = start, 2 * start
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def max_seq_len(job: PlanInput, gpu_mem_bytes: float, host_mem_bytes: float | None = None,
                limit: int = 1 << 30, above: int = 0) -> int:
    """The longest multiple of ``job.seq_unit`` whose plan fits (0 if none does; the peak grows
    with the length, so ``longest_multiple`` applies). ``above``: only a fit longer than this
    length matters (0 is returned at once when the next multiple does not fit)."""
    unit = job.seq_unit

    def fits(k: int) -> bool:
        return plan(replace(job, seq_len=k * unit), host_mem_bytes).fits(gpu_mem_bytes, host_mem_bytes)

    return longest_multiple(fits, start=above // unit + 1, limit=limit // unit) * unit


LEVERS: dict[str, tuple[str, tuple]] = {
    "optimizer.state_on_host": ("optimizer_state_on_host", (True,)),
    "activation_checkpoint.prefetch_after_attention": ("prefetch_after_attention", (True,)),
    "activation_checkpoint.resident_blocks": ("resident_blocks", (1, 2)),
}
"""Settings the longest-fit search may change, config key -> (``PlanInput`` field, values to try):
each keeps parity exact and trades step time (host AdamW, a later prefetch) or moves memory between
host and device (resident block inputs), so a cluster's longest fit names the ones it needs."""


def longest_fit(job: PlanInput, gpu_mem_bytes: float, host_mem_bytes: float | None = None
                ) -> tuple[int, dict[str, object]]:
    """``(length, settings)``: the longest length over the job's own settings and every combination
    of ``LEVERS`` values, with the changes it needs (``{}``: as configured); among equally long
    fits the one changing fewest settings (a lever that does not lengthen the fit is not named)."""
    options = [[None, *(v for v in values if v != getattr(job, field))] for field, values in LEVERS.values()]
    best_len, best_settings = max_seq_len(job, gpu_mem_bytes, host_mem_bytes), {}
    for combo in sorted(itertools.product(*options), key=lambda c: sum(v is not None for v in c)):
        settings = {key: v for key, v in zip(LEVERS, combo, strict=True) if v is not None}
        if not settings:
            continue
        candidate = replace(job, **{LEVERS[key][0]: v for key, v in settings.items()})
        try:
            candidate.check()
        except ValueError:  # a lever the job's mode refuses (TSP keeps AdamW's moments on the device)
            continue
        length = max_seq_len(candidate, gpu_mem_bytes, host_mem_bytes, above=best_len)  # mostly one plan
        if length > best_len:
            best_len, best_settings = length, settings
    return best_len, best_settings


def recommended_heads_per_stage(job: PlanInput, gpu_mem_bytes: float,
                                host_mem_bytes: float | None = None) -> tuple[int, bool]:
    """(U, fits): the largest valid U whose UPipe plan fits (fewest stages: fastest), or U = the
    Ulysses degree (least memory) when none fits. For non-UPipe jobs, the UPipe variant of the
    same cluster (UPipe-in-USP when there is a ring)."""
    base = replace(job, mode="upipe") if job.resolved_mode not in UPIPE_MODES else job
    if base.ulysses_degree == 1:
        base = replace(base, ulysses=base.cp)
    choices = valid_heads_per_stage(job.model.n_heads, base.ulysses_degree)
    for u in sorted(choices, reverse=True):
        if plan(replace(base, heads_per_stage=u), host_mem_bytes).fits(gpu_mem_bytes, host_mem_bytes):
            return u, True
    return min(choices), False


def _most_blocks(fits: Callable[[int], bool], cap: int) -> int:
    """The largest ``k`` in ``[0, cap]`` with ``fits(k)`` (kept bytes only grow with ``k``): ``cap``
    itself where it fits (one plan: the usual case up to 1M), else a search below it."""
    if cap <= 0:
        return 0
    return cap if fits(cap) else longest_multiple(fits, start=1, limit=cap - 1)


def size_keep_attention(job: PlanInput, where: str, blocks: int | None, gpu_mem_bytes: float,
                        host_mem_bytes: float | None = None) -> KeepAttentionPlan:
    """How many blocks keep their attention, and where, for ``[activation_checkpoint]
    keep_attention = where`` (device, host or auto) and ``keep_attention_blocks = blocks`` (a cap;
    None: as many as fit): on the device as many as fit the GPU (peak + runtime reserve), then for
    ``host``/``auto`` in host memory as many as fit the node's host memory (and the GPU, which holds
    each prefetched copy); a job whose offloaded inputs alone overfill the host keeps none there.
    ``job``'s own keep counts are ignored."""
    n = job.model.n_layers
    cap = n if blocks is None else min(blocks, n)
    base = replace(job, keep_device_blocks=0, keep_host_blocks=0)

    def fits(device: int, host: int, host_limit: float | None) -> bool:
        candidate = replace(base, keep_device_blocks=device, keep_host_blocks=host)
        return plan(candidate, host_limit).fits(gpu_mem_bytes, host_limit)

    # kept on the device adds no host memory: only the GPU bounds it
    device = _most_blocks(lambda k: fits(k, 0, None), cap) if where in ("device", "auto") else 0
    host = _most_blocks(lambda k: fits(device, k, host_mem_bytes), cap - device) if where in ("host", "auto") else 0
    return KeepAttentionPlan(device, host)
