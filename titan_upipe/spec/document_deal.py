"""Which tokens each ring rank holds under packed documents: the deal behind ``DocumentZigzagLayout``.

**The count.** Under a document mask query ``i`` sees key ``j`` iff ``j <= i`` and both lie in one
document, so the token at offset ``o`` of its document sees exactly ``o + 1`` keys, wherever they
are held. A ring rank's work (the visible pairs whose query it holds) is the sum over its tokens of
``o + 1``, and a piece ``[o, o + s)`` of a document costs

    work(o, s) = tri(o + s) - tri(o),        tri(n) = n (n + 1) / 2,

whatever the other ranks hold. A document of ``n`` tokens costs ``tri(n)``; the row ``T = sum tri(n)``
in all, ``T / R`` per ring rank when balanced. The deal counts each rank's work as it deals, in exact
integers, so choosing between deals costs no second pass.

**One deal** (``deal``; every rank holds exactly ``S/R`` tokens):

1. a document of ``threshold`` tokens or more is zigzagged over all ``R`` ranks: cut into ``2R``
   pieces, rank ``r`` gets pieces ``r`` and ``2R-1-r``, so each rank does ``1/R`` of its work at every
   ring step (the zigzag's property, per document). The leftover ``n mod 2R`` tokens go one each to
   the ranks in turn, across documents, so no rank overfills;
2. under a cap (``cap_divisor = m``: a rank's share of one document at most ``T / (m R)``), a shorter
   document whose work exceeds the cap is split too: over all ``R`` ranks when its pieces are at
   least a quarter of ``piece_floor`` tokens (``ALL_RANKS_PIECE_DIVISOR``), else zigzagged over the
   ``k`` least-loaded ranks (``2k`` pieces), ``k`` the fewest ranks that bring a share under the
   cap, as many as pieces of ``piece_floor`` tokens (one kernel tile) allow;
3. the rest, and those shares, heaviest first, to the least-loaded ranks that have room for them;
4. what fits nowhere fills the room left, in sequence order (cut at a rank's end where needed).

**Why a cap.** A document dealt whole puts all its ``tri(n)`` on one rank, and that rank's other
tokens cannot even it out (its token count is fixed): a document just under the threshold can leave
the busiest rank 1.1-1.2x the mean (issue 42). Heaviest-first dealing ends within one item of the
mean, so an item under ``T / (m R)`` bounds that excess, room allowing. ``balanced_deal`` tries no
cap first (the documents of ``threshold`` tokens or more only: the fewest pieces and kernel calls),
then ``m = 8, 16, 32, 64``, and keeps the first deal whose busiest rank is within ``BALANCE_TARGET``
of the mean, else the best one.

**Never worse than the fixed zigzag.** ``row_deal`` and ``batch_deals`` compare the busiest rank's
work (exact) with the fixed zigzag's and keep the zigzag's runs (``zigzag_deal``) when the deal is
not better: per row, then for the whole batch (the ring runs every row at every step, so a rank's
time is its work summed over the rows).

Deterministic: a pure function of the document lengths (stable orders, ties to the lowest rank,
integer arithmetic), so every rank derives the same runs from the batch's document ids.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


def zigzag_chunks(ring_rank: int, ring_size: int) -> tuple[int, int]:
    """The two chunks (of ``2R``) ring rank ``ring_rank`` owns, in slot order: ``r`` and ``2R-1-r``,
    so every rank holds as many causal (query, key) pairs as any other."""
    if not 0 <= ring_rank < ring_size:
        raise ValueError(f"ring rank {ring_rank} outside [0, {ring_size})")
    return ring_rank, 2 * ring_size - 1 - ring_rank


Runs = tuple[tuple[int, int], ...]
"""Half-open ``(start, stop)`` token runs in global order."""

PIECE_FLOOR_TOKENS = 128
"""The shortest piece a split chosen for balance cuts (one flash-attention tile): a split document's
pieces are ring blocks of their own (one kernel call per shared document and ring step)."""

ALL_RANKS_PIECE_DIVISOR = 4
"""A document split for balance over *all* ring ranks may cut pieces down to a quarter of
``PIECE_FLOOR_TOKENS`` (32 tokens): split over fewer ranks it would do its cross-rank work at only
some ring steps on some ranks, which the ring's lockstep turns into waiting (on the adversarial mixes
of docs/benchmarks/document_balance.md the ring schedule's worst fell from 1.35 to 1.05x balanced).
Over fewer ranks the pieces stay a tile long."""

CAP_DIVISORS = (None, 8, 16, 32, 64)
"""``balanced_deal``'s caps on one rank's share of a document, ``T / (m R)``, tried in order (None: no
cap, only the documents of ``threshold`` tokens or more are split)."""

BALANCE_TARGET = (51, 50)
"""``busiest / mean <= 51/50``: the deal ``balanced_deal`` accepts without trying a smaller cap."""


def tri(n: int) -> int:
    """Visible pairs of a document of ``n`` tokens (``n (n + 1) / 2``)."""
    return n * (n + 1) // 2


def piece_work(offset: int, size: int) -> int:
    """Visible pairs whose query lies in the piece ``[offset, offset + size)`` of its document."""
    return tri(offset + size) - tri(offset)


@dataclass(frozen=True)
class Deal:
    """Each ring rank's runs and its exact work (visible pairs of its queries) for one row."""

    runs: tuple[Runs, ...]
    work: tuple[int, ...]
    is_zigzag: bool = False
    """The fixed zigzag's runs (``zigzag_deal``), chosen because no document-aware deal beat it."""

    @property
    def busiest(self) -> int:
        return max(self.work)


