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
lie in one document (each document one contiguous run of global positions). The plan reads the
layout as each ring rank's *runs* of global positions per batch row (``ring_runs``): the fixed
zigzag's two chunks (``zigzag_ring_runs``) or a document-aware layout's runs
(``parallel.DocumentZigzagLayout``), whose runs differ per row and per rank. A ring rank's
ring-local sequence is its runs in global order, so the tokens it holds of one document are one
contiguous ring-local range (nothing of another document lies between them), and two runs of
different ranks never interleave: a K/V run of a document either lies wholly before a query run of
that document (every query sees every key) or wholly after it (none does). Hence:

* step 0 (the rank's own K/V): one *diagonal* call, causal attention inside each document's
  ring-local range (one segment of ``documents.segmented_causal_forward`` per document and row);
* step ``t > 0``: per row and per document held by both ranks, the query runs that see the same
  K/V runs (a prefix of the document's K/V range) form one unmasked *rectangle*; nothing else is
  visible, so a block with no shared document costs no call.

::

    R = 2, one row, documents A = [0, 10), b = [10, 12), c = [12, 16) (issue 35's deal of them)
    ring rank 0 runs [0, 3) [8, 13): ring-local A = [0, 5), b = [5, 7), c = [7, 8)
    ring rank 1 runs [3, 8) [13, 16): ring-local A = [0, 5), c = [5, 8)
    step 0: each rank one diagonal call with those segments
    rank 0, step 1 (rank 1's K/V): A's [8, 10) sees A's [3, 8): q [3, 5) x kv [0, 5); c's [12, 13)
                                   sees nothing of rank 1's (later) c
    rank 1, step 1 (rank 0's K/V): A's [3, 8) sees A's [0, 3): q [0, 5) x kv [0, 3);
                                   c's [13, 16) sees c's [12, 13): q [5, 8) x kv [7, 8)
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from titan_upipe.spec.document_deal import zigzag_chunks


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
Runs = tuple[Range, ...]
"""One ring rank's global positions as ``(start, stop)`` runs, in order."""


@dataclass(frozen=True)
class DiagonalCall:
    """Step 0: the ring-local sequence against itself, causal inside each document: row ``b``'s
    ring-local runs ``segments[b]`` tile ``[0, S_r)`` in order, one run per document."""

    segments: tuple[tuple[Range, ...], ...]


@dataclass(frozen=True)
class RectangleCall:
    """Batch row ``row``: the ring-local queries ``q`` see every key ``kv`` of the held K/V block
    (ring-local to its owner): one non-causal call, no mask."""

    row: int
    q: Range
    kv: Range


DocumentCall = DiagonalCall | RectangleCall
DocumentPlan = Callable[[int, int, int, Sequence[Sequence[Runs]], Sequence[Sequence[Range]]], tuple[DocumentCall, ...]]
"""``(ring_rank, ring_size, step, ring_runs, documents) -> calls`` (``document_step_calls``)."""


Piece = tuple[int, int, int, int]
"""``(document, global start, global stop, ring-local start)``: a rank's tokens of one document in one run."""


def _pieces(runs: Runs, documents: Sequence[Range], doc_starts: Sequence[int]) -> list[Piece]:
    """``runs`` cut at the document boundaries, in order."""
    out: list[Piece] = []
    local = 0
    for a, b in runs:
        doc = bisect.bisect_right(doc_starts, a) - 1
        while a < b:
            stop = min(b, documents[doc][1])
            out.append((doc, a, stop, local))
            local += stop - a
            a, doc = stop, doc + 1
    return out


def _by_document(pieces: list[Piece]) -> dict[int, list[Piece]]:
    grouped: dict[int, list[Piece]] = {}
    for piece in pieces:
        grouped.setdefault(piece[0], []).append(piece)
    return grouped


def _diagonal_segments(pieces: list[Piece]) -> tuple[Range, ...]:
    """Each document's ring-local range (its pieces are adjacent there)."""
    out: list[list[int]] = []
    doc_of_last = -1
    for doc, a, b, local in pieces:
        if doc == doc_of_last:
            out[-1][1] = local + b - a
        else:
            out.append([local, local + b - a])
            doc_of_last = doc
    return tuple((a, b) for a, b in out)


def _rectangles(row: int, q_pieces: list[Piece], kv_pieces: list[Piece]) -> list[RectangleCall]:
    """One document's rectangles: each query piece sees the K/V pieces that end before it starts (a
    prefix of the document's K/V range); query pieces that see the same prefix share one call."""
    kv_stops = [b for _, _, b, _ in kv_pieces]
    kv_lo = kv_pieces[0][3]
    calls: list[RectangleCall] = []
    for _, a, b, local in q_pieces:
        seen = bisect.bisect_right(kv_stops, a)  # K/V pieces wholly before this query piece
        if not seen:
            continue
        _, ka, kb, klocal = kv_pieces[seen - 1]
        kv = (kv_lo, klocal + kb - ka)
        last = calls[-1] if calls else None
        if last is not None and last.kv == kv and last.q[1] == local:
            calls[-1] = RectangleCall(row, (last.q[0], local + b - a), kv)
        else:
            calls.append(RectangleCall(row, (local, local + b - a), kv))
    return calls


def document_step_calls(ring_rank: int, ring_size: int, step: int, ring_runs: Sequence[Sequence[Runs]],
                        documents: Sequence[Sequence[Range]]) -> tuple[DocumentCall, ...]:
    """The calls of one ring step under a document mask (module docstring): ``ring_runs[b][r]`` are
    ring rank ``r``'s runs of row ``b``; ``documents[b]`` row ``b``'s document runs of global
    positions, in order, tiling the row."""
    if len(ring_runs) != len(documents):
        raise ValueError(f"{len(ring_runs)} rows of ring runs for {len(documents)} rows of documents")
    source = kv_source(ring_rank, ring_size, step)
    calls: list[DocumentCall] = []
    diagonal = []
    for row, (runs, docs) in enumerate(zip(ring_runs, documents, strict=True)):
        if len(runs) != ring_size:
            raise ValueError(f"row {row} has runs for {len(runs)} ring ranks, the ring {ring_size}")
        starts = [a for a, _ in docs]
        q_pieces = _pieces(runs[ring_rank], docs, starts)
        if step == 0:
            diagonal.append(_diagonal_segments(q_pieces))
            continue
        kv_by_doc = _by_document(_pieces(runs[source], docs, starts))
        for doc, pieces in _by_document(q_pieces).items():
            if doc in kv_by_doc:
                calls.extend(_rectangles(row, pieces, kv_by_doc[doc]))
    return (DiagonalCall(tuple(diagonal)),) if step == 0 else tuple(calls)
