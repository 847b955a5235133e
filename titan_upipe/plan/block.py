"""Terms of one transformer block: what it keeps from forward to backward, its forward peak and
its backward moments (MLP, ffn_norm, attention), beyond its input and the blocks below it.

A block is ``h = x + attention(attention_norm(x))``, ``out = h + mlp(ffn_norm(h))``; every
hidden state is ``u = T d a`` bytes. The MLP is SwiGLU ``w2(silu(w1 x) * w3 x)`` with ``[T, F]``
intermediates (tiled: ``mlp_tile`` tokens at a time, nothing saved).
"""

from __future__ import annotations

from typing import NamedTuple

from titan_upipe.plan.attention import AttentionTerms, ulysses_attention
from titan_upipe.plan.job import UPIPE_MODES, PlanInput
from titan_upipe.plan.sizes import StepSizes
from titan_upipe.plan.state import ATTENTION_NORM, FFN_NORM, mlp_saved, mlp_tile, norm_out
from titan_upipe.plan.terms import Term, Terms
from titan_upipe.plan.tsp import (
    tsp_attention,
    tsp_mlp_backward,
    tsp_mlp_forward,
    tsp_mlp_grads,
    tsp_mlp_saved,
)
from titan_upipe.plan.upipe import upipe_attention


class BlockMoment(NamedTuple):
    """A moment inside one block's backward."""

    where: str
    activations: Terms
    """The block's live activations (its incoming gradient included)."""
    unsharded_grads: Terms
    """Its weights' gradients in the compute dtype, before FSDP's reduce-scatter."""


def attention_terms(s: StepSizes) -> AttentionTerms:
    """The attention terms of the job's mode."""
    if s.job.resolved_mode in UPIPE_MODES:
        return upipe_attention(s)
    if s.job.tsp:
        return tsp_attention(s)
    return ulysses_attention(s)


def _mlp_saved(s: StepSizes) -> Terms:
    return tsp_mlp_saved(s) if s.job.tsp else mlp_saved(s)


def block_retained(s: StepSizes, att: AttentionTerms) -> Terms:
    """Bytes a block leaves on the device from its forward to its backward, its output included."""
    job, u = s.job, s.hidden
    if job.ac_mode == "full":
        if job.offloaded:
            return {}
        return {Term.CHECKPOINTED_INPUT: u}
    terms: Terms = {}
    terms.update(norm_out(s, ATTENTION_NORM))
    terms.update(att.saved)
    terms[Term.RESIDUAL] = u
    terms.update(norm_out(s, FFN_NORM))
    terms.update(_mlp_saved(s))
    terms[Term.BLOCK_OUT] = u
    return terms


def _mlp_tiles(s: StepSizes) -> Terms:
    return {Term.MLP_OUT: s.hidden, Term.MLP_TILES: 3 * mlp_tile(s) * s.model.ffn_dim * s.act_bytes}


def block_forward_peak(s: StepSizes, att: AttentionTerms, grad: bool,
                       block_output: bool = True, kept: int = 0) -> tuple[str, Terms]:
    """(where, terms) of the largest moment inside one block's forward, beyond its input.
    ``block_output=False``: the recomputation of offloaded AC, which stops before the final
    residual add (``offload.OffloadedFeedForwardHalf``). ``kept``: the bytes of the attention
    results the block keeps (``kept_attention_bytes``), alive from its attention on (in the
    attention's own moment they are its output and LSE, counted there)."""
    job, m, u = s.job, s.model, s.hidden
    kept_terms: Terms = {Term.KEPT_ATTENTION: kept} if kept else {}
    cands: list[tuple[str, Terms]] = []
    if grad:
        n1 = norm_out(s, ATTENTION_NORM)
        cands.append(("attention", {**n1, **att.forward}))
        before_mlp = {**n1, **att.saved, Term.RESIDUAL: u, **norm_out(s, FFN_NORM)}
        if job.tsp:
            mlp = tsp_mlp_forward(s)
        else:
            mlp = _mlp_tiles(s) if job.tiled_mlp else {**mlp_saved(s), Term.MLP_OUT_W2: u}
        cands.append(("MLP", {**before_mlp, **mlp}))
        if block_output:  # the final residual add: the MLP's output and the block output
            cands.append(("residual add after the MLP", {**before_mlp, **_mlp_saved(s), Term.MLP_OUT: u,
                                                         Term.BLOCK_OUT: u}))
    else:
        cands.append(("attention (no grad)", {Term.ATTENTION_NORM_OUT: u, **att.forward_nograd}))
        if job.tsp:
            mlp = tsp_mlp_forward(s)
        else:
            mlp = (_mlp_tiles(s) if job.tiled_mlp else
                   {Term.MLP_NOGRAD: 3 * s.tokens * m.ffn_dim * s.act_bytes, Term.MLP_OUT_W2: u})
        cands.append(("MLP (no grad)", {Term.RESIDUAL: u, Term.FFN_NORM_OUT: u, **mlp, **kept_terms}))
        cands.append(("residual add after the MLP (no grad)", {Term.RESIDUAL: u, Term.MLP_OUT: u,
                                                               Term.BLOCK_OUT: u, **kept_terms}))
    return max(cands, key=lambda c: sum(c[1].values()))