def _merged(runs: list[tuple[int, int]]) -> Runs:
    out: list[tuple[int, int]] = []
    for a, b in sorted(runs):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif b > a:
            out.append((a, b))
    return tuple(out)


class _Dealer:
    """One deal in progress: every rank's runs, room left (tokens) and work so far (pairs)."""

    def __init__(self, seq_len: int, ring_size: int) -> None:
        self.ring_size = ring_size
        self.runs: list[list[tuple[int, int]]] = [[] for _ in range(ring_size)]
        self.room = [seq_len // ring_size] * ring_size
        self.work = [0] * ring_size
        self.next_extra = 0  # which rank takes the next leftover token of a document zigzagged over all
        self.heap: list[tuple[int, int]] | None = None  # (work, rank), built at the first least_loaded(1, ...)

    def give(self, rank: int, start: int, stop: int, doc_start: int) -> None:
        if stop > start:
            self.runs[rank].append((start, stop))
            self.room[rank] -= stop - start
            self.work[rank] += piece_work(start - doc_start, stop - start)
            if self.heap is not None and self.room[rank]:
                heapq.heappush(self.heap, (self.work[rank], rank))

    def zigzag_over_all(self, start: int, length: int) -> None:
        """``2R`` pieces, rank ``r`` pieces ``r`` and ``2R-1-r``; the ``n mod 2R`` leftover tokens one
        each to the next ranks in turn (a rank's first piece, then its second), so the ranks' totals
        from such documents never differ by more than one token and none exceeds ``S/R``."""
        R = self.ring_size
        q, extra = divmod(length, 2 * R)
        extras = [0] * R
        for i in range(extra):
            extras[(self.next_extra + i) % R] += 1
        self.next_extra = (self.next_extra + extra) % R
        at = start
        for piece in range(2 * R):
            rank = piece if piece < R else 2 * R - 1 - piece
            size = q + (extras[rank] >= 1 if piece < R else extras[rank] == 2)
            self.give(rank, at, at + size, start)
            at += size

    def zigzag_over(self, ranks: Sequence[int], start: int, length: int) -> None:
        """``2k`` near-equal pieces over ``k`` ranks: ``ranks[i]`` gets pieces ``i`` and ``2k-1-i``."""
        k = len(ranks)
        q, extra = divmod(length, 2 * k)
        at = start
        for piece in range(2 * k):
            size = q + (piece < extra)
            self.give(ranks[piece if piece < k else 2 * k - 1 - piece], at, at + size, start)
            at += size

    def least_loaded(self, count: int, need: int) -> list[int]:
        """Up to ``count`` ranks with room for ``need`` tokens, least work first (ties: lowest rank)."""
        if count == 1:
            return self._least_loaded_one(need)
        fits = [r for r in range(self.ring_size) if self.room[r] >= need]
        return sorted(fits, key=lambda r: (self.work[r], r))[:count]

    def _least_loaded_one(self, need: int) -> list[int]:
        """``least_loaded(1, need)`` from a heap of ``(work, rank)``: once per document, so at 50K
        documents a scan of every rank per document would dominate the deal. Entries are lazy: one
        whose work is no longer its rank's, or whose rank is full, is dropped when it surfaces."""
        if self.heap is None:
            self.heap = [(w, r) for r, w in enumerate(self.work) if self.room[r]]
            heapq.heapify(self.heap)
        passed, found = [], []
        while self.heap and not found:
            w, r = heapq.heappop(self.heap)
            if w != self.work[r] or not self.room[r]:
                continue
            (found if self.room[r] >= need else passed).append((w, r))
        for entry in passed + found:
            heapq.heappush(self.heap, entry)
        return [r for _, r in found]

    def place(self, start: int, length: int, ranks: int) -> bool:
        """The document whole (``ranks = 1``) or zigzagged over ``ranks`` of the least-loaded ranks
        with room (fewer when fewer have room); False when no rank has room for it whole."""
        while ranks > 1:
            chosen = self.least_loaded(ranks, -(-length // ranks))
            if len(chosen) == ranks:
                self.zigzag_over(chosen, start, length)
                return True
            ranks = max(1, len(chosen))
        chosen = self.least_loaded(1, length)
        if chosen:
            self.give(chosen[0], start, start + length, start)
        return bool(chosen)

    def fill(self, documents: list[tuple[int, int]]) -> None:
        """``documents`` in sequence order into the room left, rank by rank."""
        rank = 0
        for start, stop in documents:
            at = start
            while at < stop:
                while self.room[rank] == 0:
                    rank += 1
                take = min(stop - at, self.room[rank])
                self.give(rank, at, at + take, start)
                at += take

    def result(self) -> Deal:
        if any(self.room):
            raise AssertionError(f"a deal left room {self.room}: every rank must hold S/R tokens")
        return Deal(tuple(_merged(runs) for runs in self.runs), tuple(self.work))


def split_threshold(seq_len: int, ring_size: int, min_split: int) -> int:
    """The length from which a job's layout always zigzags a document over every ring rank:
    ``min(min_split, max(S / (4R), 2R x PIECE_FLOOR_TOKENS))``. A document dealt whole puts all its
    ``n^2 / 2`` pairs on one ring rank; once ``n`` nears a rank's share ``S/R`` that one document
    outweighs the mean (at 128K tokens on 16 ring ranks, 8K each, a fixed 16K left the busiest rank
    2x the mean before ``balanced_deal`` split shorter documents). The floor keeps the pieces at
    least a kernel tile long (the cap would cut 64-token pieces there). Shorter documents are split
    where the balance needs it (``balanced_deal``). A ``min_split`` below both is taken as set."""
    return min(min_split, max(seq_len // (4 * ring_size), 2 * ring_size * PIECE_FLOOR_TOKENS))


def split_ranks(length: int, ring_size: int, threshold: int, cap: tuple[int, int] | None,
                piece_floor: int) -> int:
    """Over how many ranks ``deal`` zigzags a document of ``length`` tokens (1: whole). ``cap``:
    ``(T, m R)``, a share of at most ``T / (m R)`` pairs, or None (split from ``threshold`` only)."""
    if length >= threshold:
        return ring_size
    if cap is None:
        return 1
    total, parts = cap
    need = -(-tri(length) * parts // total)  # the fewest shares of tri(length) / k <= total / parts
    if need <= 1:
        return 1
    if length >= 2 * ring_size * max(1, piece_floor // ALL_RANKS_PIECE_DIVISOR):
        return ring_size  # all ranks: the zigzag's balance at every ring step
    return max(1, min(need, length // (2 * piece_floor)))


def deal(lengths: Sequence[int], ring_size: int, threshold: int, cap_divisor: int | None = None,
         piece_floor: int = PIECE_FLOOR_TOKENS) -> Deal:
    """One row's deal (module docstring, steps 1-4): ``lengths`` the documents packed from token 0,
    split from ``threshold`` tokens, and under ``cap_divisor = m`` wherever a rank's share of a
    document would exceed ``T / (m R)`` pairs."""
    seq_len = sum(lengths)
    if seq_len % ring_size:
        raise ValueError(f"{seq_len} tokens do not split over {ring_size} ring ranks")
    total = sum(tri(n) for n in lengths)
    cap = None if cap_divisor is None or not total else (total, cap_divisor * ring_size)
    dealer = _Dealer(seq_len, ring_size)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    items = []  # (-work of one share, document, ranks): heaviest share first, ties in sequence order
    for d, n in enumerate(lengths):
        ranks = split_ranks(n, ring_size, threshold, cap, piece_floor)
        if ranks == ring_size:
            dealer.zigzag_over_all(starts[d], n)
        else:
            items.append((-(tri(n) // ranks), d, ranks))
    left = []  # fits nowhere whole
    for _, d, ranks in sorted(items):
        if not dealer.place(starts[d], lengths[d], ranks):
            left.append((starts[d], starts[d] + lengths[d]))
    dealer.fill(sorted(left))
    return dealer.result()


def _within_target(candidate: Deal, total: int) -> bool:
    num, den = BALANCE_TARGET
    return den * len(candidate.work) * candidate.busiest <= num * total


def balanced_deal(lengths: Sequence[int], ring_size: int, threshold: int) -> Deal:
    """The first deal of ``CAP_DIVISORS`` within ``BALANCE_TARGET`` of the mean (fewest splits), else
    the one with the least busiest rank (ties: the fewer splits). Pieces cut for balance are at least
    ``PIECE_FLOOR_TOKENS`` long, or as short as ``threshold``'s own pieces where those are shorter."""
    piece_floor = min(PIECE_FLOOR_TOKENS, max(1, threshold // (2 * ring_size)))
    total = sum(tri(n) for n in lengths)
    best = None
    for divisor in CAP_DIVISORS:
        candidate = deal(lengths, ring_size, threshold, divisor, piece_floor)
        if best is None or candidate.busiest < best.busiest:
            best = candidate
        if _within_target(candidate, total):
            break
    return best


def zigzag_deal(lengths: Sequence[int], ring_size: int) -> Deal:
    """The fixed zigzag (``ZigzagLayout``: ``2R`` chunks, rank ``r`` owns ``r`` and ``2R-1-r``) with
    each rank's exact work on these documents. ``S`` must be a multiple of ``2R``."""
    seq_len = sum(lengths)
    if seq_len % (2 * ring_size):
        raise ValueError(f"the fixed zigzag cuts {seq_len} tokens into 2 x {ring_size} equal chunks: it does not")
    chunk = seq_len // (2 * ring_size)
    owner = [0] * (2 * ring_size)
    for rank in range(ring_size):
        for c in zigzag_chunks(rank, ring_size):
            owner[c] = rank
    work = [0] * ring_size
    doc_start = 0
    for n in lengths:  # each document's tokens, cut at the chunk boundaries
        at = doc_start
        while at < doc_start + n:
            stop = min(doc_start + n, (at // chunk + 1) * chunk)
            work[owner[at // chunk]] += piece_work(at - doc_start, stop - at)
            at = stop
        doc_start += n
    runs = [[] for _ in range(ring_size)]
    for c in range(2 * ring_size):
        runs[owner[c]].append((c * chunk, (c + 1) * chunk))
    return Deal(tuple(_merged(r) for r in runs), tuple(work), is_zigzag=True)


def row_deal(lengths: Sequence[int], ring_size: int, threshold: int) -> Deal:
    """``balanced_deal``, or the fixed zigzag where that is not better (its busiest rank's work is not
    above the deal's; a row the zigzag cannot cut, ``S`` not a multiple of ``2R``, keeps the deal)."""
    documents = balanced_deal(lengths, ring_size, threshold)
    if sum(lengths) % (2 * ring_size):
        return documents
    zigzag = zigzag_deal(lengths, ring_size)
    return documents if documents.busiest < zigzag.busiest else zigzag


def _busiest(deals: Sequence[Deal]) -> int:
    return max(sum(work) for work in zip(*(d.work for d in deals), strict=True))


def batch_deals(rows: Sequence[Sequence[int]], ring_size: int, threshold: int) -> tuple[Deal, ...]:
    """Each row's ``row_deal``, or the fixed zigzag for every row where that leaves the batch's busiest
    rank (its work summed over the rows) no busier: never worse than the zigzag, per batch."""
    chosen = tuple(row_deal(lengths, ring_size, threshold) for lengths in rows)
    if all(d.is_zigzag for d in chosen) or any(sum(lengths) % (2 * ring_size) for lengths in rows):
        return chosen
    zigzag = tuple(d if d.is_zigzag else zigzag_deal(lengths, ring_size) for d, lengths in zip(chosen, rows, strict=True))
    return chosen if _busiest(chosen) < _busiest(zigzag) else zigzag


def zigzag_ring_runs(seq_len: int, ring_size: int) -> tuple[Runs, ...]:
    """The fixed zigzag's runs per ring rank: chunks ``r`` and ``2R-1-r`` of ``S/(2R)`` tokens
    (one run ``[0, S)`` at ``R = 1``)."""
    chunk = seq_len // (2 * ring_size)
    out = []
    for rank in range(ring_size):
        first, second = zigzag_chunks(rank, ring_size)
        runs = ((first * chunk, (first + 1) * chunk), (second * chunk, (second + 1) * chunk))
        out.append(((runs[0][0], runs[1][1]),) if runs[0][1] == runs[1][0] else runs)
    return tuple(out)
