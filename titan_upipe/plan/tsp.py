"""TSP's block terms (``titan_upipe.tsp``, docs/tsp.md): the attention of Algorithm 1 and the ring
MLP of Algorithm 2 on one rank of a TSP group of ``D`` ranks.

Sizes per rank (``TSPSizes``): ``T`` tokens (``B S / D``), ``N = D T`` tokens of the whole batch,
``h = H/D`` query heads, ``k = K/D`` KV heads and ``f = F/D`` hidden units owned, a KV bucket of
``b`` heads; ``u = T d a`` one hidden state, ``u_h = T hd a`` one head. Weight shards, in elements:
attention ``A = (2h + 2k) hd d`` (``[wq | wk | wv | wo^T]``), MLP ``M = 3 f d`` (``[w1 | w3 | w2^T]``).
One bucket's K and V over the whole sequence: ``G = 2 b N hd`` elements.

=====================================  ==============================================================
from forward to backward               bytes (the attention's ``D`` owners together)
=====================================  ==============================================================
received attention shards              ``D a A`` (each owner's broadcast buffer: the projections save it)
RoPE rows                              ``2 D`` calls x ``4 T hd`` (Llama3, complex64) / ``2 T hd a`` (Qwen3)
qk-norm inputs (Qwen3)                 ``(H + K) u_h`` + fp32 ``rstd``
rotated queries, local K/V buckets     ``H u_h``, ``2 K u_h``
kernel outputs + LSE, ``wo`` inputs    ``H u_h + 4 H T``, ``H u_h``
MLP shards (``mlp_recompute``)         ``D a M``; without recompute also ``2 T F a`` (each step's projections)
=====================================  ==============================================================

The moments inside a block (each beside what the block keeps):

* the fp32 output sum ``Y += O Wo^T`` (attention) / ``Y += silu(X W1^T) * X W3^T W2^T`` (MLP):
  ``Y``, the previous step's fp32 term still referenced and this one's, with its compute-dtype
  GEMM output (three fp32 ``[T, d]`` from the second term on);
* the K/V all-gather's reorder to sequence order: gathered, concatenated, reordered (``3 G a``);
* the attention backward's dK/dV: the fp32 sums over the sequence, stacked, split per rank and
  stacked again for the reduce-scatter (``4 G 4``) beside the fp32 output gradient ``4 T d`` (the
  ``D`` owners' outputs were summed in fp32);
* an owner's projection backward: its ``dX`` GEMMs (``3 u``) and, from the second owner on, the
  fp32 sum of ``dX`` over the owners (``4 T d``, ``tsp.grad_sum``);
* the ring MLP's backward at a step's ``dX`` GEMMs: fp32 ``dX`` (``4 T d``), the step's projections
  and gradients (``6 T f a``), the shard gradient travelling the ring (local, sum and the receive
  buffer: ``3 x 4 M``).

Terms were read from the code and checked against the rank emulator's tracked bytes at each of
these moments (``tests/test_plan_tsp.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_upipe.plan.attention import AttentionTerms
from titan_upipe.plan.sizes import StepSizes
from titan_upipe.plan.terms import Term, Terms


@dataclass(frozen=True)
class TSPSizes:
    """The sizes TSP's terms are written in (module docstring)."""

    s: StepSizes
    degree: int
    heads: int
    kv_heads: int
    hidden: int
    bucket: int

    @classmethod
    def of(cls, s: StepSizes) -> TSPSizes:
        m, d = s.model, s.job.cp
        kv = m.n_kv_heads // d
        return cls(s, d, m.n_heads // d, kv, m.ffn_dim // d, s.job.tsp_kv_heads_per_bucket or kv)

    @property
    def attention_shard(self) -> int:
        """Elements of one rank's packed ``[wq | wk | wv | wo^T]``."""
        return (2 * self.heads + 2 * self.kv_heads) * self.s.model.head_dim * self.s.model.dim

    @property
    def mlp_shard(self) -> int:
        """Elements of one rank's packed ``[w1 | w3 | w2^T]``."""
        return 3 * self.hidden * self.s.model.dim

    @property
    def gathered_kv(self) -> int:
        """Elements of one bucket's K and V over the whole batch (``G``)."""
        return 2 * self.bucket * self.degree * self.s.tokens * self.s.model.head_dim

    @property
    def bucket_query_heads(self) -> int:
        """Query heads reading one KV bucket."""
        return self.bucket * self.heads // self.kv_heads

    @property
    def fp32_hidden(self) -> int:
        """One fp32 ``[T, d]``: the output sums and dX sums."""
        return 4 * self.s.tokens * self.s.model.dim

    @property
    def output_sums(self) -> int:
        """Bytes of the fp32 output sum at its largest (module docstring): from the second term on,
        three fp32 ``[T, d]`` (the sum, a term still referenced, the new sum or term); the
        compute-dtype GEMM output being cast beside them from the third term on (the second's cast
        has only the first term as the sum beside it), beside the first term alone with one owner."""
        cast = self.s.hidden if self.s.act_bytes != 4 else 0
        if self.degree == 1:
            return self.fp32_hidden + cast
        return 3 * self.fp32_hidden + (cast if self.degree > 2 else 0)

    def rope_rows(self) -> int:
        """Bytes one RoPE call keeps for backward: the rows of this rank's positions (Llama3:
        complex64 ``[T, hd/2]``, ``4 T hd``; Qwen3: cos and sin ``[T, hd]`` in the compute dtype, ``2 T hd a``)."""
        s = self.s
        return (4 if s.model.rope == "llama3" else 2 * s.act_bytes) * s.tokens * s.model.head_dim


def _kernel_backward(z: TSPSizes) -> Terms:
    """CUDA flash kernels' fp32 accumulators in one bucket's backward, the second query chunk
    (``T/2`` queries) over the whole sequence (``N`` keys); invisible on CPU."""
    s = z.s
    if not s.cuda or s.job.attention_backend == "math":
        return {}
    hd, q_heads, keys = s.model.head_dim, z.bucket_query_heads, z.degree * s.tokens
    terms: Terms = {Term.KERNEL_DQ_FP32: q_heads * (s.tokens // 2) * hd * 4}
    if q_heads > z.bucket and s.job.attention_backend in ("flash_attn3", "flash_attn4"):
        terms[Term.KERNEL_DKV_FP32] = 2 * z.bucket * keys * hd * 4
    if q_heads > z.bucket and s.job.attention_backend in ("flash_attn", "sdpa"):
        terms[Term.KERNEL_DKV_EXPANDED] = 2 * q_heads * keys * hd * s.act_bytes
    return terms


def tsp_attention(s: StepSizes) -> AttentionTerms:
    """TSP attention's terms (``tsp.attention``): what it saves, its forward peaks with and
    without autograd and its backward moments."""
    z = TSPSizes.of(s)
    m, uh, a, t = s.model, s.head, s.act_bytes, s.tokens
    h, kv, d = m.n_heads, m.n_kv_heads, z.degree
    saved: Terms = {Term.TSP_ATTENTION_SHARDS: d * z.attention_shard * a,
                    Term.TSP_ROPE_ROWS: 2 * d * z.rope_rows()}
    if m.qk_norm:
        # rms_norm over each head saves its input and fp32 rstd (CUDA's fused kernel); the CPU
        # composite saves the input's fp32 copy and the normalized fp32 product instead of the input
        per_head = 2 * t * m.head_dim * 4 if not s.cuda else uh
        saved[Term.TSP_QK_NORM_INPUTS] = (h + kv) * (per_head + t * 4)
    saved.update({Term.TSP_Q: h * uh, Term.TSP_KV_LOCAL: 2 * kv * uh,
                  Term.TSP_KERNEL_OUT: h * uh + h * t * 4, Term.TSP_WO_INPUT: h * uh})
    owner = {Term.TSP_Q: z.heads * uh, Term.TSP_KV_LOCAL: 2 * z.kv_heads * uh, Term.TSP_WO_INPUT: z.heads * uh,
             Term.TSP_KERNEL_OUT: z.heads * uh + z.heads * t * 4}
    # the last bucket's gathered K/V lives on in the loop's Pending (overlap) until the next owner
    kept_gather = {Term.TSP_GATHERED_KV: z.gathered_kv * a} if s.job.tsp_overlap and d > 1 else {}
    in_flight = {Term.TSP_PACKED_FP32: 4 * z.attention_shard, **kept_gather}
    # the last owner's locals at its output sum: its rotated K and V, the bucket outputs
    locals_ = {Term.TSP_OWNER_KV: 2 * z.kv_heads * uh, Term.TSP_OWNER_OUT: z.heads * uh}
    forward = {**saved, **in_flight, **locals_, Term.TSP_OUTPUT_SUMS: z.output_sums}
    # with several buckets the next one's all-gather is in flight during a bucket's reorder (overlap)
    next_bucket = {Term.TSP_GATHERED_KV: z.gathered_kv * a} if z.bucket < z.kv_heads and s.job.tsp_overlap else {}
    # before the last owner's output term: the sum and the previous owner's term, still referenced
    sums_before = min(d - 1, 2) * z.fp32_hidden
    # inside the last owner's bucket: its K/V gathered, concatenated and reordered (its outputs not yet)
    reorder = {k: v - owner[k] if k in (Term.TSP_KERNEL_OUT, Term.TSP_WO_INPUT) else v for k, v in saved.items()}
    reorder.update({Term.TSP_PACKED_FP32: 4 * z.attention_shard, Term.TSP_OWNER_KV: 2 * z.kv_heads * uh,
                    Term.TSP_KV_REORDER: 3 * z.gathered_kv * a, Term.TSP_OUTPUT_SUMS: sums_before, **next_bucket})
    forward = max((forward, reorder), key=lambda terms: sum(terms.values()))
    # without autograd: nothing saved; the last owner's shard (and the next one's in flight)
    owner_nograd = {Term.TSP_PACKED_FP32: 4 * z.attention_shard,
                    Term.TSP_ATTENTION_SHARDS: (2 if d > 1 else 1) * z.attention_shard * a,
                    Term.TSP_Q: z.heads * uh, Term.TSP_OWNER_KV: 2 * z.kv_heads * uh,
                    Term.TSP_KV_LOCAL: 2 * z.kv_heads * uh, Term.TSP_WO_INPUT: z.heads * uh}
    nograd = max(({**owner_nograd, **kept_gather, Term.TSP_OWNER_OUT: z.heads * uh,
                   Term.TSP_OUTPUT_SUMS: z.output_sums},
                  {**owner_nograd, Term.TSP_KV_REORDER: 3 * z.gathered_kv * a, Term.TSP_OUTPUT_SUMS: sums_before,
                   **next_bucket}),
                 key=lambda terms: sum(terms.values()))
    # Backward runs the owners from the last (D - 1) down. With ``done`` owners finished, their saved
    # tensors (and RoPE rows) are gone and, in bf16, the fp32 sum of their dX holds the rest
    # (tsp.grad_sum); ``outputs`` owners' wo inputs are gone (their output projection's backward ran).
    def remaining(done: int, outputs: int) -> Terms:
        terms = {k: v - (outputs if k is Term.TSP_WO_INPUT else done) * owner.get(k, 0) for k, v in saved.items()}
        terms[Term.TSP_ROPE_ROWS] = saved[Term.TSP_ROPE_ROWS] - 2 * done * z.rope_rows()
        terms[Term.TSP_DX_SUM_FP32] = z.fp32_hidden if done and a != 4 else 0
        return terms

    grads = {Term.TSP_OUTPUT_GRAD_FP32: z.fp32_hidden, Term.TSP_OWNER_OUT_GRAD: z.heads * uh,
             Term.TSP_OWNER_WEIGHT_GRAD: m.dim * z.heads * m.head_dim * a}
    # the first two owners' buckets (the second holds the dX sum instead of the first's saved tensors)
    done_before = range(min(d, 2))
    dkv = max(({**remaining(done, done + 1), **grads, Term.TSP_DKV_SUMS: 4 * z.gathered_kv * 4,
                Term.TSP_DKV_LAST_CHUNK: z.gathered_kv * a, Term.TSP_DQ: z.bucket_query_heads * uh}
               for done in done_before), key=lambda t: sum(t.values()))
    # inside the last chunk's kernel backward (CUDA workspaces): the reordered K/V and the fp32 dK/dV
    # sums so far beside the kernel's own buffers (none on CPU, where this moment is below the one above)
    kernel = max(({**remaining(done, done + 1), **grads, Term.TSP_KV_REORDER: z.gathered_kv * a,
                   Term.TSP_DKV_SUMS: z.gathered_kv * 4, Term.TSP_DKV_LAST_CHUNK: z.gathered_kv * a,
                   Term.TSP_DQ: z.bucket_query_heads * uh, **_kernel_backward(z)}
                  for done in done_before), key=lambda t: sum(t.values()))
    # an owner's projection backward (its dX GEMMs), its own bucket done
    projections = max(({**remaining(done, done), Term.TSP_OUTPUT_GRAD_FP32: z.fp32_hidden,
                        Term.TSP_DX_SUM_FP32: z.fp32_hidden if done > 1 and a != 4 else 0,
                        Term.TSP_DX_GEMMS: 3 * s.hidden} for done in range(1, min(d, 2) + 1)),
                      key=lambda t: sum(t.values()))
    return AttentionTerms(saved=saved, forward=forward, forward_nograd=nograd,
                          backward=[("dK/dV summed and stacked per rank", dkv), ("a bucket's kernel", kernel),
                                    ("an owner's projections (dX summed in fp32)", projections)])


def tsp_mlp_grads(s: StepSizes) -> Terms:
    """The block's w1/w2/w3 gradients once the ring MLP's backward is done: its fp32 shard."""
    return {Term.TSP_MLP_GRADS: 4 * TSPSizes.of(s).mlp_shard}


def tsp_mlp_saved(s: StepSizes) -> Terms:
    """The ring MLP's saved tensors: every step's shard, and without ``mlp_recompute`` each step's
    two ``[T, f]`` projections."""
    z = TSPSizes.of(s)
    terms: Terms = {Term.TSP_MLP_SHARDS: z.degree * z.mlp_shard * s.act_bytes}
    if not s.job.tsp_mlp_recompute:
        terms[Term.TSP_MLP_PROJECTIONS] = 2 * s.tokens * s.model.ffn_dim * s.act_bytes
    return terms


def tsp_mlp_forward(s: StepSizes) -> Terms:
    """The ring MLP's forward peak (with or without autograd alike: its Function saves as it goes),
    at the last step's output sum: the shards so far, the fp32 packed shard, the step's projections."""
    z, a = TSPSizes.of(s), s.act_bytes
    terms = tsp_mlp_saved(s)
    terms[Term.TSP_PACKED_FP32] = 4 * z.mlp_shard
    if s.job.tsp_mlp_recompute:
        terms[Term.TSP_MLP_STEP_PROJECTIONS] = 2 * s.tokens * z.hidden * a
    terms[Term.TSP_OUTPUT_SUMS] = z.output_sums
    return terms


def tsp_mlp_backward(s: StepSizes) -> Terms:
    """The ring MLP's backward at a step's dX GEMMs (module docstring)."""
    z, a, t = TSPSizes.of(s), s.act_bytes, s.tokens
    terms = tsp_mlp_saved(s)
    terms[Term.TSP_MLP_DX_FP32] = z.fp32_hidden
    step = 4 * t * z.hidden * a  # silu(gate), d_hidden, d_gate, d_up
    if s.job.tsp_mlp_recompute:
        step += 2 * t * z.hidden * a  # the recomputed gate and up
    terms[Term.TSP_MLP_STEP_GRADS] = step
    travelling = (3 if s.job.tsp_overlap else 2) if z.degree > 1 else 1
    terms[Term.TSP_MLP_SHARD_GRADS] = travelling * 4 * z.mlp_shard
    terms[Term.TSP_DX_GEMMS] = 3 * s.hidden
    return terms
