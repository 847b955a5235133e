"""Which weights and heads each rank of a TSP group owns: pure arithmetic, no processes, no torch.

TSP (``../shared/papers/001_*``) folds tensor and sequence parallelism onto one axis of ``D``
ranks: rank ``p`` owns the zigzag sequence shard ``p`` and weight shard ``p`` of every block.

=================  =====================================================  ==================
tensor             rank ``p``'s shard (TorchTitan layout)                 rows x cols
=================  =====================================================  ==================
``wq``             rows of query heads ``[p H/D, (p+1) H/D)``             ``H/D·hd x d``
``wk``, ``wv``     rows of KV heads ``[p K/D, (p+1) K/D)``                ``K/D·hd x d``
``wo``             columns of the same query heads (packed as ``wo^T``)   ``d x H/D·hd``
``w1``, ``w3``     rows ``[p F/D, (p+1) F/D)`` of the hidden units         ``F/D x d``
``w2``             the same hidden units' columns (packed as ``w2^T``)     ``d x F/D``
=================  =====================================================  ==================

Contiguous head shards keep GQA local: query head ``h`` reads KV head ``h // g`` (``g = H/K``),
and shard ``p``'s query heads ``[p H/D, (p+1) H/D)`` read exactly KV heads ``[p K/D, (p+1) K/D)``
when ``D`` divides ``K`` (the paper's GQA note: K/V shard width ``h/(gD)``). Packed buffers stack
the row blocks of one rank (``[wq | wk | wv | wo^T]``, ``[w1 | w3 | w2^T]``), all ``d`` wide, so
one broadcast or one ring send moves a rank's shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_upipe.errors import ConfigError
from titan_upipe.spec.cp_layout import check_sequence_length, sequence_divisor


def tsp_problems(n_heads: int, n_kv_heads: int, ffn_dim: int, degree: int, seq_len: int | None = None) -> list[str]:
    """Every reason ``degree`` cannot be a TSP degree for this model (empty: valid), each with the fix."""
    if degree < 1:
        return [f"TSP degree must be >= 1, got {degree}"]

    # The degrees > 1 that split every dimension at once (and the sequence): one list for every problem.
    fitting = [d for d in range(2, n_kv_heads + 1) if not (n_heads % d or n_kv_heads % d or ffn_dim % d)
               and (seq_len is None or seq_len % sequence_divisor(d, d, 1) == 0)]
    fix = ("no degree > 1 splits this model" if not fitting else f"use {fitting[0]}" if len(fitting) == 1
           else f"use one of {', '.join(map(str, fitting))}")

    problems = []
    if n_heads % degree:
        problems.append(f"TSP degree {degree} does not divide the {n_heads} query heads (each rank owns H/D heads): "
                        f"{fix}")
    if n_kv_heads % degree:
        problems.append(f"TSP degree {degree} does not divide the {n_kv_heads} KV heads (each rank owns K/D KV "
                        f"heads, so GQA groups stay on one rank): {fix}")
    if ffn_dim % degree:
        problems.append(f"TSP degree {degree} does not divide the FFN width {ffn_dim} (each rank owns F/D hidden "
                        f"units of w1/w2/w3): {fix}")
    if seq_len is not None:
        try:  # TSP's zigzag over D ranks: the ring's rule
            check_sequence_length(seq_len, degree, 1)
        except ConfigError as problem:
            problems.append(str(problem))
    return problems


def bucket_problems(n_kv_heads: int, degree: int, kv_heads_per_bucket: int) -> list[str]:
    """Why ``kv_heads_per_bucket`` (``[tsp]``; 0: all of a rank's) cannot bucket the ``n_kv_heads / degree``
    KV heads a rank owns (empty: it can, or the degree itself does not split them: ``tsp_problems``)."""
    kv_per_rank = n_kv_heads // degree if degree >= 1 and n_kv_heads % degree == 0 else 0
    if not (kv_heads_per_bucket and kv_per_rank) or kv_per_rank % kv_heads_per_bucket == 0:
        return []
    return [f"tsp.kv_heads_per_bucket = {kv_heads_per_bucket} does not divide the {kv_per_rank} KV heads per rank "
            f"(n_kv_heads {n_kv_heads} / {degree}): use 0 or one of "
            f"{[k for k in range(1, kv_per_rank + 1) if kv_per_rank % k == 0]}"]


TSP_CONFLICTS = {
    "tiled_mlp": "tsp replaces the feed-forward by its weight ring (already F/D wide per step)",
    "fused_rope": "tsp rotates Q/K with the model's full RoPE table",
}
"""Converters ``tsp`` does not compose with, and why."""


def tsp_job_problems(n_heads: int, n_kv_heads: int, ffn_dim: int, degree: int, *, kv_heads_per_bucket: int,
                     converters: list[str], data_parallel: int | None, param_offload: bool,
                     state_on_host: bool) -> list[str]:
    """Every reason a job cannot run ``model.converters = ["tsp"]`` at ``degree`` (the CP degree), each
    with the fix, as both adapters' pre-launch checks word them: the degree splits the query heads, the
    KV heads and the FFN width (:func:`tsp_problems`), ``[tsp] kv_heads_per_bucket`` fits, nothing it does
    not compose with is set. ``data_parallel``: the ranks reading different batches (None: the degrees do
    not fit the world size, reported elsewhere); ``param_offload``: ``training.enable_cpu_offload``.
    Sequence lengths (multiples of ``2 D``) are ``CPLayout``'s."""
    problems = tsp_problems(n_heads, n_kv_heads, ffn_dim, degree)
    problems += bucket_problems(n_kv_heads, degree, kv_heads_per_bucket)
    problems += [f"model.converters has 'tsp' and {name!r}: {why}; remove {name!r}"
                 for name, why in TSP_CONFLICTS.items() if name in converters]
    if data_parallel not in (None, 1):
        problems.append("tsp shards the blocks' weights over the CP ranks; data parallelism on top (FSDP of those "
                        "shards over more ranks) is not built yet: set parallelism.data_parallel_shard_degree = 1 "
                        "and data_parallel_replicate_degree = 1 (world size = context_parallel_degree)")
    if param_offload:
        problems.append("training.enable_cpu_offload with tsp is not supported (FSDP's parameter offload does not "
                        "manage the TSP-sharded weights): set training.enable_cpu_offload = false")
    if state_on_host:
        problems.append("optimizer.state_on_host with tsp is not supported yet (its sharded weights are DTensors "
                        "on the TSP mesh, not FSDP shards): set optimizer.state_on_host = false")
    return problems


def check_tsp_degree(n_heads: int, n_kv_heads: int, ffn_dim: int, degree: int, seq_len: int | None = None) -> None:
    problems = tsp_problems(n_heads, n_kv_heads, ffn_dim, degree, seq_len)
    if problems:
        raise ConfigError("; ".join(problems))


@dataclass(frozen=True)
class TSPShardSizes:
    """The shard sizes of one block for a TSP group of ``degree`` ranks (validated on creation)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    degree: int

    def __post_init__(self) -> None:
        check_tsp_degree(self.n_heads, self.n_kv_heads, self.ffn_dim, self.degree)

    @property
    def heads(self) -> int:
        """Query heads per rank, ``H/D``."""
        return self.n_heads // self.degree

    @property
    def kv_heads(self) -> int:
        """KV heads per rank, ``K/D``."""
        return self.n_kv_heads // self.degree

    @property
    def hidden(self) -> int:
        """FFN hidden units per rank, ``F/D``."""
        return self.ffn_dim // self.degree

    @property
    def attention_rows(self) -> tuple[int, int, int, int]:
        """Rows of ``wq``, ``wk``, ``wv``, ``wo^T`` in the packed attention shard."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return q, kv, kv, q

    @property
    def mlp_rows(self) -> tuple[int, int, int]:
        """Rows of ``w1``, ``w3``, ``w2^T`` in the packed MLP shard."""
        return self.hidden, self.hidden, self.hidden
