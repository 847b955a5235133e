"""A CPU stand-in for the four aten ops the CUDA ``sdpa`` backend calls, with their schemas'
argument names and the documented behaviour of the CUDA kernels behind them:

* flash (``_scaled_dot_product_flash_attention[_backward]``): fp16/bf16 only, native GQA
  (``Hkv`` divides ``Hq``, dK/dV summed over a group), LSE ``[B, H, S]``; the dense call
  returns no cumulative lengths (None) and its backward requires that;
* memory-efficient (``_scaled_dot_product_efficient_attention[_backward]``): equal query and
  K/V head counts only (no GQA), LSE rows padded to a multiple of 32, and its backward reads
  that padded layout;
* both backwards compute from the ``out``/``logsumexp`` they are given (flash-attention).

The arithmetic is ``MathBackend``'s. This lets ``SdpaCudaKernels``' Python (argument order,
GQA handling, LSE padding, what its backward is fed) run and be checked without a GPU;
``test_emulated_ops_match_the_aten_schemas`` keeps the names in step with the real ops.
"""

from __future__ import annotations

import torch

from titan_upipe.attention.backends import LSE_ALIGN, LocalAttentionBackend, MathBackend, SdpaCpuKernels

_MATH = MathBackend()


def _scale(query, scale):
    return query.shape[-1] ** -0.5 if scale is None else scale


def _check_common(query, key, dropout_p):
    if dropout_p != 0.0:
        raise RuntimeError("emulation: dropout is not modelled")
    if query.shape[1] % key.shape[1]:
        raise RuntimeError("number of heads in key/value must divide number of heads in query")


def _scaled_dot_product_flash_attention(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                                        *, scale=None):
    _check_common(query, key, dropout_p)
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only supports fp16 and bf16 inputs")
    out, lse = _MATH.forward(query, key, value, _scale(query, scale), is_causal)
    rng = torch.zeros(2, dtype=torch.int64)
    return (out, lse, None, None, query.shape[2], key.shape[2], rng, torch.zeros((), dtype=torch.int64),
            torch.empty(0, dtype=query.dtype))


def _scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                                 max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset,
                                                 *, scale=None):
    _check_common(query, key, dropout_p)
    if cum_seq_q is not None or cum_seq_k is not None:
        raise RuntimeError("emulation: a defined cum_seq makes the kernel treat the batch as varlen")
    if (max_q, max_k) != (query.shape[2], key.shape[2]):
        raise RuntimeError(f"max_q/max_k {max_q, max_k} are not the sequence lengths")
    if logsumexp.shape != query.shape[:3]:
        raise RuntimeError(f"logsumexp {tuple(logsumexp.shape)} is not [B, H, S]")
    return _MATH.backward(grad_out, query, key, value, out, logsumexp, _scale(query, scale), is_causal)


def _padded_rows(s: int) -> int:
    return -(-s // LSE_ALIGN) * LSE_ALIGN


def _check_no_gqa(query, key):
    if key.shape[1] != query.shape[1]:
        raise RuntimeError("memory-efficient attention: key/value must have as many heads as query")


def _scaled_dot_product_efficient_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                                            is_causal=False, *, scale=None):
    _check_common(query, key, dropout_p)
    _check_no_gqa(query, key)
    if attn_bias is not None:
        raise RuntimeError("emulation: attn_bias is not modelled")
    out, lse = _MATH.forward(query, key, value, _scale(query, scale), is_causal)
    padded = lse.new_full((*lse.shape[:-1], _padded_rows(lse.shape[-1])), float("inf"))
    padded[..., : lse.shape[-1]] = lse
    return out, padded, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)


def _scaled_dot_product_efficient_attention_backward(grad_out_, query, key, value, attn_bias, out, logsumexp,
                                                     philox_seed, philox_offset, dropout_p, grad_input_mask,
                                                     is_causal=False, *, scale=None):
    _check_common(query, key, dropout_p)
    _check_no_gqa(query, key)
    s = query.shape[2]
    if logsumexp.shape[-1] != _padded_rows(s):
        raise RuntimeError(f"logsumexp has {logsumexp.shape[-1]} rows, the kernel lays out {_padded_rows(s)}")
    dq, dk, dv = _MATH.backward(grad_out_, query, key, value, out, logsumexp[..., :s], _scale(query, scale), is_causal)
    return dq, dk, dv, None


class EmulatedAtenSdpa:
    """Stands where ``torch.ops.aten`` does in ``SdpaCudaKernels(ops=...)``."""

    OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward")

    _scaled_dot_product_flash_attention = staticmethod(_scaled_dot_product_flash_attention)
    _scaled_dot_product_flash_attention_backward = staticmethod(_scaled_dot_product_flash_attention_backward)
    _scaled_dot_product_efficient_attention = staticmethod(_scaled_dot_product_efficient_attention)
    _scaled_dot_product_efficient_attention_backward = staticmethod(_scaled_dot_product_efficient_attention_backward)


class RecomputeBackward(LocalAttentionBackend):
    """What the CUDA ``sdpa`` branch did before: backward recomputes the block under autograd
    with ``F.scaled_dot_product_attention`` and ignores the ``out``/``lse`` it is given."""

    name = "recompute"
    merged_backward = False

    def __init__(self) -> None:
        self.inner = SdpaCpuKernels()

    def forward(self, q, k, v, scale, causal=True):
        return self.inner.forward(q, k, v, scale, causal)

    def backward(self, dout, q, k, v, out, lse, scale, causal=True):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            recomputed = torch.nn.functional.scaled_dot_product_attention(
                *leaves, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
            return torch.autograd.grad(recomputed, leaves, dout)
