"""Context-parallel layouts (core layer: torch only): which ranks and tokens a job uses.

============== ==========================================================================
module         holds
============== ==========================================================================
cp_layout      ``CPMode``, ``CPLayout``: a job's mode, CP / ring / Ulysses degrees, U and
               sequence divisor, validated once; the pure degree and head arithmetic
layout         ``ContiguousLayout``, ``ZigzagLayout``: token <-> (rank, index) maps
document_layout ``DocumentZigzagLayout`` (one sequence), ``BatchDocumentLayout`` (a batch, row by
               row): packed documents balanced over a ring (``[upipe] document_balance``)
mesh           the CP meshes (1-D, 1-D "ring", 2-D ("ring", "ulysses")) and their degrees;
               ``layout_mesh``: a job's, from its ``CPLayout``
sequence       ``shard_sequence`` / ``gather_sequence`` on a mesh, in its layout
inputs         ``prepare_cp_batch``: a rank's batch for the converted attention (tokens, labels,
               positions, documents, valid tokens); ``LayoutCheck`` at every forward
============== ==========================================================================
"""

from titan_upipe.parallel.document_layout import BatchDocumentLayout, DocumentZigzagLayout
from titan_upipe.parallel.layout import ContiguousLayout, SequenceLayout, ZigzagLayout
from titan_upipe.parallel.mesh import context_parallel_mesh, layout_rank, mesh_degrees
from titan_upipe.parallel.sequence import gather_sequence, layout_for, shard_sequence
from titan_upipe.spec.cp_layout import CPLayout, CPMode

__all__ = [
    "BatchDocumentLayout",
    "CPLayout",
    "CPMode",
    "ContiguousLayout",
    "DocumentZigzagLayout",
    "SequenceLayout",
    "ZigzagLayout",
    "context_parallel_mesh",
    "gather_sequence",
    "layout_for",
    "layout_rank",
    "mesh_degrees",
    "shard_sequence",
]