def _mlp_backward(s: StepSizes) -> tuple[Terms, Terms]:
    """(activation terms, unsharded-gradient terms) of the MLP's backward."""
    m, u, a = s.model, s.hidden, s.act_bytes
    if s.job.tsp:  # its gradients reach the fp32 shards inside (no unsharded compute-dtype gradients)
        return tsp_mlp_backward(s), {}
    if s.job.tiled_mlp:
        tile = mlp_tile(s)
        end_cast = (3 * m.dim * m.ffn_dim * a if a != 4 else 0) + 2 * tile * m.ffn_dim * a
        return {
            Term.MLP_DX: u,
            Term.MLP_WEIGHT_ACCUMULATORS: 3 * m.dim * m.ffn_dim * 4,
            Term.MLP_TILES_BWD: max(8 * tile * m.ffn_dim * a, end_cast),
        }, {}
    # w2's backward gives d(product) [F] and dW2; the product is freed, the mul's
    # backward gives d(silu) and d(w3 x) [2F] while w1 x, silu, w3 x are still saved
    return ({Term.MLP_SAVED_NO_PRODUCT: 3 * s.tokens * m.ffn_dim * a, Term.MLP_GRADS: 3 * s.tokens * m.ffn_dim * a},
            {Term.GRADS_W2: m.dim * m.ffn_dim * s.weight_bytes})


def _ffn_norm_backward(s: StepSizes) -> Terms:
    m, u = s.model, s.hidden
    if s.job.tiled_rmsnorm:
        tile = min(s.job.rmsnorm_tile_tokens or m.dim, s.tokens)
        return {Term.FFN_NORM_DX: u, Term.FFN_NORM_TILES: 7 * tile * m.dim * 4}
    if s.cuda:
        return {Term.FFN_NORM_DX: u}
    # composite rms_norm backward on CPU (fp32 temporaries), measured: 4 hidden states
    return {Term.FFN_NORM_DX_FP32: 4 * s.tokens * m.dim * 4}


def prefetches(job: PlanInput, block: int, n_layers: int) -> bool:
    """Whether block ``block``'s backward prefetches the input of the block below it: offloaded full
    AC, and that block's input offloaded (block 0 has none below; resident inputs need no copy)."""
    return job.offloaded and 1 <= block <= n_layers - job.resident_blocks


def block_backward_moments(s: StepSizes, att: AttentionTerms, prefetch: bool,
                           prefetch_kept: int = 0) -> list[BlockMoment]:
    """The moments inside one block's backward, beyond the activations of the blocks before it
    (``below``) and the state. Includes the gradient arriving from the block above and, with
    ``prefetch`` (offloaded AC, the block below offloaded: ``prefetches``), that block's input
    copied to the device ahead of its backward (on CPU the emulator counts it from the same moment);
    ``prefetch_kept``: the bytes of the block below's kept attention, copied back with its input
    (it keeps them on the host). This block's own kept attention is its recomputed attention's
    output and LSE (``att.saved``)."""
    job, m, u, p = s.job, s.model, s.hidden, s.weight_bytes
    common: Terms = {Term.GRAD_BLOCK_OUT: u}
    arriving: Terms = {Term.PREFETCHED_INPUT: u} if prefetch else {}
    if prefetch_kept:
        arriving[Term.PREFETCHED_KEPT_ATTENTION] = prefetch_kept
    if job.ac_mode == "full":
        common[Term.RECOMPUTE_INPUT] = u
        if not job.prefetch_after_attention:
            common.update(arriving)
    n1, n2 = norm_out(s, ATTENTION_NORM), norm_out(s, FFN_NORM)
    h = {Term.RESIDUAL: u}
    # 1) MLP backward (everything of the block still saved)
    mlp_bwd, mlp_grads = _mlp_backward(s)
    moments = [BlockMoment("MLP backward", {**common, **n1, **att.saved, **h, **n2, **mlp_bwd}, mlp_grads)]
    if job.ac_mode == "full":  # the recomputation (forward with autograd) before it
        where, inner = block_forward_peak(s, att, grad=True, block_output=not job.offloaded)
        moments.insert(0, BlockMoment(f"recompute forward ({where})", {**common, **inner}, {}))
    # 2) ffn_norm backward (the MLP's saved tensors are gone, its dX is the norm's incoming grad)
    mlp_done = tsp_mlp_grads(s) if job.tsp else {Term.GRADS_MLP: 3 * m.dim * m.ffn_dim * p}
    moments.append(BlockMoment("ffn_norm backward", {**common, **n1, **att.saved, **h, Term.MLP_DX_TO_NORM: u,
                                                     **_ffn_norm_backward(s)}, mlp_done))
    # 3) attention backward (MLP and ffn_norm done; grad of h held for the residual)
    grads = {**mlp_done, Term.GRADS_WO_NORM: m.dim * m.q_width * p + m.dim * p} if not job.tsp else dict(mlp_done)
    # The block output's gradient is gone by now: the engine frees it once the feed-forward
    # half's backward returned dh (offloaded AC splits TorchTitan's blocks at h; without AC or
    # with TorchTitan's checkpoint it is summed into dh and dropped the same way).
    attention_common = {k: v for k, v in common.items() if k is not Term.GRAD_BLOCK_OUT}
    for where, terms in att.backward:
        moments.append(BlockMoment(f"attention backward ({where})",
                                   {**attention_common, **n1, Term.GRAD_RESIDUAL: u, **terms}, grads))
    if arriving and job.prefetch_after_attention:
        # The late prefetch: the block's dX and its recomputed input, the next block's input arriving.
        moments.append(BlockMoment("next block's input prefetched (after the attention backward)",
                                   {**attention_common, Term.GRAD_RESIDUAL: u, **arriving}, grads))
    return moments
