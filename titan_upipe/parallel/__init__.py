"""Sequence layouts for context parallelism: which tokens each CP rank holds."""

from titan_upipe.parallel.layout import ContiguousLayout, SequenceLayout
from titan_upipe.parallel.sequence import gather_sequence, layout_for, shard_sequence

__all__ = ["ContiguousLayout", "SequenceLayout", "gather_sequence", "layout_for", "shard_sequence"]
