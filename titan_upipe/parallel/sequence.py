"""Shard a batch's sequence over a context-parallel mesh and gather it back."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_upipe.config import ConfigError
from titan_upipe.parallel.layout import ContiguousLayout, SequenceLayout


def _check_mesh(cp_mesh: DeviceMesh) -> None:
    if cp_mesh.ndim != 1:
        raise ConfigError(f"cp_mesh must be 1-D for the contiguous layout, got {cp_mesh.ndim}-D")


def layout_for(cp_mesh: DeviceMesh, seq_len: int) -> SequenceLayout:
    """The layout ulysses/upipe expect on this mesh (contiguous shards, 1-D meshes)."""
    _check_mesh(cp_mesh)
    return ContiguousLayout(seq_len, cp_mesh.size())


def shard_sequence(t: torch.Tensor, cp_mesh: DeviceMesh, seq_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of ``t`` along ``seq_dim`` (a contiguous copy) and the global
    positions of its tokens (``[S/C]`` int64 on ``t``'s device)."""
    layout = layout_for(cp_mesh, t.shape[seq_dim])
    rank = cp_mesh.get_local_rank()
    return layout.shard(t, rank, seq_dim).contiguous(), layout.positions(rank, device=t.device)


def gather_sequence(local: torch.Tensor, cp_mesh: DeviceMesh, seq_dim: int) -> torch.Tensor:
    """Exact inverse of ``shard_sequence`` (all-gather; not differentiable)."""
    _check_mesh(cp_mesh)
    world = cp_mesh.size()
    local = local.detach().contiguous()
    layout = layout_for(cp_mesh, local.shape[seq_dim] * world)
    if world == 1:
        return local.clone()
    shards = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(shards, local, group=cp_mesh.get_group())
    return layout.unshard(shards, seq_dim)
