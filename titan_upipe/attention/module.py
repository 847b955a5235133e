"""The converted attention module: TorchTitan's Llama3/Qwen3 ``Attention`` under context parallelism.

It registers the *same* ``wq``/``wk``/``wv``/``wo`` (and ``q_norm``/``k_norm``) submodules
as the module it replaces, so parameter names, state dicts, FSDP wrapping and checkpoints
are unchanged, and keeps the forward signature ``forward(x, freqs_cis, attention_masks,
positions=None)``. ``x`` is this rank's sequence shard, ``freqs_cis`` the model's full RoPE
table and ``positions`` the global positions of this rank's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.models.llama3.model.model import Attention as Llama3Attention
from torchtitan.models.qwen3.model.model import Attention as Qwen3Attention

from titan_upipe.attention.backends import get_backend
from titan_upipe.attention.documents import DocumentMaskedBackend, check_attention_masks
from titan_upipe.attention.input_checks import (
    check_local_inputs,
    check_mesh_for_mode,
    check_ring_sequence,
)
from titan_upipe.attention.projection import HeadProjection, RotaryKind
from titan_upipe.attention.ring import RingAttentionBackend
from titan_upipe.attention.run import AttentionRun
from titan_upipe.attention.schedule import HeadSchedule, build_schedule
from titan_upipe.attention.ulysses import ulysses_attention
from titan_upipe.attention.upipe import UPipeAttentionFunction
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.cp_layout import CPMode, check_cp_degree, check_mode, resolve_heads_per_stage
from titan_upipe.parallel.mesh import is_ring_mesh, layout_rank, mesh_degrees, ring_part, ulysses_part
from titan_upipe.parallel.sequence import layout_for

Tensor = torch.Tensor

SHARED_SUBMODULES = ("wq", "wk", "wv", "wo", "q_norm", "k_norm")

TSP_NOT_AN_ATTENTION_MODE = (
    "convert_attention does not build TSP: TSP shards the attention's and the feed-forward's weights over "
    "the ranks, so it converts whole blocks. Use model.converters = [\"tsp\"] (or, in code, "
    "titan_upipe.tsp.modules.convert_block(block, mesh, backend) on a mesh from "
    "titan_upipe.parallel.context_parallel_mesh(cp_mesh, \"tsp\")); convert_attention's modes are "
    "ulysses, upipe, ring and usp")
"""Why ``mode = "tsp"`` is refused here (it would run UPipe with U = H, or the ring, on replicated weights)."""


@dataclass(frozen=True)
class AttentionSpec:
    """The head layout and math of a TorchTitan attention module."""

    source_class: type[nn.Module]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    rotary: RotaryKind
    qk_norm: bool
    norm_eps: float | None

    @classmethod
    def of(cls, module: nn.Module) -> AttentionSpec:
        if isinstance(module, Qwen3Attention):
            rotary, scale = RotaryKind.COS_SIN, module.scaling
        elif isinstance(module, Llama3Attention):
            # F.scaled_dot_product_attention's default scale, which Llama3 uses.
            rotary, scale = RotaryKind.COMPLEX, module.head_dim**-0.5
        else:
            raise ConfigError(
                f"convert_attention supports TorchTitan Llama3 and Qwen3 Attention modules, got {type(module).__name__}"
            )
        # attn_type (sdpa, flex, varlen) picks TorchTitan's kernel, which conversion replaces: packed
        # documents reach the converted attention as a document_mask (the trainer builds it from
        # attn_mask_type = "block_causal", titan_upipe.torchtitan_0_2.cp_inputs), never as a flex/varlen mask.
        biased = [name for name in ("wq", "wk", "wv", "wo") if getattr(module, name).bias is not None]
        if biased:
            raise ConfigError(f"context-parallel attention supports projections without bias (Llama3, Qwen3); "
                              f"{', '.join(biased)} of this module have one")
        q_norm = getattr(module, "q_norm", None)
        return cls(
            source_class=type(module),
            n_heads=module.n_heads,
            n_kv_heads=module.n_kv_heads,
            head_dim=module.head_dim,
            scale=scale,
            rotary=rotary,
            qk_norm=q_norm is not None,
            norm_eps=q_norm.eps if q_norm is not None else None,
        )


class ContextParallelAttention(nn.Module):
    """Ulysses, UPipe, ring or USP attention over a context-parallel mesh.

    The Ulysses part (all-to-all, UPipe's head stages) runs over the ``ulysses`` ranks with
    ``schedule`` (whose ``cp_degree`` is the Ulysses degree); when the mesh has a ring of
    ``ring_degree > 1`` ranks, the local kernel is replaced by zigzag ring attention over it.
    """

    def __init__(self, source: nn.Module, spec: AttentionSpec, mode: str, cp_mesh: DeviceMesh,
                 schedule: HeadSchedule, backend: str, ring_degree: int = 1,
                 compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        # The very same submodules, registered in the source's order: parameters are shared
        # and named (and ordered) as before, so state dicts and FSDP groups are unchanged.
        for name, child in source.named_children():
            if name in SHARED_SUBMODULES:
                setattr(self, name, child)
        if spec.rotary is RotaryKind.COS_SIN and not spec.qk_norm:
            self.q_norm = self.k_norm = None
        # Attributes TorchTitan code reads from attention modules.
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.n_kv_heads, spec.head_dim
        self.n_rep = spec.n_heads // spec.n_kv_heads
        self.enable_gqa = spec.n_heads > spec.n_kv_heads
        self.attn_type = "sdpa"
        self.spec, self.mode, self.cp_mesh, self.schedule = spec, mode, cp_mesh, schedule
        self.ring_degree = ring_degree
        # Ring blocks need a backward that honours the merged out/lse: refused here otherwise.
        self.backend = get_backend(backend, compute_dtype, ring=ring_degree > 1, head_dim=spec.head_dim)
        self.block_rule = None
        """None: the causal block rule; tests replace it to show a wrong rule is caught."""
        self.document_plan = None
        """None: ``ring_plan.document_step_calls``; tests replace it to show a wrong plan is caught."""
        self.in_place_rope = False
        """RoPE in place where no gradient is recorded; set by the ``fused_rope`` transform."""

    @property
    def cp_degree(self) -> int:
        """All context-parallel ranks: ring x ulysses."""
        return self.ring_degree * self.schedule.cp_degree

    @property
    def ulysses_degree(self) -> int:
        return self.schedule.cp_degree

    @property
    def heads_per_stage(self) -> int:
        return self.schedule.heads_per_stage

    def init_weights(self, init_std: float) -> None:
        self.spec.source_class.init_weights(self, init_std)

    def extra_repr(self) -> str:
        return (f"mode={self.mode}, cp_degree={self.cp_degree} (ring {self.ring_degree} x ulysses "
                f"{self.ulysses_degree}), heads_per_stage={self.heads_per_stage}, "
                f"stages={self.schedule.n_stages}, backend={self.backend.name}")

    def _local_positions(self, x: Tensor, positions: Tensor | None) -> Tensor:
        if positions is None:
            layout = layout_for(self.cp_mesh, x.shape[1] * self.cp_degree)
            return layout.positions(layout_rank(self.cp_mesh), device=x.device).unsqueeze(0)
        positions = positions.to(device=x.device, dtype=torch.long)
        return positions.unsqueeze(0) if positions.dim() == 1 else positions

    def _check_rope_table(self, table: Tensor, positions: Tensor | None, global_len: int) -> None:
        d = self.head_dim
        if self.spec.rotary is RotaryKind.COMPLEX:
            ok = table.is_complex() and table.dim() == 2 and table.shape[1] == d // 2
            expected = f"complex [max_seq, {d // 2}] (Llama3 freqs_cis)"
        else:
            ok = not table.is_complex() and table.dim() == 2 and table.shape[1] == 2 * d
            expected = f"real [max_seq, {2 * d}] (Qwen3 rope_cache)"
        if not ok:
            raise ConfigError(f"freqs_cis must be the model's full RoPE table, {expected}; got "
                              f"{table.dtype} {tuple(table.shape)}")
        if positions is None and global_len > table.shape[0]:
            raise ConfigError(f"sequence length {global_len} exceeds the RoPE table's {table.shape[0]} rows")
        # Reading positions' maximum would sync an accelerator every layer; check it on CPU only.
        if positions is not None and positions.device.type == "cpu" and int(positions.max()) >= table.shape[0]:
            raise ConfigError(f"positions reach {int(positions.max())} but the RoPE table has {table.shape[0]} rows")

    def forward(self, x: Tensor, freqs_cis: Tensor, attention_masks: object, positions: Tensor | None = None) -> Tensor:
        check_local_inputs(x, positions, self.cp_degree)
        check_ring_sequence(x.shape[1] * self.cp_degree, self.ring_degree, self.ulysses_degree)
        self._check_rope_table(freqs_cis, positions, x.shape[1] * self.cp_degree)
        mask = check_attention_masks(attention_masks, x.shape[1] * self.cp_degree, x.shape[0])
        local_positions = self._local_positions(x, positions)
        ulysses_group, ulysses_rank, _ = ulysses_part(self.cp_mesh)
        backend = self.backend
        if self.ring_degree > 1:
            ring_group, ring_rank, ring_size = ring_part(self.cp_mesh)
            plans = {"rule": self.block_rule, "document_plan": self.document_plan}
            backend = RingAttentionBackend(self.backend, ring_group, ring_rank, ring_size,
                                           documents=mask,
                                           **{k: v for k, v in plans.items() if v is not None})
        elif mask is not None:
            # After the all-to-all a rank holds whole rows of its heads: each document one segment.
            backend = DocumentMaskedBackend(self.backend, mask)
        run = AttentionRun(
            schedule=self.schedule,
            projection=HeadProjection(self.head_dim, self.spec.rotary, freqs_cis, local_positions, self.spec.norm_eps,
                                      self.in_place_rope),
            backend=backend,
            group=ulysses_group,
            scale=self.spec.scale,
            qk_norm=self.spec.qk_norm,
            rank=ulysses_rank,
        )
        norms = (self.q_norm.weight, self.k_norm.weight) if self.spec.qk_norm else (None, None)
        weights = (self.wq.weight, self.wk.weight, self.wv.weight, *norms)
        if self.mode in ("ulysses", "ring", "usp"):
            # ring: Ulysses with one rank; usp: Ulysses whose kernel is the ring.
            return self.wo(ulysses_attention(x, *weights, run))
        if self.mode == "upipe":
            # UPipe applies wo itself: its backward forms dO one stage slice at a time, never whole.
            return UPipeAttentionFunction.apply(x, *weights[:3], self.wo.weight, *norms, run)
        # tsp is its own module (TSPAttention overrides forward): never another mode under its name
        raise ConfigError(TSP_NOT_AN_ATTENTION_MODE if self.mode == CPMode.TSP else
                          f"ContextParallelAttention has no mode {self.mode!r}: ulysses, upipe, ring or usp")


def convert_attention(module: nn.Module, mode: str, cp_mesh: DeviceMesh, heads_per_stage: int | None = None,
                      backend: str = "sdpa", *, in_place_rope: bool = False,
                      compute_dtype: torch.dtype | None = None) -> ContextParallelAttention:
    """Wrap a TorchTitan Llama3/Qwen3 ``Attention`` for context parallelism over ``cp_mesh``.

    ``mode`` and mesh (``titan_upipe.parallel.context_parallel_mesh`` builds them):

    * ``"ulysses"``, ``"upipe"``: a 1-D CP mesh (contiguous shards);
    * ``"ring"``: a 1-D mesh named ``"ring"`` (zigzag shards);
    * ``"usp"``, ``"upipe"``: a 2-D ``("ring", "ulysses")`` mesh; UPipe then runs each stage's
      attention as a ring over the outer dim.

    ``heads_per_stage`` (UPipe's U): None or 0 means U = the Ulysses degree; U = H is one
    stage. Other modes ignore it. ``in_place_rope``: rotate Q/K in place where no gradient is
    recorded (what the ``fused_rope`` transform turns on; off keeps TorchTitan's RoPE op order).
    ``backend``: a name of ``titan_upipe.attention.BACKENDS`` or ``"auto"``, resolved for inputs of
    ``compute_dtype`` (None: checked at the first call); ring modes refuse a backend whose
    backward does not honour the merged out/lse. Every setting is validated here, before any
    communication, raising ConfigError.
    """
    mode = check_mode(mode).value
    if mode == CPMode.TSP:
        raise ConfigError(TSP_NOT_AN_ATTENTION_MODE)
    ring_degree, ulysses_degree = mesh_degrees(cp_mesh)
    check_mesh_for_mode(mode, ring_degree, ulysses_degree, cp_mesh.ndim, is_ring_mesh(cp_mesh))
    spec = AttentionSpec.of(module)
    what = "context-parallel degree" if ring_degree == 1 else "ulysses degree"
    check_cp_degree(spec.n_heads, spec.n_kv_heads, ulysses_degree, what)
    if mode == "upipe":
        u = resolve_heads_per_stage(spec.n_heads, spec.n_kv_heads, ulysses_degree, heads_per_stage)
    else:
        u = spec.n_heads
    schedule = build_schedule(spec.n_heads, spec.n_kv_heads, ulysses_degree, u)
    layer = ContextParallelAttention(module, spec, mode, cp_mesh, schedule, backend, ring_degree, compute_dtype)
    layer.in_place_rope = in_place_rope
    return layer


def sequence_mesh(model: nn.Module) -> DeviceMesh | None:
    """The CP mesh the converted attention of ``model`` runs on (it decides the sequence
    layout the inputs must be sharded in); None when no attention was converted."""
    for module in model.modules():
        if isinstance(module, ContextParallelAttention):
            return module.cp_mesh
    return None
