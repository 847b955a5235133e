"""Searches over plans: the longest sequence that fits, and the UPipe head chunk U to use.

Both rely on the peak growing with the sequence length (every activation term is linear in
``S``, the state is constant) and, for UPipe, with U (larger stages, larger buffers).
"""

from __future__ import annotations

from dataclasses import replace

from titan_upipe.parallel.cp_layout import valid_heads_per_stage
from titan_upipe.plan.job import UPIPE_MODES, PlanInput
from titan_upipe.plan.step import plan


def max_seq_len(job: PlanInput, gpu_mem_bytes: float, host_mem_bytes: float | None = None,
                limit: int = 1 << 30) -> int:
    """The longest multiple of ``job.seq_unit`` whose plan fits (0 if none does): doubling, then
    bisection between the last length that fits and the first that does not."""
    unit = job.seq_unit

    def fits(k: int) -> bool:
        return plan(replace(job, seq_len=k * unit), host_mem_bytes).fits(gpu_mem_bytes, host_mem_bytes)

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi * unit <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit // unit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi): the peak grows with the length
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * unit


LEVERS: dict[str, str] = {"optimizer.state_on_host": "optimizer_state_on_host",
                          "activation_checkpoint.prefetch_after_attention": "prefetch_after_attention"}
"""Settings the longest-fit search may switch on, config key -> ``PlanInput`` field: each one moves
memory off the GPU at a cost in step time only (parity unchanged), so a cluster's longest fit names
the ones it needs. Token-independent state on the host trades host memory, which the search checks."""


def longest_fit(job: PlanInput, gpu_mem_bytes: float, host_mem_bytes: float | None = None
                ) -> tuple[int, dict[str, bool]]:
    """``(length, settings)``: the longest length over the job's settings and each ``LEVERS``
    combination switched on from them, with the levers it needs (``{}``: as configured). A lever
    that lowers the fit (host-bound) is never chosen."""
    best_len, best_settings = max_seq_len(job, gpu_mem_bytes, host_mem_bytes), {}
    off = [key for key, name in LEVERS.items() if not getattr(job, name)]
    for mask in range(1, 1 << len(off)):
        settings = {key: True for i, key in enumerate(off) if mask >> i & 1}
        candidate = replace(job, **{LEVERS[key]: True for key in settings})
        length = max_seq_len(candidate, gpu_mem_bytes, host_mem_bytes)
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
