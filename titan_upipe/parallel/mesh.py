"""Context-parallel meshes: the 1-D CP mesh, a 1-D ring mesh, or a 2-D ``(ring, ulysses)`` mesh.

The mesh alone decides the sequence layout (``layout_for``), so the attention, the trainer's
sharding and the layout check can never disagree:

========================== ===================== ======================================
mesh                       (ring, ulysses)       layout
========================== ===================== ======================================
1-D, any name but "ring"   (1, C)                contiguous (Ulysses, UPipe)
1-D named "ring"           (C, 1)                zigzag (ring attention)
2-D ("ring", "ulysses")    sizes of the dims     zigzag over ring, contiguous over ulysses
========================== ===================== ======================================

Ulysses is the inner (fastest-varying) dim: the Ulysses ranks of one ring rank are
consecutive CP ranks, i.e. inside a node when CP ranks are numbered by node.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_upipe.errors import ConfigError
from titan_upipe.spec.cp_layout import CPLayout, resolve_mesh_shape

RING_DIM = "ring"
ULYSSES_DIM = "ulysses"
MESH_2D_NAMES = (RING_DIM, ULYSSES_DIM)


def _names(mesh: Any) -> tuple[str, ...]:
    return tuple(getattr(mesh, "mesh_dim_names", None) or ())


def is_ring_mesh(mesh: Any) -> bool:
    """A 1-D mesh whose sequence layout is zigzag (pure ring attention)."""
    return mesh.ndim == 1 and _names(mesh) == (RING_DIM,)


def mesh_degrees(mesh: Any) -> tuple[int, int]:
    """``(ring degree, ulysses degree)`` of a context-parallel mesh (see the module table)."""
    if mesh.ndim == 1:
        return (mesh.size(), 1) if is_ring_mesh(mesh) else (1, mesh.size())
    if mesh.ndim == 2 and _names(mesh) == MESH_2D_NAMES:
        return mesh.size(0), mesh.size(1)
    raise ConfigError(
        f"cp_mesh must be 1-D, or 2-D with dims {MESH_2D_NAMES} (ring outer, ulysses inner); got a "
        f"{mesh.ndim}-D mesh with dims {_names(mesh) or None}: build it with "
        "titan_upipe.parallel.context_parallel_mesh(cp_mesh, mode, ulysses_degree)"
    )


def ring_part(mesh: Any) -> tuple[dist.ProcessGroup | None, int, int]:
    """(group, local rank, size) of the ring dim; ``(None, 0, 1)`` when there is no ring."""
    ring, _ = mesh_degrees(mesh)
    if mesh.ndim == 2:
        return (mesh.get_group(RING_DIM), mesh.get_local_rank(RING_DIM), ring) if ring > 1 else (None, 0, 1)
    if is_ring_mesh(mesh):
        return mesh.get_group(), mesh.get_local_rank(), ring
    return None, 0, 1


def ulysses_part(mesh: Any) -> tuple[dist.ProcessGroup | None, int, int]:
    """(group, local rank, size) of the Ulysses dim; ``(None, 0, 1)`` when there is none."""
    _, ulysses = mesh_degrees(mesh)
    if mesh.ndim == 2:
        return (mesh.get_group(ULYSSES_DIM), mesh.get_local_rank(ULYSSES_DIM), ulysses) if ulysses > 1 else (None, 0, 1)
    if is_ring_mesh(mesh):
        return None, 0, 1
    return mesh.get_group(), mesh.get_local_rank(), ulysses


def layout_rank(mesh: Any) -> int:
    """This rank's index in the sequence layout: ``ring_rank * U + ulysses_rank``."""
    if mesh.ndim == 1:
        return mesh.get_local_rank()
    mesh_degrees(mesh)
    return mesh.get_local_rank(RING_DIM) * mesh.size(1) + mesh.get_local_rank(ULYSSES_DIM)


def context_parallel_mesh(cp_mesh: DeviceMesh, mode: str, ulysses_degree: int = 0) -> DeviceMesh:
    """The mesh ``mode`` runs on, derived from TorchTitan's 1-D ``cp`` mesh (which may be a
    sub-mesh of a larger ``dp x cp`` world) with ``DeviceMesh._unflatten``, the torch-native
    way to split a mesh dim (it creates the new groups consistently on every rank).

    ``ulysses``/``upipe`` with ``ulysses_degree`` 0 or C: ``cp_mesh`` itself; ``ring``: a 1-D
    mesh named "ring"; ``usp``/``upipe`` with ``1 <= ulysses_degree < C``: 2-D
    ``(C/ulysses_degree, ulysses_degree)``. Each call creates new process groups (call it on
    every rank): build the mesh once per job and pass it down (TorchTitan 0.2's adapter holds it
    in its ``launched_job``; ``titan_upipe.attention.sequence_mesh`` reads it off a converted model).
    """
    return mesh_of_shape(cp_mesh, *resolve_mesh_shape(mode, cp_mesh.size(), ulysses_degree))


def layout_mesh(cp_mesh: DeviceMesh, layout: CPLayout) -> DeviceMesh:
    """``context_parallel_mesh`` of a job's validated layout (its ring and Ulysses degrees)."""
    return mesh_of_shape(cp_mesh, layout.ring_degree, layout.ulysses_degree, layout.two_d)


def mesh_of_shape(cp_mesh: DeviceMesh, ring: int, ulysses: int, two_d: bool) -> DeviceMesh:
    """``cp_mesh`` itself (no ring, 1-D), a 1-D "ring" mesh, or the 2-D ``(ring, ulysses)`` one."""
    if ring == 1 and not two_d:
        return cp_mesh
    names = MESH_2D_NAMES if two_d else (RING_DIM,)
    shape = (ring, ulysses) if two_d else (ring,)
    return cp_mesh._unflatten(0, shape, names)
