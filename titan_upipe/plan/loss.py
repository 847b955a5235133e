"""Terms of the loss: the final norm, then cross-entropy over ``V`` classes for ``T`` tokens.

Stock: logits ``T V a``, their fp32 copy and log_softmax ``T V 4`` each, backward dlogits
``2 T V 4``. Chunked torch CE (fused_ce, ``torch``): one chunk of logits at a time, a per-token
fp32 LSE, an fp32 dW accumulator ``V d 4``. Liger's fused linear CE: grad_input and the
unsharded grad_weight computed in forward, ``pow2_ceil(T / ceil(V/d))``-token logits chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan_upipe.plan.sizes import StepSizes
from titan_upipe.plan.terms import Term, Terms
from titan_upipe.spec.units import pow2_ceil


@dataclass(frozen=True)
class LossTerms:
    """The loss's forward and backward terms, each with the final norm (and its input when the
    last block does not keep it among its saved activations)."""

    forward: Terms
    backward: Terms
    """Includes the output projection's unsharded weight gradient."""


def loss_terms(s: StepSizes) -> LossTerms:
    job, m, a, T = s.job, s.model, s.act_bytes, s.tokens
    V, d = m.vocab, m.dim
    norm = {Term.FINAL_NORM_OUT: s.hidden, Term.FINAL_NORM_INPUT: s.hidden}
    if job.ac_mode == "none":  # the last block's output is in its kept activations
        del norm[Term.FINAL_NORM_INPUT]
    if job.fused_ce and job.ce_backend == "liger":
        chunk = pow2_ceil(math.ceil(T / math.ceil(V / d)))
        fwd = {**norm, Term.LIGER_GRAD_INPUT_FWD: s.hidden, Term.LIGER_GRAD_WEIGHT: V * d * a,
               Term.LIGER_LOGITS: chunk * V * a, Term.LIGER_LOSS: T * 4}
        bwd = {**norm, Term.LIGER_GRAD_INPUT: s.hidden, Term.OUTPUT_GRAD: V * d * a}
        return LossTerms(fwd, bwd)
    if job.fused_ce:
        chunk = job.ce_chunk_tokens or max(1, min(T, math.ceil(T * d / V)))
        fwd = {**norm, Term.CE_LSE: T * 4, Term.CE_LOGITS: chunk * V * (a + 4 if a != 4 else 4)}
        bwd = {**norm, Term.CE_LSE: T * 4, Term.CE_DH: s.hidden, Term.CE_DW_FP32: V * d * 4,
               Term.CE_LOGITS_BWD: chunk * V * (4 + a), Term.CE_DW: V * d * a if a != 4 else 0}
    else:
        fwd = {**norm, Term.LOGITS: T * V * a, Term.LOGITS_FP32: T * V * 4 if a != 4 else 0,
               Term.LOG_SOFTMAX: T * V * 4}
        bwd = {**norm, Term.LOG_SOFTMAX_SAVED: T * V * 4, Term.DLOGITS: 2 * T * V * 4}
    # the output projection's backward (Liger computes it in forward)
    bwd[Term.OUTPUT_GRAD] = V * d * s.weight_bytes
    return LossTerms(fwd, bwd)
