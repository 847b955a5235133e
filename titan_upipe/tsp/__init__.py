"""TSP: tensor and sequence parallelism folded onto one mesh axis (``../shared/papers/001_*``).

============== ==========================================================================
module         holds
============== ==========================================================================
shards         ``TSPShards``: which heads / hidden units each rank owns, packing; degree checks
collectives    differentiable broadcast and sequence all-gather (fp32 adjoints), the ring's shift;
               ``CommLog``: bytes a rank receives
comm           ``layer_comm_bytes`` (this implementation, exact) and the paper's eqs. 14-16
grad_sum       ``fp32_summed_uses``: a tensor used once per owner, its gradient summed in fp32
attention      ``tsp_attention``: Algorithm 1 (packed-shard broadcast, K/V all-gather in
               head buckets, zigzag causal attention, ``Y += A Wo^T``)
mlp            ``tsp_gated_mlp``: Algorithm 2 (weight ring, local output accumulation; fp32
               gradients travel the ring back)
============== ==========================================================================
"""

from titan_upipe.tsp.attention import GatheredCausalAttention, tsp_attention
from titan_upipe.tsp.collectives import CommLog, Pending
from titan_upipe.tsp.comm import layer_comm_bytes, paper_layer_comm_bytes
from titan_upipe.tsp.mlp import tsp_gated_mlp
from titan_upipe.tsp.shards import (
           TSPShards,
           check_tsp_degree,
           pack_attention_shard,
           pack_mlp_shard,
           tsp_problems,
)

__all__ = ["CommLog", "GatheredCausalAttention", "Pending", "TSPShards", "check_tsp_degree", "layer_comm_bytes", "pack_attention_shard",
           "pack_mlp_shard", "paper_layer_comm_bytes", "tsp_attention", "tsp_gated_mlp", "tsp_problems"]
