"""The memory terms: one enum member per kind of live tensor, its value the label reports show.

A builder returns ``Terms`` (``{key: bytes}``, insertion-ordered) keyed by ``Term`` members, or
by ``Counted`` for the two terms whose label names a block count; ``labelled`` turns them into
the ``{label: bytes}`` of a ``Moment`` (with the block's prefix, e.g. ``block 0: ``). The labels
of ``titan_upipe.costs.attention_memory`` (which keys its terms by text) enter through
``from_memory_model``: every one of them has a member below, and an unknown one is a KeyError.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, unique

from titan_upipe.spec.units import format_bytes


@unique
class Term(Enum):
    """A kind of live tensor on a rank; the value is its label in reports."""

    # state and inputs
    PARAMS = "parameters (fp32, FSDP shard)"
    ADAMW_MOMENTS = "AdamW exp_avg + exp_avg_sq (fp32 shards)"
    GRAD_SHARDS = "gradients (fp32 shards reduced so far)"
    TOKENS = "token ids, labels, positions (int64)"
    ROPE_ROWS = "RoPE rows of this rank's positions (fused_rope)"
    ROPE_TABLE = "RoPE table(s), full length (no fused_rope)"
    ADAMW_TEMP = "AdamW foreach temporary (sqrt(exp_avg_sq), fp32 shards)"
    ADAMW_WORK = "AdamW moments on host: device work buffers exp_avg, exp_avg_sq (largest shard)"
    ADAMW_TEMP_LARGEST = "AdamW foreach temporary of one parameter (sqrt(exp_avg_sq), largest shard)"
    # packed documents (block_causal): titan_upipe.plan.documents
    DOC_INDEX = "document index of the global batch (int64 [B, S], every rank)"
    DOC_BUILD = "document mask build: EOS as int64 and its cumsum (from_eos)"
    DOC_SEGMENTS_BUILD = "document segments build: positions, their documents, run breaks"
    DOC_LAYOUT = "document-aware layout: each row's positions of this rank (int64 [B, S/C])"
    # FSDP2
    FSDP_BLOCK = "FSDP: unsharded block parameters"
    FSDP_GATHER_THIS = "FSDP: all-gather buffer of this block (kept until the next all-gather)"
    FSDP_GATHER_NEXT = "FSDP: all-gather buffer of the next block (backward prefetch)"
    FSDP_REDUCE_HELD = "FSDP: reduce-scatter input of the previous group (fp32, held)"
    FSDP_OUTPUT_GROUP = "FSDP: norm + output unsharded (kept from forward to backward)"
    FSDP_EMBEDDING_GATHER = "FSDP: embedding unsharded + all-gather buffer"
    FSDP_EMBEDDING = "FSDP: embedding unsharded"
    FSDP_BLOCK_GRADS = "FSDP: unsharded block gradients (compute dtype)"
    FSDP_REDUCE = "FSDP: reduce-scatter input (fp32) + output"
    # hidden states between and around blocks
    EMBEDDING_OUT = "embedding output"
    BLOCK0_INPUT = "embedding output (block 0 input)"
    BLOCKS_CHECKPOINTED = "checkpointed inputs of {blocks} block(s)"
    BLOCKS_RESIDENT = "inputs of {blocks} block(s) kept on the device (resident_blocks)"
    BLOCKS_KEPT = "activations kept by {blocks} block(s) ({each} each)"
    BLOCK_INPUT = "block input"
    CHECKPOINTED_INPUT = "checkpointed block inputs"
    RECOMPUTE_INPUT = "block input (fetched/checkpointed, recomputed from)"
    PREFETCHED_INPUT = "next block's input prefetched from host"
    BLOCKS_KEPT_ATTENTION = "attention output + LSE kept by {blocks} block(s) on the device ({each} each)"
    KEPT_ATTENTION = "this block's kept attention output + LSE"
    PREFETCHED_KEPT_ATTENTION = "next block's kept attention output + LSE prefetched from host"
    RESIDUAL = "h = x + attention (residual)"
    BLOCK_OUT = "block output"
    GRAD_BLOCK_OUT = "gradient w.r.t. the block output (incoming)"
    GRAD_RESIDUAL = "gradient w.r.t. h (held for the residual)"
    GRAD_BLOCK_INPUT = "gradient w.r.t. the block input"
    GRAD_EMBEDDING_OUT = "gradient w.r.t. the embedding output"
    EMBEDDING_GRAD = "embedding weight gradient (dense, compute dtype)"
    # RMSNorm
    ATTENTION_NORM_OUT = "attention_norm output"
    ATTENTION_NORM_STATS = "attention_norm saved statistics"
    FFN_NORM_OUT = "ffn_norm output"
    FFN_NORM_STATS = "ffn_norm saved statistics"
    FFN_NORM_DX = "ffn_norm bwd: dX"
    FFN_NORM_TILES = "ffn_norm bwd: RMSNorm tile temporaries (fp32)"
    FFN_NORM_DX_FP32 = "ffn_norm bwd: dX and fp32 temporaries"
    # MLP
    MLP_SAVED = "MLP saved: w1 x, silu, w3 x, product (4 x d_ff)"
    MLP_OUT = "MLP output"
    MLP_OUT_W2 = "MLP output (w2)"
    MLP_TILES = "MLP tile intermediates (3 tiles x d_ff)"
    MLP_NOGRAD = "MLP intermediates (no grad: 3 x d_ff)"
    MLP_DX = "MLP bwd: dX"
    MLP_WEIGHT_ACCUMULATORS = "MLP bwd: w1/w2/w3 fp32 gradient accumulators"
    MLP_TILES_BWD = "MLP bwd: tile intermediates / final casts"
    MLP_SAVED_NO_PRODUCT = "MLP saved: w1 x, silu, w3 x (product freed)"
    MLP_GRADS = "MLP bwd: d(product), d(silu), d(w3 x)"
    MLP_DX_TO_NORM = "MLP bwd: dX (the norm's incoming gradient)"
    GRADS_W2 = "unsharded grads: w2"
    GRADS_MLP = "unsharded grads: w1, w2, w3"
    GRADS_WO_NORM = "unsharded grads: wo, ffn_norm"
    # attention kernels (inside one local call)
    KERNEL_KV_EXPANDED = "attention kernel: K/V expanded to the query heads (sdpa fp32: memory-efficient kernel)"
    KERNEL_DQ_FP32 = "attention kernel: flash bwd fp32 dQ accumulator"
    KERNEL_DKV_FP32 = "attention kernel: flash bwd fp32 dK/dV accumulators (GQA)"
    KERNEL_DKV_EXPANDED = "attention kernel: FA2 bwd dK/dV expanded to the query heads (GQA)"
    # zigzag ring attention
    RING_OUT_FP32 = "ring: fp32 output accumulator + LSE"
    RING_KV = "ring: K/V block and its receive buffer"
    RING_LOCAL_OUT = "ring: local kernel output + LSE"
    RING_MERGE = "ring: merge temporaries (fp32)"
    RING_DQ_FP32 = "ring: fp32 dQ accumulator"
    RING_DKV_FP32 = "ring: fp32 dK/dV blocks (two in flight + receive)"
    RING_LOCAL_GRADS = "ring: local kernel dQ, dK, dV"
    # Ulysses (and ring, USP) attention
    ATT_ROPE_ROWS = "attention saved: RoPE rows for Q and K"
    ATT_Q = "attention saved: Q after all-to-all"
    ATT_KV = "attention saved: K, V after all-to-all"
    ATT_KERNEL_OUT = "attention saved: kernel output"
    ATT_LSE = "attention saved: LSE (fp32)"
    ATT_WO_INPUT = "attention saved: output after all-to-all (wo input)"
    ATT_PRE_A2A = "attention fwd: rotated Q, K/V before the all-to-all"
    ATT_PRE_A2A_COPIES = "attention fwd: rotated Q, K/V copies before the all-to-all"
    ATT_OUT_RECV = "attention fwd: output all-to-all receive buffer"
    ATT_Q_PROJ = "attention fwd: Q projection"
    ATT_ROPE_FP32 = "attention fwd: RoPE fp32 temporaries of Q"
    ATT_Q_ROTATED = "attention fwd: rotated Q (cast back)"
    ATT_NOGRAD_QKV = "attention fwd (no grad): Q, K, V after all-to-all"
    ATT_NOGRAD_PRE_A2A = "attention fwd (no grad): rotated Q, K/V before the all-to-all"
    ATT_NOGRAD_OUT = "attention fwd (no grad): kernel output, its all-to-all, wo input"
    ATT_NOGRAD_LSE = "attention fwd (no grad): LSE"
    ATT_NOGRAD_ROPE_FP32 = "attention fwd (no grad): RoPE fp32 temporaries of Q"
    ATT_DO = "attention bwd: dO after all-to-all"
    ATT_DQKV = "attention bwd: dQ, dK, dV from the kernel"
    # UPipe, saved between forward and backward
    UPIPE_OUT = "UPipe output buffer (H heads)"
    UPIPE_LSE = "UPipe LSE (fp32, all stages)"
    UPIPE_WIDENED = "UPipe all-to-all buffers widened to the K/V heads per rank"
    # UPipe forward: memory_model.upipe_forward_terms
    UPIPE_FWD_OUT = "UPipe fwd: output buffer (H heads)"
    UPIPE_FWD_LSE = "UPipe fwd: LSE (all stages)"
    UPIPE_FWD_SEND = "UPipe fwd: send buffer (U heads)"
    UPIPE_FWD_RECV = "UPipe fwd: receive buffer = stage Q (U heads)"
    UPIPE_FWD_STAGE_OUT = "UPipe fwd: attention output of the stage (U heads)"
    UPIPE_FWD_KV = "UPipe fwd: resident K+V (full sequence)"
    # UPipe backward: memory_model.upipe_backward_terms and upipe_input_grad_terms
    UPIPE_BWD_OUT = "UPipe bwd: saved output buffer (H heads)"
    UPIPE_BWD_LSE = "UPipe bwd: LSE (all stages)"
    UPIPE_BWD_LAYER_OUT = "UPipe bwd: layer output held by caller"
    UPIPE_BWD_SEND = "UPipe bwd: send buffer (U heads)"
    UPIPE_BWD_RECV = "UPipe bwd: receive buffers Q, Out, dOut (3 U heads)"
    UPIPE_BWD_KERNEL_DQ = "UPipe bwd: dQ from the kernel (U heads)"
    UPIPE_BWD_KV = "UPipe bwd: resident K+V"
    UPIPE_BWD_KERNEL_DKV = "UPipe bwd: dK+dV from the kernel"
    UPIPE_BWD_DKV_SUMS = "UPipe bwd: dK+dV fp32 sums over the group's stages"
    UPIPE_BWD_KV_GRADS_DONE = "UPipe bwd: K/V projections' gradients of the finished KV groups"
    UPIPE_BWD_Q_GRADS = "UPipe bwd: output buffer = query projections' gradients (H heads)"
    UPIPE_BWD_BUFFERS = "UPipe bwd: send buffer, receive buffers Q, Out, dOut, resident K+V (kept to the end)"
    UPIPE_BWD_KV_GRADS = "UPipe bwd: K/V projections' gradients"
    UPIPE_BWD_ROWS = "UPipe bwd: stacked wq and K/V rows"
    UPIPE_BWD_DX = "UPipe bwd: dX"
    UPIPE_BWD_DX_TILE = "UPipe bwd: dX GEMM operand tile"
    # UPipe backward: the planner's own
    UPIPE_BWD_ACCUMULATORS = "UPipe bwd: wq/wk/wv fp32 gradient accumulators"
    UPIPE_BWD_PROJECTION = "UPipe bwd: recomputed projection and its gradient (one destination)"
    UPIPE_BWD_ROPE = "UPipe bwd: RoPE under autograd in projection backprop (one destination)"
    UPIPE_BWD_FLUSH_GRADS = "UPipe bwd: K/V projections' gradients of the group being flushed"
    UPIPE_BWD_FLUSH_ROPE = "UPipe bwd: RoPE under autograd in K's projection backprop (one run)"
    # TSP (titan_upipe.plan.tsp): attention over D owners, the ring MLP
    TSP_ATTENTION_SHARDS = "TSP attention: received [wq|wk|wv|wo^T] shards (compute dtype)"
    TSP_PACKED_FP32 = "TSP: this rank's packed fp32 weight shard"
    TSP_ROPE_ROWS = "TSP attention saved: RoPE rows (2 calls per owner)"
    TSP_QK_NORM_INPUTS = "TSP attention saved: q/k before qk-norm + rstd"
    TSP_Q = "TSP attention saved: rotated queries (H heads)"
    TSP_KV_LOCAL = "TSP attention saved: local K/V buckets (K heads)"
    TSP_KERNEL_OUT = "TSP attention saved: kernel outputs + LSE (fp32)"
    TSP_WO_INPUT = "TSP attention saved: wo inputs (H heads)"
    TSP_GATHERED_KV = "TSP attention: last bucket's gathered K/V (whole sequence)"
    TSP_KV_REORDER = "TSP attention: K/V gathered, concatenated, reordered (one bucket)"
    TSP_OWNER_KV = "TSP attention: the owner's rotated K and V"
    TSP_OWNER_OUT = "TSP attention: the owner's bucket outputs"
    TSP_OUTPUT_SUMS = "TSP: fp32 output sum, last and new term (+ GEMM output)"
    TSP_OUTPUT_GRAD_FP32 = "TSP attention bwd: fp32 output gradient"
    TSP_OWNER_OUT_GRAD = "TSP attention bwd: the owner's output gradient (H/D heads)"
    TSP_OWNER_WEIGHT_GRAD = "TSP attention bwd: the owner's wo^T gradient"
    TSP_DKV_SUMS = "TSP attention bwd: fp32 dK/dV sums, stacked, split per rank, stacked"
    TSP_DKV_LAST_CHUNK = "TSP attention bwd: the last chunk's dK/dV over its keys"
    TSP_DQ = "TSP attention bwd: the bucket's dQ"
    TSP_DX_SUM_FP32 = "TSP attention bwd: fp32 dX sum over the owners (grad_sum)"
    TSP_DX_GEMMS = "TSP bwd: dX GEMM outputs and their sum"
    TSP_MLP_SHARDS = "TSP MLP saved: every step's [w1|w3|w2^T] shard (compute dtype)"
    TSP_MLP_PROJECTIONS = "TSP MLP saved: every step's w1 x, w3 x (no mlp_recompute)"
    TSP_MLP_STEP_PROJECTIONS = "TSP MLP: the step's w1 x, w3 x"
    TSP_MLP_DX_FP32 = "TSP MLP bwd: fp32 dX"
    TSP_MLP_STEP_GRADS = "TSP MLP bwd: the step's projections and their gradients"
    TSP_MLP_SHARD_GRADS = "TSP MLP bwd: fp32 shard gradient (local, sum, receive buffer)"
    TSP_MLP_GRADS = "TSP MLP bwd: this block's w1/w2/w3 gradients (fp32 shard)"
    # loss
    FINAL_NORM_OUT = "final norm output"
    FINAL_NORM_INPUT = "last block output (final norm input)"
    OUTPUT_GRAD = "unsharded grad: output weight"
    LIGER_GRAD_INPUT_FWD = "Liger CE: grad_input computed in forward"
    LIGER_GRAD_WEIGHT = "Liger CE: grad_weight (unsharded, compute dtype)"
    LIGER_LOGITS = "Liger CE: logits chunk"
    LIGER_LOSS = "Liger CE: per-token loss (fp32)"
    LIGER_GRAD_INPUT = "Liger CE: grad_input"
    CE_LSE = "fused CE: per-token LSE (fp32)"
    CE_LOGITS = "fused CE: logits chunk and its fp32 copy"
    CE_DH = "fused CE bwd: dH"
    CE_DW_FP32 = "fused CE bwd: dW fp32 accumulator"
    CE_LOGITS_BWD = "fused CE bwd: chunk logits fp32 + cast"
    CE_DW = "fused CE bwd: dW product (compute dtype)"
    LOGITS = "logits"
    LOGITS_FP32 = "logits fp32 copy"
    LOG_SOFTMAX = "log_softmax (fp32)"
    LOG_SOFTMAX_SAVED = "log_softmax (fp32, saved)"
    DLOGITS = "CE bwd: dlogits fp32 (2 buffers)"

    @property
    def label(self) -> str:
        return self.value

    # Members are singletons compared by identity, so identity hashing is Enum's equality; Enum's
    # own __hash__ (a Python call hashing the name) was a tenth of a planner answer.
    __hash__ = object.__hash__


@dataclass(frozen=True)
class Counted:
    """A term whose label names how many blocks it covers (and their bytes each)."""

    term: Term
    blocks: int
    each: int = 0

    @property
    def label(self) -> str:
        return self.term.value.format(blocks=self.blocks, each=format_bytes(self.each))


Terms = dict[Term | Counted, int]

_BY_LABEL = {term.value: term for term in Term}


def from_memory_model(prefix: str, terms: dict[str, int], drop: tuple[Term, ...] = ()) -> Terms:
    """``memory_model``'s ``{label: bytes}`` as Terms (label ``prefix: label``), less ``drop``."""
    keyed = {_BY_LABEL[f"{prefix}: {label}"]: value for label, value in terms.items()}
    return {term: value for term, value in keyed.items() if term not in drop}


_LABEL_OF_TERM = {term: term.value for term in Term}
"""Each Term's label, looked up once: the length search labels some 100,000 terms per answer."""


def labelled(terms: Terms, prefix: str = "") -> dict[str, int]:
    """``{label: bytes}`` for a Moment, each label after ``prefix: `` when one is given."""
    head = f"{prefix}: " if prefix else ""
    return {f"{head}{_LABEL_OF_TERM[key] if key.__class__ is Term else key.label}": value
            for key, value in terms.items()}
