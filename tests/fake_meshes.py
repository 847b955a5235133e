"""Mesh stand-ins for in-process tests (no process group)."""

from __future__ import annotations


class OneRankMesh:
    """A 1-rank, 1-D CP mesh: a shard is the whole sequence; no process group needed."""

    ndim, mesh_dim_names, shape = 1, ("cp",), (1,)

    def size(self, dim=None):
        return 1

    def get_local_rank(self, dim=None):
        return 0

    def get_group(self, dim=None):
        return None
