"""A plan's result: the moments of one step (live bytes by labelled term) and what they add up to.

``peak_gpu_bytes = max over moments of sum(terms)`` is comparable to
``torch.cuda.max_memory_allocated``; the runtime reserve is added only in ``fits``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_upipe.plan.job import PlanInput


@dataclass
class Moment:
    """Live bytes at one point of the step, by named term."""

    phase: str
    """forward | loss | backward | optimizer"""
    where: str
    terms: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.terms.values())


@dataclass
class MemoryPlan:
    job: PlanInput
    moments: list[Moment]
    host_bytes_per_rank: int
    """Offloaded block inputs in host memory (pinned: rounded up as PyTorch's pinned allocator does),
    plus the AdamW moments with ``optimizer_state_on_host`` (``host_optimizer_bytes_per_rank``)."""
    host_pinned: bool
    host_bytes_pageable_per_rank: int
    host_bytes_pinned_per_rank: int
    notes: list[str] = field(default_factory=list)
    host_optimizer_bytes_per_rank: int = 0
    """AdamW moments kept on the host (``optimizer_state_on_host``), included in the host bytes above."""

    @property
    def peak(self) -> Moment:
        return max(self.moments, key=lambda m: m.total)

    @property
    def peak_gpu_bytes(self) -> int:
        return self.peak.total

    @property
    def peak_phase(self) -> str:
        return self.peak.phase

    @property
    def breakdown(self) -> dict[str, int]:
        """The peak moment's terms (they sum to ``peak_gpu_bytes``)."""
        return dict(self.peak.terms)

    @property
    def phase_peaks(self) -> dict[str, int]:
        peaks: dict[str, int] = {}
        for m in self.moments:
            peaks[m.phase] = max(peaks.get(m.phase, 0), m.total)
        return peaks

    @property
    def host_bytes(self) -> int:
        """Host bytes of one node (``gpus_per_node`` ranks, or fewer when the job is smaller)."""
        return self.host_bytes_per_rank * min(self.job.ranks, self.job.gpus_per_node)

    def fits(self, gpu_mem_bytes: float, host_mem_bytes: float | None = None) -> bool:
        if self.peak_gpu_bytes + self.job.reserve > gpu_mem_bytes:
            return False
        return host_mem_bytes is None or self.host_bytes <= host_mem_bytes
