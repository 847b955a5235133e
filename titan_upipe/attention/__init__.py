"""Context-parallel attention: DeepSpeed-Ulysses, UPipe (Untied Ulysses), zigzag ring and USP.

Public API: ``convert_attention(module, mode, cp_mesh, heads_per_stage=None, backend="sdpa")``.
See docs/attention.md for the design.
"""

from titan_upipe.attention.backends import BACKENDS, LocalAttentionBackend, get_backend
from titan_upipe.attention.module import (
    AttentionSpec,
    ContextParallelAttention,
    convert_attention,
    sequence_mesh,
)
from titan_upipe.attention.ring import RingAttentionBackend
from titan_upipe.attention.schedule import HeadSchedule, Stage, build_schedule, verify_schedule
from titan_upipe.attention.validation import SUPPORTED_MODES
from titan_upipe.parallel.cp_layout import valid_cp_degrees, valid_heads_per_stage

__all__ = [
    "BACKENDS",
    "SUPPORTED_MODES",
    "AttentionSpec",
    "ContextParallelAttention",
    "HeadSchedule",
    "LocalAttentionBackend",
    "RingAttentionBackend",
    "Stage",
    "build_schedule",
    "convert_attention",
    "get_backend",
    "valid_cp_degrees",
    "valid_heads_per_stage",
    "sequence_mesh",
    "verify_schedule",
]
