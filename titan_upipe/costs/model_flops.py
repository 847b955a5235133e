"""The attention FLOPs a step's throughput figures count, per token (pure arithmetic, no torch).

TorchTitan (0.2.2 and 0.3 alike: ``get_dense_model_nparams_and_flops``) counts ``6 N + 6 L H (2 D) S``
per token: every query against every key. A causal model attends to ``t + 1`` keys at position ``t``,
``(S + 1) / 2`` on average, so its matmul FLOPs per token are half that attention term and a bit. Both
adapters swap TorchTitan's term for :func:`causal_attention_flops_per_token` in the FLOPs behind
TensorBoard's ``tflops`` and ``mfu(%)``: at a million tokens the attention term is almost all of a
step's FLOPs, and the full-square count would report about twice the work done.
"""

from __future__ import annotations


def causal_attention_flops_per_token(n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> int:
    """Forward + backward matmul FLOPs of causal self-attention, averaged over the tokens."""
    return 6 * n_layers * n_heads * head_dim * (seq_len + 1)


def torchtitan_attention_flops_per_token(n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> int:
    """TorchTitan's attention term (every query sees every key; head_dims = qk + v)."""
    return 6 * n_layers * n_heads * (2 * head_dim) * seq_len


def attention_overcount(n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> int:
    """What TorchTitan's per-token FLOPs count beyond the causal attention's."""
    shape = (n_layers, n_heads, head_dim, seq_len)
    return torchtitan_attention_flops_per_token(*shape) - causal_attention_flops_per_token(*shape)
