"""The converted attention module: a registered family's ``Attention`` (TorchTitan's Llama3/Qwen3)
under context parallelism (``model_protocol``: what the module must have, and the registry).

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

from titan_upipe.attention.backends import LocalAttentionBackend, get_backend
from titan_upipe.attention.documents import DocumentMaskedBackend
from titan_upipe.attention.input_checks import (
    check_local_inputs,
    check_mesh_for_mode,
    check_ring_sequence,
)
from titan_upipe.attention.keep import KeptAttention
from titan_upipe.attention.model_protocol import (
    MODEL_CLASSES,
    PROJECTIONS,
    QK_NORMS,
    UNREGISTERED_HINT,
    AttentionModule,
    ModelClasses,
    projection,
)
from titan_upipe.attention.projection import HeadProjection, RotaryKind
from titan_upipe.attention.ring import RingAttentionBackend
from titan_upipe.attention.run import AttentionRun
from titan_upipe.attention.ulysses import ulysses_attention
from titan_upipe.attention.upipe import UPipeAttentionFunction
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.document_mask import DocumentMask, check_attention_masks
from titan_upipe.parallel.mesh import is_ring_mesh, layout_rank, mesh_degrees, ring_part, ulysses_part
from titan_upipe.parallel.sequence import layout_for
from titan_upipe.spec.cp_layout import CPMode, check_cp_degree, check_mode
from titan_upipe.spec.head_schedule import HeadSchedule, build_schedule

Tensor = torch.Tensor


TSP_NOT_AN_ATTENTION_MODE = (
    "convert_attention does not build TSP: TSP shards the attention's and the feed-forward's weights over "
    "the ranks, so it converts whole blocks. Use model.converters = [\"tsp\"] (or, in code, "
    "titan_upipe.tsp.modules.convert_block(block, mesh, backend) on a mesh from "
    "titan_upipe.parallel.context_parallel_mesh(cp_mesh, \"tsp\")); convert_attention's modes are "
    "ulysses, upipe, ring and usp")
"""Why ``mode = "tsp"`` is refused here (it would run UPipe with U = H, or the ring, on replicated weights)."""


@dataclass(frozen=True)
class AttentionSpec:
    """The head layout and math of an attention module of a registered model family."""

    source_class: type[nn.Module]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    rotary: RotaryKind
    qk_norm: bool
    norm_eps: float | None
    projection_paths: tuple[str, ...] = PROJECTIONS
    """Where ``wq``, ``wk``, ``wv``, ``wo`` sit (``ModelFamily.projection_paths``)."""
    kept_children: tuple[str, ...] = ()
    converted_class: type[nn.Module] | None = None
    """The family's ``ContextParallelAttention`` subclass (None: this module's class)."""
    converted_tsp_class: type[nn.Module] | None = None
    """The family's ``TSPAttention`` subclass (None: the core's)."""

    @property
    def shared_submodules(self) -> tuple[str, ...]:
        """The source's children the converted module registers as its own: the projections' parents,
        the QK norms and the family's kept children."""
        return (*dict.fromkeys(path.split(".")[0] for path in self.projection_paths), *QK_NORMS, *self.kept_children)

    @classmethod
    def of(cls, module: AttentionModule, classes: ModelClasses = MODEL_CLASSES) -> AttentionSpec:
        family = classes.attention_family(module)
        if family is None:
            known = (f"the registered {classes.names()} Attention modules" if classes.families else
                     f"the Attention modules of registered model families, and none is: {UNREGISTERED_HINT}")
            raise ConfigError(f"convert_attention supports {known}; got {type(module).__name__}")
        rotary, scale = family.rotary_of(module), family.attention_scale(module)
        # attn_type (sdpa, flex, varlen) picks TorchTitan's kernel, which conversion replaces: packed
        # documents reach the converted attention as a document_mask (the trainer builds it from
        # attn_mask_type = "block_causal", titan_upipe.torchtitan_0_2.cp_inputs), never as a flex/varlen mask.
        try:
            projections = {name: projection(module, path)
                           for name, path in zip(PROJECTIONS, family.projection_paths, strict=True)}
        except AttributeError as missing:
            raise ConfigError(f"context-parallel attention reads wq, wk, wv, wo at {', '.join(family.projection_paths)} "
                              f"of a {family.name} attention; this {type(module).__name__} lacks one ({missing}): "
                              "build the model with separate Q/K/V projections") from None
        biased = [name for name, linear in projections.items() if linear.bias is not None]
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
            projection_paths=family.projection_paths,
            kept_children=family.kept_children,
            converted_class=family.converted_attention,
            converted_tsp_class=family.converted_tsp_attention,
        )


