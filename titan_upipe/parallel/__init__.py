"""Sequence layouts for context parallelism: which tokens each CP rank holds."""

from titan_upipe.parallel.layout import ContiguousLayout, SequenceLayout, ZigzagLayout
from titan_upipe.parallel.mesh import context_parallel_mesh, layout_rank, mesh_degrees
from titan_upipe.parallel.sequence import gather_sequence, layout_for, shard_sequence

__all__ = [
    "ContiguousLayout",
    "SequenceLayout",
    "ZigzagLayout",
    "context_parallel_mesh",
    "gather_sequence",
    "layout_for",
    "layout_rank",
    "mesh_degrees",
    "shard_sequence",
]
