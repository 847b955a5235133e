"""TSP attention and feed-forward modules: TorchTitan's Llama3/Qwen3 block parts with their
weights sharded over the TSP ranks as DTensors.

Each module registers the *same* submodules as the one it replaces (``wq``/``wk``/``wv``/``wo``,
``q_norm``/``k_norm``; ``w1``/``w2``/``w3``; on TorchTitan 0.3 ``qkv_linear`` holds the first three
and ``rope`` is kept: the family's ``projection_paths`` and ``kept_children``) and replaces their
weights by DTensors on the TSP mesh (a 1-D mesh named ``"ring"``: the zigzag sequence layout):

==========================  ============  =====================================================
weight                      placement     rank ``p`` holds
==========================  ============  =====================================================
``wq``, ``wk``, ``wv``      ``Shard(0)``  rows of its query / KV heads (``TSPShards``)
``wo``                      ``Shard(1)``  columns of its query heads
``w1``, ``w3``              ``Shard(0)``  rows of its ``F/D`` hidden units
``w2``                      ``Shard(1)``  columns of the same hidden units
``q_norm``, ``k_norm``      (plain)       replicated (FSDP over the CP ranks sums their gradients)
==========================  ============  =====================================================

Names and global shapes are TorchTitan's, so state dicts, DCP checkpoints (resharded on load)
and ``init_weights`` are unchanged. Forward packs the local shards (``to_local``) and runs
``tsp_attention`` / ``tsp_gated_mlp`` over the mesh's group; the gradient of each local shard
is the whole gradient of those rows (the collectives' adjoints sum it at the owner in fp32), so
the DTensor gradient is complete: no reduction over the TSP ranks follows.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titan_upipe.attention.input_checks import check_local_inputs
from titan_upipe.attention.keep import KeptAttention
from titan_upipe.attention.model_protocol import projection
from titan_upipe.attention.module import AttentionSpec, ContextParallelAttention
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.document_mask import check_attention_masks
from titan_upipe.parallel.layout import ZigzagLayout
from titan_upipe.parallel.mesh import is_ring_mesh
from titan_upipe.spec.head_schedule import build_schedule
from titan_upipe.spec.tsp_shards import bucket_problems
from titan_upipe.transforms.tiled_mlp import is_swiglu_feed_forward
from titan_upipe.tsp.attention import tsp_attention
from titan_upipe.tsp.collectives import CommLog
from titan_upipe.tsp.mlp import tsp_gated_mlp
from titan_upipe.tsp.shards import TSPShards, pack_attention_shard, pack_mlp_shard

Tensor = torch.Tensor

ATTENTION_PLACEMENTS = {"wq": Shard(0), "wk": Shard(0), "wv": Shard(0), "wo": Shard(1)}
MLP_PLACEMENTS = {"w1": Shard(0), "w3": Shard(0), "w2": Shard(1)}


def _check_mesh(mesh: DeviceMesh) -> None:
    if mesh.ndim != 1 or not is_ring_mesh(mesh):
        raise ConfigError("TSP runs on a 1-D mesh named 'ring' (the zigzag layout): build it with "
                          "titan_upipe.parallel.context_parallel_mesh(cp_mesh, 'tsp')")


def shard_weights(linears: dict[str, nn.Module], mesh: DeviceMesh, placements: dict[str, Shard]) -> None:
    """Replace ``linears[name].weight`` by a DTensor with ``placements[name]`` on ``mesh`` (works
    on the meta device, where TorchTitan converts)."""
    for name, placement in placements.items():
        linear = linears[name]
        if isinstance(linear.weight, DTensor):
            raise ConfigError(f"{name}.weight is already a DTensor: TSP shards plain TorchTitan weights once")
        linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [placement]),
                                     requires_grad=linear.weight.requires_grad)


def _local(weight: Tensor) -> Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


class TSPAttention(ContextParallelAttention):
    """Algorithm 1 of the TSP paper over a 1-D ``"ring"`` mesh of ``D`` ranks: the heads never
    move; each rank's ``[wq | wk | wv | wo^T]`` shard is broadcast in turn (``tsp.attention``)."""

    def __init__(self, source: nn.Module, spec: AttentionSpec, mesh: DeviceMesh, shards: TSPShards, backend: str,
                 kv_heads_per_bucket: int = 0, compute_dtype: torch.dtype | None = None, overlap: bool = True) -> None:
        _check_mesh(mesh)
        degree = mesh.size()
        super().__init__(source, spec, "tsp", mesh, build_schedule(spec.n_heads, spec.n_kv_heads, 1, spec.n_heads),
                         backend, ring_degree=degree, compute_dtype=compute_dtype)
        self.shards = shards
        problems = bucket_problems(spec.n_kv_heads, degree, kv_heads_per_bucket)
        if problems:
            raise ConfigError(problems[0])
        self.kv_heads_per_bucket, self.overlap = kv_heads_per_bucket, overlap
        self.comm_log: CommLog | None = None
        """A ``CommLog`` here counts the bytes this rank receives (tests, benchmarks)."""
        shard_weights(self.projections(), mesh, ATTENTION_PLACEMENTS)

    def projections(self) -> dict[str, nn.Module]:
        """``wq``, ``wk``, ``wv``, ``wo`` by name, wherever the family keeps them (``spec.projection_paths``)."""
        return {name: projection(self, path)
                for name, path in zip(ATTENTION_PLACEMENTS, self.spec.projection_paths, strict=True)}

    def extra_repr(self) -> str:
        return (f"mode=tsp, degree={self.cp_degree}, heads per rank={self.shards.heads}, "
                f"kv_heads_per_bucket={self.kv_heads_per_bucket or self.shards.kv_heads}, overlap={self.overlap}, "
                f"backend={self.backend.name}")

    def forward(self, x: Tensor, freqs_cis: Tensor, attention_masks: object, positions: Tensor | None = None,
                kept: KeptAttention | None = None) -> Tensor:
        check_local_inputs(x, positions, self.cp_degree)
        global_len = x.shape[1] * self.cp_degree
        if check_attention_masks(attention_masks, global_len, x.shape[0]) is not None:
            raise ConfigError("tsp attention is causal over the whole sequence: packed-document masks "
                              "(attn_mask_type = 'block_causal') are not supported; use a causal flavor")
        self._check_rope_table(freqs_cis, positions, global_len)
        packed = pack_attention_shard(*(_local(linear.weight) for linear in self.projections().values()))
        norms = (self.q_norm.weight, self.k_norm.weight) if self.spec.qk_norm else (None, None)
        return tsp_attention(x, packed, self.shards, ZigzagLayout(global_len, self.cp_degree), self.cp_mesh.get_group(),
                             self.backend, self.spec.scale, freqs_cis, self._local_positions(x, positions),
                             self.spec.rotary, *norms, norm_eps=self.spec.norm_eps,
                             bucket_kv_heads=self.kv_heads_per_bucket or None, log=self.comm_log,
                             overlap=self.overlap, kept=kept)


