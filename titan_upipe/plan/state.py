"""Terms of the step's state and of the per-block pieces every phase shares.

State, per rank, with ``P`` parameters over ``W`` FSDP ranks: fp32 parameter shards
``4 ceil(P/W)``, AdamW's two fp32 moments ``8 ceil(P/W)`` (+ a 4-byte step per tensor; none on the
device with ``optimizer_state_on_host``: ``optimizer_host_bytes`` on the host), the fp32
gradient shards reduced so far, the int64 token batch, RoPE (this rank's rows with
fused_rope, else TorchTitan's full-length table on every rank) and, with packed documents, the
global batch's int64 document index ``8 B S`` (``titan_upipe.plan.documents``). FSDP2: the
unsharded block and its all-gather buffer, in the compute dtype; in backward the next block's
prefetch and the previous group's fp32 reduce-scatter input. RMSNorm outputs (``u``) and, untiled, their saved
statistics; the plain MLP's four ``[T, F]`` saved tensors.
"""

from __future__ import annotations

import math

from titan_upipe.plan.documents import document_index_terms
from titan_upipe.plan.sizes import StepSizes
from titan_upipe.plan.terms import Term, Terms
from titan_upipe.spec.units import pow2_ceil

ATTENTION_NORM = (Term.ATTENTION_NORM_OUT, Term.ATTENTION_NORM_STATS)
FFN_NORM = (Term.FFN_NORM_OUT, Term.FFN_NORM_STATS)
"""A d-wide RMSNorm's (output, saved statistics) terms."""


def state_terms(s: StepSizes, grads: int) -> Terms:
    """Parameters, AdamW moments (steady state: a step after the first), ``grads`` bytes of
    reduced gradient shards, the token batch, RoPE and the document index (packed documents)."""
    m, w, job = s.model, s.fsdp, s.job
    terms: Terms = {Term.PARAMS: math.ceil(m.total_params / w) * 4}
    if not job.optimizer_state_on_host:
        terms[Term.ADAMW_MOMENTS] = 2 * math.ceil(m.total_params / w) * 4 + 4 * m.param_tensors
    terms.update({
        Term.GRAD_SHARDS: grads,
        # global batch and this rank's shard of inputs and labels, positions (int64; one row per
        # batch row in a document-aware layout)
        Term.TOKENS: 2 * 8 * job.batch * (job.seq_len + job.local_len)
        + 3 * 8 * job.local_len * (job.batch if job.document_layout else 1),
    })
    terms.update(rope_terms(s))
    terms.update(document_index_terms(job))
    return terms


def shard_numels(s: StepSizes) -> list[int]:
    """Elements of each parameter's local shard on rank 0 (the largest): ``ceil(rows / W) columns``."""
    return [math.ceil(rows / s.fsdp) * cols for rows, cols in s.model.param_shapes()]


def host_adamw_terms(s: StepSizes) -> Terms:
    """The step's device transients with the moments on the host: two fp32 work buffers of the
    largest shard ``n_max`` (``8 n_max``) and foreach's ``sqrt(exp_avg_sq)`` of one parameter (``4 n_max``)."""
    n_max = max(shard_numels(s))
    return {Term.ADAMW_WORK: 2 * 4 * n_max, Term.ADAMW_TEMP_LARGEST: 4 * n_max}


def optimizer_host_bytes(s: StepSizes, pinned: bool) -> int:
    """Host bytes of the moments with ``optimizer_state_on_host``: ``8`` bytes per local element,
    each tensor's two moments pinned (rounded up to a power of two, as PyTorch's pinned allocator
    does) on cuda, pageable on cpu; 0 without the switch."""
    if not s.job.optimizer_state_on_host:
        return 0
    return sum(2 * (pow2_ceil(4 * n) if pinned else 4 * n) for n in shard_numels(s))


def rope_terms(s: StepSizes) -> Terms:
    """RoPE rows: ``4 D`` bytes per position (llama3, complex64 ``[D/2]``), ``8 D`` (qwen3, fp32 cos‖sin)."""
    m, job = s.model, s.job
    per_row = 4 * m.head_dim if m.rope == "llama3" else 8 * m.head_dim
    if job.fused_rope:
        # inverse frequencies + the rows of this rank's positions, built each forward and
        # kept (in the blocks' arguments) until backward
        return {Term.ROPE_ROWS: job.local_len * per_row + 2 * m.head_dim}
    # TorchTitan's buffers: one row per position of the whole sequence, on every rank (0.3: in every attention)
    return {Term.ROPE_TABLE: job.seq_len * per_row * job.rope_tables}


def grad_shards(s: StepSizes, group_params: int) -> int:
    """fp32 gradient shard bytes of a group of ``group_params`` parameters."""
    return math.ceil(group_params / s.fsdp) * 4


def fsdp_block_terms(s: StepSizes, phase: str, block: int) -> Terms:
    """FSDP2's buffers while block ``block`` runs ``phase`` (forward or backward)."""
    if s.fsdp == 1:
        return {}
    m, p, params = s.model, s.weight_bytes, s.fsdp_block_params
    terms: Terms = {Term.FSDP_BLOCK: params * p}
    if phase == "forward":
        terms[Term.FSDP_GATHER_THIS] = params * p
    else:
        prev = params if block > 0 else m.embedding_params
        terms[Term.FSDP_GATHER_NEXT] = prev * p
        held = params if block < m.n_layers - 1 else m.output_params
        terms[Term.FSDP_REDUCE_HELD] = held * s.reduce_bytes
    return terms


def norm_out(s: StepSizes, norm: tuple[Term, Term]) -> Terms:
    """What a d-wide RMSNorm leaves alive after forward with grad (its output and saved stats)."""
    out, stats = norm
    if s.job.tiled_rmsnorm:
        return {out: s.hidden}
    extra = s.tokens * 4
    if not s.cuda:  # composite rms_norm on CPU: saves x * rstd (fp32 math)
        extra += s.tokens * s.model.dim * 4
    return {out: s.hidden, stats: extra}


def mlp_saved(s: StepSizes) -> Terms:
    """The plain MLP's saved tensors (none when tiled: it recomputes per tile)."""
    if s.job.tiled_mlp:
        return {}
    return {Term.MLP_SAVED: 4 * s.tokens * s.model.ffn_dim * s.act_bytes}


def mlp_tile(s: StepSizes) -> int:
    """Tokens of one tiled-MLP tile (default: d)."""
    return min(s.job.mlp_tile_tokens or s.model.dim, s.tokens)
