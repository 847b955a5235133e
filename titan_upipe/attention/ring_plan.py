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

**Packed documents** (``document_step_calls``): query ``i`` sees key ``j`` iff ``j <= i`` and both
lie in one document (each document one contiguous run of global positions). A block splits into:

* the *diagonal* (query chunk = KV chunk, step 0 only): causal attention inside each document's
  run within the chunk (each run one segment of ``documents.segmented_causal_forward``);
* an *earlier* KV chunk ``k < q``: a key ``j`` of chunk ``k`` and a query ``i`` of chunk ``q``
  share a document only if that document covers ``[j, i]``, hence the first token ``p = qL`` of
  the query chunk: the visible part is one full rectangle, the queries of ``doc(p)`` in chunk ``q``
  (a prefix) times its keys in chunk ``k`` (a suffix), or nothing when ``doc(p)`` starts after
  chunk ``k``. One non-causal kernel call per row, no mask;
* a *later* KV chunk: nothing.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from titan_upipe.parallel.layout import zigzag_chunks


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


# ------------------------------------------------------------------------------- packed documents

Range = tuple[int, int]
"""Token indices ``[start, stop)``."""


@dataclass(frozen=True)
class DiagonalCall:
    """Causal attention of zigzag slot ``slot`` against itself, inside each document: row ``b``'s
    slot-local runs ``segments[b]`` tile ``[0, L)`` in order, one run per document."""

    slot: int
    segments: tuple[tuple[Range, ...], ...]


@dataclass(frozen=True)
class RectangleCall:
    """Batch row ``row``: the slot-local queries ``q`` of slot ``q_slot`` see every slot-local key
    ``kv`` of slot ``kv_slot`` (one non-causal call, no mask)."""

    row: int
    q_slot: int
    kv_slot: int
    q: Range
    kv: Range


DocumentCall = DiagonalCall | RectangleCall
DocumentPlan = Callable[[int, int, int, int, Sequence[Sequence[Range]]], tuple[DocumentCall, ...]]


def _document_at(runs: Sequence[Range], starts: Sequence[int], position: int) -> Range:
    """The run of ``runs`` (in order, tiling ``[0, S)``) holding global ``position``."""
    return runs[bisect.bisect_right(starts, position) - 1]


def _clip(runs: Sequence[Range], start: int, stop: int) -> tuple[Range, ...]:
    """``runs`` intersected with ``[start, stop)``, shifted to start at 0."""
    return tuple((max(a, start) - start, min(c, stop) - start) for a, c in runs if a < stop and c > start)


def document_step_calls(ring_rank: int, ring_size: int, step: int, slot_len: int,
                        documents: Sequence[Sequence[Range]]) -> tuple[DocumentCall, ...]:
    """The calls of one ring step under a document mask (module docstring): ``documents[b]`` are
    row ``b``'s document runs of global positions, in order, tiling ``[0, 2 R L)``."""
    q_chunks = zigzag_chunks(ring_rank, ring_size)
    kv_chunks = zigzag_chunks(kv_source(ring_rank, ring_size, step), ring_size)
    starts = [[a for a, _ in runs] for runs in documents]
    calls: list[DocumentCall] = []
    for q_slot, qc in enumerate(q_chunks):
        q_lo, q_hi = qc * slot_len, (qc + 1) * slot_len
        for kv_slot, kc in enumerate(kv_chunks):
            k_lo, k_hi = kc * slot_len, (kc + 1) * slot_len
            if kc == qc:
                calls.append(DiagonalCall(q_slot, tuple(_clip(runs, q_lo, q_hi) for runs in documents)))
            elif kc < qc:
                for row, runs in enumerate(documents):
                    doc_lo, doc_hi = _document_at(runs, starts[row], q_lo)
                    if doc_lo < k_hi:  # doc(p) reaches back into the KV chunk
                        calls.append(RectangleCall(row, q_slot, kv_slot, (0, min(doc_hi, q_hi) - q_lo),
                                                   (max(doc_lo, k_lo) - k_lo, slot_len)))
    return tuple(calls)