class TSPFeedForward(nn.Module):
    """Algorithm 2 of the TSP paper: the gated MLP's ``[w1 | w3 | w2^T]`` shards travel a ring
    of ``D`` ranks (``tsp.mlp``); ``[B, S/D, dim] -> [B, S/D, dim]``."""

    def __init__(self, source: nn.Module, mesh: DeviceMesh, shards: TSPShards, overlap: bool = True,
                 recompute: bool = True) -> None:
        super().__init__()
        _check_mesh(mesh)
        self.w1, self.w2, self.w3 = source.w1, source.w2, source.w3
        self.source_class = type(source)
        self.mesh, self.shards, self.overlap, self.recompute = mesh, shards, overlap, recompute
        self.comm_log: CommLog | None = None
        shard_weights({name: getattr(self, name) for name in MLP_PLACEMENTS}, mesh, MLP_PLACEMENTS)

    def init_weights(self, init_std: float) -> None:
        self.source_class.init_weights(self, init_std)

    def extra_repr(self) -> str:
        return (f"mode=tsp, degree={self.shards.degree}, hidden per rank={self.shards.hidden}, overlap={self.overlap}, "
                f"recompute={self.recompute}")

    def forward(self, x: Tensor) -> Tensor:
        packed = pack_mlp_shard(*(_local(getattr(self, name).weight) for name in ("w1", "w2", "w3")))
        return tsp_gated_mlp(x, packed, self.shards, self.mesh.get_group(), self.comm_log, self.overlap,
                             self.recompute)


def convert_block(block: nn.Module, mesh: DeviceMesh, backend: str, kv_heads_per_bucket: int = 0,
                  compute_dtype: torch.dtype | None = None, overlap: bool = True, mlp_recompute: bool = True) -> None:
    """Replace a TorchTitan Llama3/Qwen3 block's ``attention`` and ``feed_forward`` by TSP modules
    (every degree problem raised as one ConfigError, ``tsp_problems``)."""
    if not is_swiglu_feed_forward(block.feed_forward, "tsp"):
        raise ConfigError(f"tsp converts TorchTitan's dense SwiGLU feed-forward; this block has "
                          f"{type(block.feed_forward).__name__} (MoE flavors and tiled_mlp are not supported)")
    spec = AttentionSpec.of(block.attention)
    shards = TSPShards(spec.n_heads, spec.n_kv_heads, spec.head_dim, block.feed_forward.w1.weight.shape[0], mesh.size())
    block.attention = (spec.converted_tsp_class or TSPAttention)(block.attention, spec, mesh, shards, backend,
                                                                 kv_heads_per_bucket, compute_dtype, overlap)
    block.feed_forward = TSPFeedForward(block.feed_forward, mesh, shards, overlap, mlp_recompute)


def tsp_sharded_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The DTensor weights of ``model``'s TSP modules (FSDP leaves them alone: already sharded)."""
    params = []
    for module in model.modules():
        if isinstance(module, TSPAttention):
            params += [linear.weight for linear in module.projections().values()]
        elif isinstance(module, TSPFeedForward):
            params += [getattr(module, name).weight for name in MLP_PLACEMENTS]
    return params
