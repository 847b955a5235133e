"""Bytes one rank receives per TSP layer (this implementation) and the paper's volumes (eqs. 14-16).

Per layer and rank, with ``P_a = (2 H + 2 K) hd d`` attention and ``P_m = 3 F d`` MLP parameters,
``beta`` bytes per parameter / activation element, ``B`` sequences of ``S`` tokens, ``K hd`` the
KV width (``h/g`` in the paper):

===========================  ====================================  ===========================
collective                   received by one rank                  paper, eq. (14)/(15)
===========================  ====================================  ===========================
weight broadcast (forward)   ``(D-1)/D · P_a · beta``                ``P_a · beta`` (a broadcast
                                                                   relays the whole message)
MLP weight ring (forward)    ``(D-1)/D · P_m · beta``                same
K/V all-gather (forward)     ``(D-1)/D · 2 B S K hd · beta``         same
K/V all-gather (backward)    ``(D-1)/D · 2 B S K hd · beta``         none (the paper keeps K/V;
                                                                   here it is gathered again)
weight gradient reduce       ``(D-1)/D · P_a · 4`` (fp32 sums)       ``P_a · beta``
MLP gradient ring            ``(D-1)/D · P_m · 4`` (fp32 sums)       ``(D-1)/D · P_m · beta``
dK/dV reduce-scatter         ``(D-1)/D · 2 B S K hd · 4`` (fp32)     ``(D-1)/D · 2 B S K hd · beta``
===========================  ====================================  ===========================

The paper adds a data-parallel gradient all-reduce ``P_L beta_g (D-1)/D`` (eq. 15) that this
layer-level count leaves to the job's FSDP; full recomputation repeats the forward row (eq. 16).
"""

from __future__ import annotations

from titan_upipe.spec.tsp_shards import TSPShardSizes

FP32_BYTES = 4


def layer_comm_bytes(shards: TSPShardSizes, dim: int, batch: int, seq_len: int, beta: int) -> dict[tuple[str, str], int]:
    """``{(phase, kind): bytes}`` one rank receives in one layer's forward and backward (the
    keys of ``collectives.CommLog``); exact for this implementation, equal on every rank."""
    d = shards.degree
    attention_shard = sum(shards.attention_rows) * dim
    mlp_shard = sum(shards.mlp_rows) * dim
    kv_local = 2 * batch * (seq_len // d) * shards.kv_heads * shards.head_dim  # one owner's K and V, my tokens
    volumes = {
        ("forward", "broadcast"): (d - 1) * attention_shard * beta,
        ("forward", "all_gather"): d * (d - 1) * kv_local * beta,
        ("forward", "ring"): (d - 1) * mlp_shard * beta,
        ("backward", "all_gather"): d * (d - 1) * kv_local * beta,
        ("backward", "reduce"): (d - 1) * attention_shard * FP32_BYTES,
        ("backward", "reduce_scatter"): d * (d - 1) * kv_local * FP32_BYTES,
        ("backward", "ring"): (d - 1) * mlp_shard * FP32_BYTES,
    }
    return {key: value for key, value in volumes.items() if value}


def step_bytes(volumes: dict[tuple[str, str], int], n_layers: int, recompute_fraction: float,
               kept_layers: int = 0) -> float:
    """Bytes one rank receives in one step of ``n_layers`` layers of ``volumes``
    (``layer_comm_bytes``): the forward again for ``recompute_fraction`` of them, less the K/V
    all-gathers of the ``kept_layers`` whose recomputation replays its attention (``attention.keep``:
    the weights still travel)."""
    forward = sum(v for (phase, _), v in volumes.items() if phase == "forward")
    backward = sum(volumes.values()) - forward
    gathers = volumes.get(("forward", "all_gather"), 0)
    return n_layers * (forward * (1 + recompute_fraction) + backward) - kept_layers * gathers


def paper_layer_comm_bytes(shards: TSPShardSizes, dim: int, batch: int, seq_len: int, beta: int,
                           recompute: bool = False) -> dict[str, float]:
    """The paper's per-layer, per-device volumes (eqs. 14-16), data-parallel all-reduce left out:
    ``{"forward", "backward", "recompute"}``."""
    d = shards.degree
    p_attn = sum(shards.attention_rows) * dim * d
    p_mlp = sum(shards.mlp_rows) * dim * d
    kv = 2 * batch * seq_len * shards.n_kv_heads * shards.head_dim * beta * (d - 1) / d
    forward = p_attn * beta + p_mlp * beta * (d - 1) / d + kv
    return {"forward": forward, "backward": forward, "recompute": forward if recompute else 0.0}
