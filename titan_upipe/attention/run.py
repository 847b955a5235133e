"""What one context-parallel attention call needs besides its tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from titan_upipe.attention.backends import LocalAttentionBackend
from titan_upipe.attention.keep import KeptAttention
from titan_upipe.attention.projection import HeadProjection
from titan_upipe.spec.head_schedule import HeadSchedule


@dataclass
class AttentionRun:
    schedule: HeadSchedule
    projection: HeadProjection
    backend: LocalAttentionBackend
    group: dist.ProcessGroup | None
    scale: float
    qk_norm: bool
    rank: int = 0
    """This rank's index in the CP group (which query heads of each stage it attends)."""
    kept: KeptAttention | None = None
    """The block's kept kernel results (``keep.py``): recorded by its forward, replayed by its
    recomputation; None: the kernel runs every time."""

    @property
    def cp_degree(self) -> int:
        return self.schedule.cp_degree

    @property
    def head_dim(self) -> int:
        return self.projection.head_dim
