"""TSP: tensor and sequence parallelism folded onto one mesh axis (``../shared/papers/001_*``).

============== ==========================================================================
module         holds
============== ==========================================================================
shards         ``TSPShards``: which heads / hidden units each rank owns, packing; degree checks
collectives    differentiable broadcast and sequence all-gather (fp32 adjoints), the ring's shift;
               ``CommLog``: bytes a rank receives
grad_sum       ``fp32_summed_uses``: a tensor used once per owner, its gradient summed in fp32
attention      ``tsp_attention``: Algorithm 1 (packed-shard broadcast, K/V all-gather in
               head buckets, zigzag causal attention, ``Y += A Wo^T``)
mlp            ``tsp_gated_mlp``: Algorithm 2 (weight ring, local output accumulation; fp32
               gradients travel the ring back)
============== ==========================================================================

The bytes a TSP layer moves (``layer_comm_bytes``, the paper's eqs. 14-16) are an analytic model:
``titan_upipe.costs.tsp_comm``.
"""

from titan_upipe.spec.tsp_shards import check_tsp_degree, tsp_problems
from titan_upipe.tsp.attention import GatheredCausalAttention, tsp_attention
from titan_upipe.tsp.collectives import CommLog, Pending
from titan_upipe.tsp.mlp import tsp_gated_mlp
from titan_upipe.tsp.shards import TSPShards, pack_attention_shard, pack_mlp_shard

__all__ = ["CommLog", "GatheredCausalAttention", "Pending", "TSPShards", "check_tsp_degree", "pack_attention_shard",
           "pack_mlp_shard", "tsp_attention", "tsp_gated_mlp", "tsp_problems"]
