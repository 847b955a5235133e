"""Sequence tiles shared by the tiled transforms."""

from __future__ import annotations

# One fp32-accumulation rule for every stage/tile sum (UPipe stages, MLP tiles).
from titan_upipe.attention.projection import accumulate_matmul

__all__ = ["accumulate_matmul", "tile_bounds"]


def tile_bounds(n_tokens: int, tile_tokens: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each tile. The count depends only on the shape, which is the same on
    every rank (contiguous CP shards of one global length, equal local batches), so every rank
    runs the same number of tiles. Inside a tile no collective runs: FSDP unshards a block's
    parameters once around the block's forward and once around its backward."""
    if tile_tokens <= 0:
        raise ValueError(f"tile_tokens must be positive, got {tile_tokens}")
    return [(start, min(start + tile_tokens, n_tokens)) for start in range(0, n_tokens, tile_tokens)]
