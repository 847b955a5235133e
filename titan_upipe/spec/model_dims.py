"""The model dimensions that decide memory and time (pure: the adapter reads them from its flavors).

Parameters per transformer block: attention ``d (2 H D + 2 KV D)`` (+ ``2 D`` q/k-norm weights
for Qwen3), SwiGLU MLP ``3 d F``, two RMSNorm weights ``2 d``. Embedding ``V d``; output
projection ``V d`` (none when tied) plus the final norm ``d``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelDims:
    """The dimensions that decide memory and time: a model's shape, whatever framework defines it."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab: int
    tied: bool = False
    qk_norm: bool = False
    rope: str = "llama3"
    """``llama3``: complex64 ``[S, D/2]`` table; ``qwen3``: fp32 ``cos‖sin`` ``[S, 2D]``."""

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        return self.dim * (2 * self.q_width + 2 * self.kv_width) + qk_norm

    @property
    def block_params(self) -> int:
        return self.attention_params + 3 * self.dim * self.ffn_dim + 2 * self.dim

    @property
    def block_tensors(self) -> int:
        return 9 + (2 if self.qk_norm else 0)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.dim

    @property
    def output_params(self) -> int:
        """The output projection plus the final norm (one FSDP group in TorchTitan)."""
        return (0 if self.tied else self.vocab * self.dim) + self.dim

    @property
    def total_params(self) -> int:
        return self.n_layers * self.block_params + self.embedding_params + self.output_params

    @property
    def param_tensors(self) -> int:
        return self.n_layers * self.block_tensors + (2 if self.tied else 3)

    def param_shapes(self) -> list[tuple[int, int]]:
        """Every parameter as ``(rows, columns)`` (a vector is ``(n, 1)``), in no particular order:
        per block wq, wk, wv ``[H D | KV D, d]``, wo ``[d, H D]``, w1, w3 ``[F, d]``, w2 ``[d, F]``, two
        norms ``[d]`` (+ q/k norms ``[D]``); the embedding ``[V, d]``, the final norm and the output
        ``[V, d]`` (none when tied). FSDP2 shards dim 0: rank 0 holds ``ceil(rows / W) columns``."""
        d, q, kv, f = self.dim, self.q_width, self.kv_width, self.ffn_dim
        block = [(q, d), (kv, d), (kv, d), (d, q), (f, d), (d, f), (f, d), (d, 1), (d, 1)]
        if self.qk_norm:
            block += [(self.head_dim, 1), (self.head_dim, 1)]
        tail = [(self.vocab, d), (d, 1)] + ([] if self.tied else [(self.vocab, d)])
        return block * self.n_layers + tail
