"""Which blocks zigzag ring attention computes at each ring step: pure functions, no torch.

Ring rank ``r`` of ``R`` holds, after the Ulysses all-to-all, the queries and K/V of its two
zigzag chunks ``(r, 2R-1-r)`` (``titan_upipe.parallel.ZigzagLayout``): its ring-local
sequence has two *slots* of ``S/(2R)`` tokens. At step ``t`` it holds the K/V of ring rank
``(r - t) mod R``. Each (query chunk, KV chunk) pair is a block of the global causal mask:

* ``FULL``      KV chunk before the query chunk: every query sees every key;
* ``DIAGONAL``  the same chunk: causal inside the block;
* ``SKIP``      KV chunk after the query chunk: nothing visible.

Step 0 is the rank's own two chunks, whose pattern ``[[DIAGONAL, SKIP], [FULL, DIAGONAL]]`` is
one causal attention over the ring-local sequence. At steps ``t > 0`` the KV owner ``s`` is
either before ``r`` (both query chunks see KV chunk ``s``, neither sees ``2R-1-s``) or after it
(only query chunk ``2R-1-r`` sees, and it sees both KV chunks): one full block per step, so
every rank does the same work at every step (the point of zigzag).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class BlockKind(enum.Enum):
    FULL = "full"
    DIAGONAL = "diagonal"
    SKIP = "skip"


BlockRule = Callable[[int, int], BlockKind]


def causal_block_kind(q_chunk: int, kv_chunk: int) -> BlockKind:
    """The global causal mask restricted to one (query chunk, KV chunk) block."""
    if kv_chunk < q_chunk:
        return BlockKind.FULL
    if kv_chunk == q_chunk:
        return BlockKind.DIAGONAL
    return BlockKind.SKIP


def zigzag_chunks(ring_rank: int, ring_size: int) -> tuple[int, int]:
    """The two chunks (of ``2R``) ring rank ``ring_rank`` owns, in slot order."""
    if not 0 <= ring_rank < ring_size:
        raise ValueError(f"ring rank {ring_rank} outside [0, {ring_size})")
    return ring_rank, 2 * ring_size - 1 - ring_rank


def kv_source(ring_rank: int, ring_size: int, step: int) -> int:
    """Whose K/V ring rank ``ring_rank`` holds at ``step`` (K/V move to the next rank each step)."""
    return (ring_rank - step) % ring_size


@dataclass(frozen=True)
class BlockCall:
    """One local attention call: query slots ``[q_start, q_stop)`` against KV slots
    ``[kv_start, kv_stop)`` of the ring-local sequence (slot = one zigzag chunk)."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    causal: bool


def step_calls(ring_rank: int, ring_size: int, step: int, rule: BlockRule = causal_block_kind) -> tuple[BlockCall, ...]:
    """The local attention calls of one ring step, as few as the block pattern allows."""
    q_chunks = zigzag_chunks(ring_rank, ring_size)
    kv_chunks = zigzag_chunks(kv_source(ring_rank, ring_size, step), ring_size)
    kinds = [[rule(qc, kc) for kc in kv_chunks] for qc in q_chunks]
    D, F, S = BlockKind.DIAGONAL, BlockKind.FULL, BlockKind.SKIP
    if kinds == [[D, S], [F, D]]:
        # Causal over the ring-local sequence (its two chunks are in global order).
        return (BlockCall(0, 2, 0, 2, causal=True),)
    visible = [(i, j) for i in range(2) for j in range(2) if kinds[i][j] is not S]
    if not visible:
        return ()
    rows = sorted({i for i, _ in visible})
    cols = sorted({j for _, j in visible})
    is_rectangle = len(visible) == len(rows) * len(cols)
    if is_rectangle and all(kinds[i][j] is F for i, j in visible):
        # rows/cols are sets of slots in {0, 1}: always a contiguous range.
        return (BlockCall(rows[0], rows[-1] + 1, cols[0], cols[-1] + 1, causal=False),)
    return tuple(BlockCall(i, i + 1, j, j + 1, causal=kinds[i][j] is D) for i, j in visible)