class ContextParallelAttention(nn.Module):
    """Ulysses, UPipe, ring or USP attention over a context-parallel mesh.

    The Ulysses part (all-to-all, UPipe's head stages) runs over the ``ulysses`` ranks with
    ``schedule`` (whose ``cp_degree`` is the Ulysses degree); when the mesh has a ring of
    ``ring_degree > 1`` ranks, the local kernel is replaced by zigzag ring attention over it.
    """

    def __init__(self, source: nn.Module, spec: AttentionSpec, mode: str, cp_mesh: DeviceMesh,
                 schedule: HeadSchedule, backend: str | LocalAttentionBackend, ring_degree: int = 1,
                 compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        # The very same submodules, registered in the source's order: parameters are shared
        # and named (and ordered) as before, so state dicts and FSDP groups are unchanged.
        for name, child in source.named_children():
            if name in spec.shared_submodules:
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
        # A name is resolved here (ring blocks need a backward that honours the merged out/lse:
        # refused otherwise); a converter resolves it once for the whole model and passes the kernel.
        kernel = (backend if isinstance(backend, LocalAttentionBackend) else
                  get_backend(backend, compute_dtype, ring=ring_degree > 1, head_dim=spec.head_dim))
        self._ring: RingAttentionBackend | None = None
        self.backend = kernel
        self.in_place_rope = False
        """RoPE in place where no gradient is recorded; set by the ``fused_rope`` transform."""
        self._rope_table_checked: tuple | None = None

    @property
    def backend(self) -> LocalAttentionBackend:
        """The local kernel (inside the ring where there is one)."""
        return self._kernel_backend

    @backend.setter
    def backend(self, kernel: LocalAttentionBackend) -> None:
        self._kernel_backend = kernel
        if self._ring is not None:
            self._ring.local = kernel

    @property
    def ring_backend(self) -> RingAttentionBackend | None:
        """The zigzag ring over the mesh's ring ranks around ``backend`` (ring, USP, UPipe in USP):
        built once, at first use (conversion asks the mesh for no group); a batch of packed
        documents gets a copy that carries its mask. None without a ring."""
        if self._ring is None and self.ring_degree > 1:
            ring_group, ring_rank, ring_size = ring_part(self.cp_mesh)
            self._ring = RingAttentionBackend(self.backend, ring_group, ring_rank, ring_size)
        return self._ring

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

    def _local_positions(self, x: Tensor, positions: Tensor | None, mask: DocumentMask | None = None) -> Tensor:
        if positions is None:
            if mask is not None and mask.layout is not None:  # the batch's own layout: [B, S/C]
                return mask.layout.positions(layout_rank(self.cp_mesh), device=x.device)
            layout = layout_for(self.cp_mesh, x.shape[1] * self.cp_degree)
            return layout.positions(layout_rank(self.cp_mesh), device=x.device).unsqueeze(0)
        positions = positions.to(device=x.device, dtype=torch.long)
        return positions.unsqueeze(0) if positions.dim() == 1 else positions

    def _check_rope_table(self, table: Tensor, positions: Tensor | None, global_len: int) -> None:
        d = self.head_dim
        if self._rope_table_checked != (table.dtype, tuple(table.shape)):  # the model's table: once
            if self.spec.rotary is RotaryKind.COMPLEX:
                ok = table.is_complex() and table.dim() == 2 and table.shape[1] == d // 2
                expected = f"complex [max_seq, {d // 2}] (Llama3 freqs_cis)"
            else:
                ok = not table.is_complex() and table.dim() == 2 and table.shape[1] == 2 * d
                expected = f"real [max_seq, {2 * d}] (Qwen3 rope_cache)"
            if not ok:
                raise ConfigError(f"freqs_cis must be the model's full RoPE table, {expected}; got "
                                  f"{table.dtype} {tuple(table.shape)}")
            self._rope_table_checked = (table.dtype, tuple(table.shape))
        if positions is None and global_len > table.shape[0]:
            raise ConfigError(f"sequence length {global_len} exceeds the RoPE table's {table.shape[0]} rows")
        # Reading positions' maximum would sync an accelerator every layer; check it on CPU only.
        if positions is not None and positions.device.type == "cpu" and int(positions.max()) >= table.shape[0]:
            raise ConfigError(f"positions reach {int(positions.max())} but the RoPE table has {table.shape[0]} rows")

    def _check_document_layout(self, mask: DocumentMask, x: Tensor, positions: Tensor | None) -> None:
        """A mask that carries the batch's document layout: for this mesh, and explicit positions in its
        ``[B, S/C]`` shape (the fixed layouts' are ``[S/C]``: inputs sharded the fixed way are refused
        here). Their values are the trainer's ``LayoutCheck``'s, once per forward: here they may be
        the ``fused_rope`` transform's row indices, and reading them would sync an accelerator."""
        layout = mask.layout
        layout.check_degrees(self.ring_degree, self.ulysses_degree)
        if positions is not None and tuple(positions.shape) != (x.shape[0], layout.local_len):
            raise ConfigError(
                f"the document mask carries the batch's document-aware layout but the positions have shape "
                f"{tuple(positions.shape)}, not its [{x.shape[0]}, {layout.local_len}]: shard the inputs with "
                "titan_upipe.parallel.shard_sequence(t, cp_mesh, 1, mask.layout) and pass the positions it "
                "returns (or none)")

    def _kernel(self, mask) -> LocalAttentionBackend:
        """The kernel a call runs: the local one, or the ring around it; with packed documents,
        the one that reads this batch's mask."""
        if self.ring_backend is not None:
            return self.ring_backend if mask is None else self.ring_backend.with_documents(mask)
        # After the all-to-all a rank holds whole rows of its heads: each document one segment.
        return self.backend if mask is None else DocumentMaskedBackend(self.backend, mask)

    def forward(self, x: Tensor, freqs_cis: Tensor, attention_masks: object, positions: Tensor | None = None,
                kept: KeptAttention | None = None) -> Tensor:
        """TorchTitan's signature, plus ``kept``: the block's kept kernel results (``keep.py``), which
        the checkpoint wrapper passes to a block that keeps them."""
        # What can change per call: the shard's shape, its positions, the batch's documents.
        check_local_inputs(x, positions, self.cp_degree)
        check_ring_sequence(x.shape[1] * self.cp_degree, self.ring_degree, self.ulysses_degree)
        self._check_rope_table(freqs_cis, positions, x.shape[1] * self.cp_degree)
        mask = check_attention_masks(attention_masks, x.shape[1] * self.cp_degree, x.shape[0])
        if mask is not None and mask.layout is not None:
            self._check_document_layout(mask, x, positions)
        local_positions = self._local_positions(x, positions, mask)
        ulysses_group, ulysses_rank, _ = ulysses_part(self.cp_mesh)
        backend = self._kernel(mask)
        run = AttentionRun(
            schedule=self.schedule,
            projection=HeadProjection(self.head_dim, self.spec.rotary, freqs_cis, local_positions, self.spec.norm_eps,
                                      self.in_place_rope),
            backend=backend,
            group=ulysses_group,
            scale=self.spec.scale,
            qk_norm=self.spec.qk_norm,
            rank=ulysses_rank,
            kept=kept,
        )
        norms = (self.q_norm.weight, self.k_norm.weight) if self.spec.qk_norm else (None, None)
        wq, wk, wv, wo = (projection(self, path) for path in self.spec.projection_paths)
        weights = (wq.weight, wk.weight, wv.weight, *norms)
        if self.mode in ("ulysses", "ring", "usp"):
            # ring: Ulysses with one rank; usp: Ulysses whose kernel is the ring.
            return wo(ulysses_attention(x, *weights, run))
        if self.mode == "upipe":
            # UPipe applies wo itself: its backward forms dO one stage slice at a time, never whole.
            return UPipeAttentionFunction.apply(x, *weights[:3], wo.weight, *norms, run)
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
    spec = AttentionSpec.of(module)
    if check_mode(mode) is not CPMode.UPIPE:
        heads_per_stage = spec.n_heads  # one stage: Ulysses (and ring, USP) attend all heads at once
    return convert_attention_of_blocks([module], mode, cp_mesh, heads_per_stage, backend, in_place_rope=in_place_rope,
                                       compute_dtype=compute_dtype)[0]


def convert_attention_of_blocks(modules: list[nn.Module], mode: str, cp_mesh: DeviceMesh, heads_per_stage: int | None,
                                backend: str, *, in_place_rope: bool = False,
                                compute_dtype: torch.dtype | None = None) -> list[ContextParallelAttention]:
    """``convert_attention`` for the blocks of one model, which are alike: the mesh, the head
    schedule (``heads_per_stage`` U, as resolved by the job's ``CPLayout``: U = H outside UPipe)
    and the kernel are checked and built once and shared by every block."""
    mode = check_mode(mode).value
    if mode == CPMode.TSP:
        raise ConfigError(TSP_NOT_AN_ATTENTION_MODE)
    ring_degree, ulysses_degree = mesh_degrees(cp_mesh)
    check_mesh_for_mode(mode, ring_degree, ulysses_degree, cp_mesh.ndim, is_ring_mesh(cp_mesh))
    spec = AttentionSpec.of(modules[0])
    what = "context-parallel degree" if ring_degree == 1 else "ulysses degree"
    check_cp_degree(spec.n_heads, spec.n_kv_heads, ulysses_degree, what)
    schedule = build_schedule(spec.n_heads, spec.n_kv_heads, ulysses_degree, heads_per_stage)
    kernel = get_backend(backend, compute_dtype, ring=ring_degree > 1, head_dim=spec.head_dim)
    layers = []
    for module in modules:
        if AttentionSpec.of(module) != spec:
            raise ConfigError(f"the blocks' attentions differ ({AttentionSpec.of(module)} against {spec}): context-"
                              "parallel conversion shares one head schedule and kernel; convert them one by one")
        layer = (spec.converted_class or ContextParallelAttention)(module, spec, mode, cp_mesh, schedule, kernel,
                                                                   ring_degree, compute_dtype)
        layer.in_place_rope = in_place_rope
        layers.append(layer)
    return layers


def sequence_mesh(model: nn.Module) -> DeviceMesh | None:
    """The CP mesh the converted attention of ``model`` runs on (it decides the sequence
    layout the inputs must be sharded in); None when no attention was converted."""
    for module in model.modules():
        if isinstance(module, ContextParallelAttention):
            return module.cp_mesh
    return None
