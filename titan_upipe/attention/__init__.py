"""Context-parallel attention (core layer): DeepSpeed-Ulysses, UPipe (Untied Ulysses), zigzag ring, USP.

Public API: ``convert_attention(module, mode, cp_mesh, heads_per_stage=None, backend="sdpa")``;
``document_mask(document_ids, cp_mesh)`` for packed documents (every mode).
See docs/attention.md for the design.

============== ==========================================================================
module         holds
============== ==========================================================================
module         ``convert_attention``, ``ContextParallelAttention``: a TorchTitan attention,
               converted (shares its parameters)
schedule       UPipe's GQA-aware head schedule (stages of U query heads)
ulysses        Ulysses attention (all-to-all, kernel, all-to-all)
upipe          UPipe's autograd function: stage by stage, forward and backward
ring, ring_plan zigzag ring attention, its per-step block plan (causal or per document)
run, projection, collectives   what one attention call needs: Q/K/V projection and RoPE
               per head slice, the all-to-alls
backends       the local kernels and their contract (sdpa, math, auto; base class in
               backend_base, flash_attn 2/3/4 in flash_backends)
documents      packed documents: ``document_mask`` (block-causal ``attention_masks``), the
               masked and per-document kernels
contract       the contract check every backend must pass
validation     input and mesh checks that run before any communication
memory_model   UPipe's per-stage memory terms (the planner's attention terms)
comm_model     all-to-all and ring bytes of one attention call
============== ==========================================================================
"""

from titan_upipe.attention.backends import BACKENDS, LocalAttentionBackend, get_backend
from titan_upipe.attention.documents import DocumentMask, document_mask
from titan_upipe.attention.input_checks import SUPPORTED_MODES
from titan_upipe.attention.module import (
    AttentionSpec,
    ContextParallelAttention,
    convert_attention,
    sequence_mesh,
)
from titan_upipe.attention.ring import RingAttentionBackend
from titan_upipe.attention.schedule import HeadSchedule, Stage, build_schedule, verify_schedule
from titan_upipe.parallel.cp_layout import valid_cp_degrees, valid_heads_per_stage

__all__ = [
    "BACKENDS",
    "SUPPORTED_MODES",
    "AttentionSpec",
    "ContextParallelAttention",
    "DocumentMask",
    "HeadSchedule",
    "LocalAttentionBackend",
    "RingAttentionBackend",
    "Stage",
    "build_schedule",
    "convert_attention",
    "document_mask",
    "get_backend",
    "valid_cp_degrees",
    "valid_heads_per_stage",
    "sequence_mesh",
    "verify_schedule",
]
