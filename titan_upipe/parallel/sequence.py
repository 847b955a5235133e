"""Shard a batch's sequence over a context-parallel mesh and gather it back.

The layout follows from the mesh (``titan_upipe.parallel.mesh``): contiguous on a 1-D CP
mesh, zigzag on a 1-D "ring" mesh or a 2-D ``(ring, ulysses)`` mesh; or, for a batch of packed
documents with ``[upipe] document_balance = "documents"``, from the batch
(``BatchDocumentLayout``, which the document mask carries).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_upipe.errors import ConfigError
from titan_upipe.parallel.document_layout import BatchDocumentLayout
from titan_upipe.parallel.layout import ContiguousLayout, SequenceLayout, ZigzagLayout
from titan_upipe.parallel.mesh import is_ring_mesh, layout_rank, mesh_degrees, ring_part, ulysses_part


def layout_for(cp_mesh: DeviceMesh, seq_len: int) -> SequenceLayout:
    """The layout the attention on this mesh expects."""
    ring, ulysses = mesh_degrees(cp_mesh)
    if cp_mesh.ndim == 1 and not is_ring_mesh(cp_mesh):
        return ContiguousLayout(seq_len, ulysses)
    return ZigzagLayout(seq_len, ring, ulysses)


def _layout(cp_mesh: DeviceMesh, seq_len: int, batch_layout: BatchDocumentLayout | None) -> SequenceLayout:
    if batch_layout is None:
        return layout_for(cp_mesh, seq_len)
    batch_layout.check_degrees(*mesh_degrees(cp_mesh))
    if batch_layout.seq_len != seq_len:
        raise ConfigError(f"the batch's document layout covers {batch_layout.seq_len} tokens, the tensor {seq_len}")
    return batch_layout


def shard_sequence(t: torch.Tensor, cp_mesh: DeviceMesh, seq_dim: int,
                   batch_layout: BatchDocumentLayout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of ``t`` along ``seq_dim`` (a contiguous copy) and the global
    positions of its tokens (``[S/C]`` int64 on ``t``'s device). ``batch_layout``: the batch's
    document-aware layout (``DocumentMask.layout``), each row in its own: ``t`` is ``[B, ...]`` and
    the positions ``[B, S/C]``."""
    layout = _layout(cp_mesh, t.shape[seq_dim], batch_layout)
    rank = layout_rank(cp_mesh)
    return layout.shard(t, rank, seq_dim).contiguous(), layout.positions(rank, device=t.device)


def _all_gather(local: torch.Tensor, group, size: int, seq_dim: int) -> list[torch.Tensor]:
    if size == 1:
        return [local]
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local, group=group)
    return shards


def gather_sequence(local: torch.Tensor, cp_mesh: DeviceMesh, seq_dim: int,
                    batch_layout: BatchDocumentLayout | None = None) -> torch.Tensor:
    """Exact inverse of ``shard_sequence`` (all-gather; not differentiable)."""
    ring, ulysses = mesh_degrees(cp_mesh)
    local = local.detach().contiguous()
    layout = _layout(cp_mesh, local.shape[seq_dim] * ring * ulysses, batch_layout)
    if ring * ulysses == 1:
        return local.clone()
    # Gather within the Ulysses group (its pieces, in order, are one ring rank's ring-local
    # sequence), then across the ring: the shards arrive in CP rank order r*U + u.
    uly_group, _, _ = ulysses_part(cp_mesh)
    ring_group, _, _ = ring_part(cp_mesh)
    ring_local = torch.cat(_all_gather(local, uly_group, ulysses, seq_dim), dim=seq_dim)
    per_ring = _all_gather(ring_local, ring_group, ring, seq_dim)
    shards = [piece for block in per_ring for piece in block.chunk(ulysses, dim=seq_dim)]
    return layout.unshard(shards, seq_dim)
