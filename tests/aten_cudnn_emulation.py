"""A CPU stand-in for the two aten ops the ``cudnn`` backend calls, with their schemas' argument
names and the documented behaviour of torch's cuDNN attention behind them:

* fp16/bf16 only; native GQA (``Hkv`` divides ``Hq``, dK/dV returned with ``Hkv`` heads);
* the forward returns ``out`` laid out like ``query`` (torch's ``alloc_with_matching_layout``),
  the logsumexp as ``[B, H, S, 1]`` fp32 (none without ``compute_log_sumexp``), no cumulative
  lengths for a dense call (None) and 0-dim int64 RNG placeholders;
* the backward computes from the ``out``/``logsumexp`` it is given (flash-attention), and
  rejects what the CUDA path would fail on: ``grad_out`` strides that differ from ``out``'s
  (the ``same_strides(o, dO_)`` assert of pytorch#176915), a logsumexp that is not a contiguous
  ``[B, H, S, 1]``, defined cumulative lengths (they switch the kernel to packed sequences),
  max_q/max_k that are not the Python-int sequence lengths, RNG placeholders that are not the
  forward's tensors.

The arithmetic is ``MathBackend``'s. Masks and dropout are not modelled (the backend passes
neither). ``test_emulated_cudnn_ops_match_the_aten_schemas`` keeps the names in step with the
real ops.
"""

from __future__ import annotations

import torch

from titan_upipe.attention.backends import CudnnBackend, MathBackend

_MATH = MathBackend()


def _scale(query, scale):
    return query.shape[-1] ** -0.5 if scale is None else scale


def _check_call(query, key, attn_bias, dropout_p):
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("cuDNN attention only supports fp16 and bf16 inputs")
    if query.shape[1] % key.shape[1]:
        raise RuntimeError("number of heads in key/value must divide number of heads in query")
    if attn_bias is not None:
        raise RuntimeError("emulation: attn_bias is not modelled")
    if dropout_p != 0.0:
        raise RuntimeError("emulation: dropout is not modelled")


def _scaled_dot_product_cudnn_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                                        is_causal=False, return_debug_mask=False, *, scale=None):
    _check_call(query, key, attn_bias, dropout_p)
    out, lse = _MATH.forward(query, key, value, _scale(query, scale), is_causal)
    laid_out = torch.empty_like(query).copy_(out)  # query's stride order, as the CUDA op allocates it
    logsumexp = lse.unsqueeze(-1).contiguous() if compute_log_sumexp else torch.empty(0)
    rng = torch.zeros((), dtype=torch.int64)
    return (laid_out, logsumexp, None, None, query.shape[2], key.shape[2], rng, rng.clone(), None)


def _scaled_dot_product_cudnn_attention_backward(grad_out, query, key, value, out, logsumexp, philox_seed,
                                                 philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
                                                 dropout_p, is_causal, *, scale=None):
    _check_call(query, key, attn_bias, dropout_p)
    if grad_out.stride() != out.stride():
        raise RuntimeError(f"same_strides(o, dO_) INTERNAL ASSERT FAILED: grad_out strides {grad_out.stride()}, "
                           f"out strides {out.stride()}")
    b, h, s, _ = query.shape
    if tuple(logsumexp.shape) != (b, h, s, 1) or not logsumexp.is_contiguous() or logsumexp.dtype != torch.float32:
        raise RuntimeError(f"logsumexp {tuple(logsumexp.shape)} {logsumexp.dtype} (contiguous: "
                           f"{logsumexp.is_contiguous()}) is not the forward's contiguous fp32 [B, H, S, 1]")
    if cum_seq_q is not None or cum_seq_k is not None:
        raise RuntimeError("emulation: a defined cum_seq makes the kernel treat the batch as packed sequences")
    if type(max_q) is not int or type(max_k) is not int or (max_q, max_k) != (s, key.shape[2]):
        raise RuntimeError(f"max_q/max_k {max_q!r}, {max_k!r} are not the sequence lengths as Python ints")
    if not all(isinstance(t, torch.Tensor) and t.dtype == torch.int64 for t in (philox_seed, philox_offset)):
        raise RuntimeError("philox_seed/philox_offset are not the forward's int64 tensors")
    return _MATH.backward(grad_out, query, key, value, out, logsumexp[..., 0], _scale(query, scale), is_causal)


class EmulatedAtenCudnn:
    """Stands where ``torch.ops.aten`` does in ``CudnnBackend(ops=...)``."""

    OPS = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")

    _scaled_dot_product_cudnn_attention = staticmethod(_scaled_dot_product_cudnn_attention)
    _scaled_dot_product_cudnn_attention_backward = staticmethod(_scaled_dot_product_cudnn_attention_backward)


def emulated_cudnn_backend() -> CudnnBackend:
    return CudnnBackend(ops=EmulatedAtenCudnn())
