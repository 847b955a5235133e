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
from titan_upipe.attention.projection import HeadProjection, RotaryKind
from titan_upipe.attention.run import AttentionRun
from titan_upipe.attention.schedule import HeadSchedule, build_schedule
from titan_upipe.attention.ulysses import ulysses_attention
from titan_upipe.attention.upipe import UPipeAttentionFunction
from titan_upipe.attention.validation import (
    check_attention_masks,
    check_local_inputs,
    check_mode,
    resolve_heads_per_stage,
)
from titan_upipe.config import ConfigError
from titan_upipe.parallel.layout import ContiguousLayout

Tensor = torch.Tensor

SHARED_SUBMODULES = ("wq", "wk", "wv", "wo", "q_norm", "k_norm")


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
        if module.attn_type != "sdpa":
            raise ConfigError(
                f"attn_type={module.attn_type!r} uses document masks, which come in a later issue: "
                "set the model's attn_type to 'sdpa' (causal) for ulysses/upipe"
            )
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
    """Ulysses or UPipe attention over a 1-D context-parallel mesh (contiguous sequence shards)."""

    def __init__(self, source: nn.Module, spec: AttentionSpec, mode: str, cp_mesh: DeviceMesh,
                 schedule: HeadSchedule, backend: str) -> None:
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
        self.backend = get_backend(backend)

    @property
    def cp_degree(self) -> int:
        return self.schedule.cp_degree

    @property
    def heads_per_stage(self) -> int:
        return self.schedule.heads_per_stage

    def init_weights(self, init_std: float) -> None:
        self.spec.source_class.init_weights(self, init_std)

    def extra_repr(self) -> str:
        return (f"mode={self.mode}, cp_degree={self.cp_degree}, heads_per_stage={self.heads_per_stage}, "
                f"stages={self.schedule.n_stages}, backend={self.backend.name}")

    def _local_positions(self, x: Tensor, positions: Tensor | None, rank: int) -> Tensor:
        if positions is None:
            layout = ContiguousLayout(x.shape[1] * self.cp_degree, self.cp_degree)
            return layout.positions(rank, device=x.device).unsqueeze(0)
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
        check_attention_masks(attention_masks)
        check_local_inputs(x, positions, self.cp_degree)
        self._check_rope_table(freqs_cis, positions, x.shape[1] * self.cp_degree)
        rank = self.cp_mesh.get_local_rank()
        local_positions = self._local_positions(x, positions, rank)
        run = AttentionRun(
            schedule=self.schedule,
            projection=HeadProjection(self.head_dim, self.spec.rotary, freqs_cis, local_positions, self.spec.norm_eps),
            backend=self.backend,
            group=self.cp_mesh.get_group(),
            scale=self.spec.scale,
            qk_norm=self.spec.qk_norm,
            rank=rank,
        )
        norms = (self.q_norm.weight, self.k_norm.weight) if self.spec.qk_norm else (None, None)
        weights = (self.wq.weight, self.wk.weight, self.wv.weight, *norms)
        if self.mode == "ulysses":
            out = ulysses_attention(x, *weights, run)
        else:
            out = UPipeAttentionFunction.apply(x, *weights, run)
        return self.wo(out)


def convert_attention(module: nn.Module, mode: str, cp_mesh: DeviceMesh, heads_per_stage: int | None = None,
                      backend: str = "sdpa") -> ContextParallelAttention:
    """Wrap a TorchTitan Llama3/Qwen3 ``Attention`` for context parallelism over ``cp_mesh``.

    ``mode``: ``"ulysses"`` or ``"upipe"``. ``heads_per_stage`` (UPipe's U): None or 0 means
    U = C; U = H is one stage (Ulysses numerics with UPipe's recompute). Ulysses ignores it.
    Every setting is validated here, before any communication, raising ConfigError.
    """
    check_mode(mode)
    if cp_mesh.ndim != 1:
        raise ConfigError(f"cp_mesh must be 1-D (ring x ulysses meshes come with the USP mode), got {cp_mesh.ndim}-D")
    spec = AttentionSpec.of(module)
    cp_degree = cp_mesh.size()
    if mode == "ulysses":
        resolve_heads_per_stage(spec.n_heads, spec.n_kv_heads, cp_degree, None)
        u = spec.n_heads
    else:
        u = resolve_heads_per_stage(spec.n_heads, spec.n_kv_heads, cp_degree, heads_per_stage)
    schedule = build_schedule(spec.n_heads, spec.n_kv_heads, cp_degree, u)
    return ContextParallelAttention(module, spec, mode, cp_mesh, schedule, backend)
