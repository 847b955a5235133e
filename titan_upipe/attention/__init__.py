"""Context-parallel attention (core layer): DeepSpeed-Ulysses, UPipe (Untied Ulysses), zigzag ring, USP.

Public API: ``convert_attention(module, mode, cp_mesh, heads_per_stage=None, backend="sdpa")``;
``document_mask(document_ids, cp_mesh)`` for packed documents (every mode).
See docs/attention.md for the design.

============== ==========================================================================
module         holds
============== ==========================================================================
module         ``convert_attention``, ``ContextParallelAttention``: a TorchTitan attention,
               converted (shares its parameters)
ulysses        Ulysses attention (all-to-all, kernel, all-to-all)
upipe          UPipe's autograd function: stage by stage, forward and backward (its head
               schedule is ``spec.head_schedule``)
ring, ring_plan zigzag ring attention, its per-step block plan (causal or per document)
run, projection, collectives   what one attention call needs: Q/K/V projection and RoPE
               per head slice, the all-to-alls
backends       the local kernels and their contract (sdpa, math, auto; base class in
               backend_base, cuDNN in cudnn_backend, flash_attn 2/3/4 in flash_backends;
               compiled kernels in kernel_compiles; measured speeds: ``costs.kernel_speed``)
documents      packed documents: the masked and per-document kernels (the mask itself,
               ``document_mask``, is ``parallel.document_mask``)
keep           kept attention: record the kernel's results in forward, replay them in the
               recomputation (the plan is ``spec.keep_attention``)
input_checks   input and mesh checks that run before any communication
============== ==========================================================================

The kernel contract harnesses are ``titan_upipe.contracts``; UPipe's memory and communication
models are ``costs.attention_memory`` and ``costs.attention_comm``.
"""

from titan_upipe.attention.backends import BACKENDS, LocalAttentionBackend, get_backend
from titan_upipe.attention.input_checks import SUPPORTED_MODES
from titan_upipe.attention.module import (
    AttentionSpec,
    ContextParallelAttention,
    convert_attention,
    sequence_mesh,
)
from titan_upipe.attention.ring import RingAttentionBackend
from titan_upipe.parallel.document_mask import DocumentMask, document_mask
from titan_upipe.spec.cp_layout import valid_cp_degrees, valid_heads_per_stage
from titan_upipe.spec.head_schedule import HeadSchedule, Stage, build_schedule, verify_schedule

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
