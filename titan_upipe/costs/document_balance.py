"""Attention work per context-parallel rank under document (block-causal) masking: pure numpy.

A packed sequence of ``S`` tokens holds documents of lengths ``L_0, L_1, ...`` back to back;
with document masking query ``i`` sees key ``j`` iff ``j <= i`` and both are in the same
document. The *work* of a rank is the number of visible (query, key) pairs whose query it holds
(what a mask-aware kernel computes, up to tile rounding). Everything here is in closed form per
(document, interval) segment, so ``S`` of several million tokens costs milliseconds: no ``S x S``
matrix is ever built.

A *layout* is an ``[n, 3]`` int64 array of ``(start, stop, ring_rank)`` token intervals covering
``[0, S)`` (in any order). A ring rank's ring-local sequence is its intervals in global order,
which keeps causal order inside the rank. Under USP (``R`` ring x ``U`` Ulysses ranks) the ``U``
Ulysses ranks of a ring rank split its heads after the all-to-all, so each does ``1/U`` of the
ring rank's work: the imbalance across GPUs is the imbalance across ring ranks.

Layouts provided:

* :func:`contiguous_intervals`: rank ``r`` holds ``[r S/C, (r+1) S/C)`` (Ulysses/UPipe shard).
* :func:`zigzag_intervals` with ``chunks_per_rank = 2``: :class:`~titan_upipe.parallel.ZigzagLayout`
  (``2R`` chunks, rank ``r`` owns ``r`` and ``2R-1-r``); larger even values deal ``kR`` chunks in
  a snake order (forward, backward, forward, ...): still a fixed function of ``(S, R)``.
* :func:`greedy_chunk_intervals`: ``mR`` equal chunks dealt per batch to the rank with the least
  document-masked work that still has room (each rank gets exactly ``m`` chunks, so token counts
  stay equal).
* :func:`document_zigzag_intervals`: every document of at least ``min_split`` tokens is cut into
  ``2R`` pieces dealt zigzag (rank ``r`` gets pieces ``r`` and ``2R-1-r`` of *that* document);
  the short documents fill the remaining room of each rank contiguously, in sequence order
  (``greedy_fill``: whole, heaviest first, to the least-loaded rank; the job's layout of issue 35).
* :func:`job_intervals` with ``"documents"``: the layout a job runs since issue 42,
  ``parallel.document_deal.row_deal`` (the above, shorter documents split where the balance needs
  it, and the fixed zigzag where that is not busier).

:func:`step_work` gives ``W[r, t]``: the work ring rank ``r`` does at ring step ``t`` (against the
K/V of ring rank ``(r - t) mod R``). Ring steps are synchronous, so the attention time of one
layer is at most ``sum_t max_r W[r, t]`` (:func:`ring_time`, lockstep) and at least
``max_r sum_t W[r, t]``; :func:`simulate_ring` replays the exchange order of
``titan_upipe.attention.ring`` to say where in between.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from titan_upipe.spec.document_deal import Deal, batch_deals, row_deal, zigzag_deal
from titan_upipe.spec.document_deal import split_threshold as split_threshold  # read from here too

Array = np.ndarray


def _as_i64(x) -> Array:
    return np.asarray(x, dtype=np.int64)


def pairs_below(q0, q1, k):
    """``#{(i, j): q0 <= i < q1, 0 <= j < k, j <= i}`` (broadcasting, int64)."""
    q0, q1, k = _as_i64(q0), _as_i64(q1), _as_i64(k)
    # For i + 1 < k every j <= i counts (i + 1 keys); from i = k - 1 on, all k keys count.
    m = np.clip(k - 1, q0, np.maximum(q0, q1))
    q1 = np.maximum(q0, q1)
    return (m * (m + 1) - q0 * (q0 + 1)) // 2 + (q1 - m) * np.maximum(k, 0)


def visible_pairs(q0, q1, k0, k1):
    """Causal pairs with the query in ``[q0, q1)`` and the key in ``[k0, k1)`` (one document)."""
    k0, k1 = _as_i64(k0), _as_i64(k1)
    k1 = np.maximum(k0, k1)
    return pairs_below(q0, q1, k1) - pairs_below(q0, q1, k0)


def document_starts(lengths: Sequence[int]) -> Array:
    """``[n + 1]`` boundaries of the documents packed back to back from token 0."""
    lengths = _as_i64(lengths)
    if (lengths <= 0).any():
        raise ValueError("document lengths must be positive")
    return np.concatenate([[0], np.cumsum(lengths)])


def _check_layout(layout: Array, seq_len: int) -> Array:
    layout = _as_i64(layout).reshape(-1, 3)
    order = np.argsort(layout[:, 0], kind="stable")
    layout = layout[order]
    layout = layout[layout[:, 1] > layout[:, 0]]
    if layout[0, 0] != 0 or layout[-1, 1] != seq_len or (layout[1:, 0] != layout[:-1, 1]).any():
        raise ValueError("layout intervals must tile [0, S) exactly")
    return layout


def step_work(lengths: Sequence[int], layout: Array, ring_size: int) -> Array:
    """``W[r, t]``: visible pairs with the query on ring rank ``r`` and the key on ring rank
    ``(r - t) mod R`` (ring step ``t``), under document masking of ``lengths`` (sum = S)."""
    bounds = document_starts(lengths)
    seq_len = int(bounds[-1])
    iv = _check_layout(layout, seq_len)
    # Segments: every (document, interval) intersection, in global order.
    cuts = np.union1d(bounds, np.concatenate([iv[:, 0], iv[:, 1]]))
    seg_start, seg_stop = cuts[:-1], cuts[1:]
    seg_doc = np.searchsorted(bounds, seg_start, side="right") - 1
    seg_rank = iv[np.searchsorted(iv[:, 0], seg_start, side="right") - 1, 2]
    W = np.zeros((ring_size, ring_size), dtype=np.int64)
    # Self pairs of every segment (the only pairs of single-segment documents): step 0.
    self_pairs = visible_pairs(seg_start, seg_stop, seg_start, seg_stop)
    np.add.at(W[:, 0], seg_rank, self_pairs)
    # Cross pairs of multi-segment documents: query segment a after key segment b.
    first = np.searchsorted(seg_doc, np.arange(len(bounds) - 1), side="left")
    count = np.diff(np.append(first, len(seg_doc)))
    for d in np.nonzero(count > 1)[0]:
        lo, hi = first[d], first[d] + count[d]
        qs, qe, qr = seg_start[lo:hi], seg_stop[lo:hi], seg_rank[lo:hi]
        a, b = np.tril_indices(hi - lo, k=-1)  # a > b: every key of b precedes every query of a
        full = (qe[a] - qs[a]) * (qe[b] - qs[b])
        np.add.at(W, (qr[a], (qr[a] - qr[b]) % ring_size), full)
    return W


def cp_rank_work(W: Array, ulysses_size: int = 1) -> Array:
    """Work per CP rank ``c = ring_rank * U + ulysses_rank`` under USP: after the Ulysses
    all-to-all each of the ``U`` ranks of a ring rank computes all of its queries for ``1/U`` of
    the heads, so it does ``1/U`` of the ring rank's work (float; ``U = 1``: plain ring)."""
    return np.repeat(W.sum(axis=1) / ulysses_size, ulysses_size)


def merge_runs(layout: Array) -> Array:
    """The layout with adjacent intervals of the same rank joined (its number of runs)."""
    iv = _as_i64(layout).reshape(-1, 3)
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    new = np.ones(len(iv), dtype=bool)
    new[1:] = (iv[1:, 2] != iv[:-1, 2]) | (iv[1:, 0] != iv[:-1, 1])
    first = np.nonzero(new)[0]
    last = np.append(first[1:], len(iv)) - 1
    return np.stack([iv[first, 0], iv[last, 1], iv[first, 2]], axis=1)


def ring_time(W: Array) -> int:
    """Synchronous ring: each step lasts as long as its slowest rank."""
    return int(W.max(axis=0).sum())


def simulate_ring(W: Array, comm: float = 0.0, backward: bool = False) -> float:
    """Finish time of one ring pass with the exchange order of ``titan_upipe.attention.ring``.

    Forward: at step ``t`` rank ``r`` posts the K/V exchange (send to ``r+1``, receive from
    ``r-1``), computes ``W[r, t]``, then waits; the exchange completes ``comm`` after both
    peers have posted it. So step ``t+1`` starts at
    ``max(finish(r, t), start(r-1, t) + comm, start(r+1, t) + comm)``: neighbours couple
    through their *start* times, and a slow rank delays the others only by one step per hop.
    Backward adds the dK/dV exchange, posted after the compute and waited at the next step
    (so neighbours couple through their *finish* times), costing another ``comm``."""
    R = W.shape[0]
    ranks = np.arange(R)
    left, right = (ranks - 1) % R, (ranks + 1) % R  # x[left][r] = x[r-1]: np.roll(x, 1), ~10x cheaper

    def after_neighbours(own: Array, posted: Array) -> Array:
        return np.maximum(np.maximum(own, posted[left] + comm), posted[right] + comm)

    start = np.zeros(R)
    dkv_post = None
    finish = start
    for t in range(R):
        finish = start + W[:, t]
        if backward and dkv_post is not None:
            finish = after_neighbours(finish, dkv_post)
        if backward and R > 1:
            dkv_post = finish
        if t < R - 1:
            start = after_neighbours(finish, start)
    if backward and dkv_post is not None:
        finish = after_neighbours(finish, dkv_post)
    return float(finish.max())


def imbalance(W: Array) -> dict[str, float]:
    """``total``: max/mean of per-rank work; ``stepwise``: ``ring_time`` / (total work / R)."""
    per_rank = W.sum(axis=1)
    mean = per_rank.mean()
    return {
        "total": float(per_rank.max() / mean) if mean else 1.0,
        "stepwise": float(ring_time(W) / mean) if mean else 1.0,
    }


# --- layouts ---------------------------------------------------------------------------------


def contiguous_intervals(seq_len: int, world_size: int) -> Array:
    if seq_len % world_size:
        raise ValueError("seq_len must be divisible by the world size")
    n = seq_len // world_size
    return np.array([(r * n, (r + 1) * n, r) for r in range(world_size)], dtype=np.int64)


def snake_owner(n_chunks: int, ring_size: int) -> Array:
    """Owner of each of ``n_chunks`` chunks dealt forward, backward, forward, ... over the ranks."""
    c = np.arange(n_chunks)
    rnd, pos = np.divmod(c, ring_size)
    return np.where(rnd % 2 == 0, pos, ring_size - 1 - pos)


def zigzag_intervals(seq_len: int, ring_size: int, chunks_per_rank: int = 2) -> Array:
    """``chunks_per_rank * R`` equal chunks dealt in snake order; 2 is ``ZigzagLayout``."""
    n_chunks = chunks_per_rank * ring_size
    if seq_len % n_chunks:
        raise ValueError("seq_len must be divisible by chunks_per_rank * ring_size")
    k = seq_len // n_chunks
    owner = snake_owner(n_chunks, ring_size)
    return np.array([(c * k, (c + 1) * k, owner[c]) for c in range(n_chunks)], dtype=np.int64)


def query_work(lengths: Sequence[int], starts: Array, stops: Array) -> Array:
    """Document-masked work of the queries in each ``[start, stop)`` (all keys, any rank)."""
    bounds = document_starts(lengths)
    starts, stops = _as_i64(starts), _as_i64(stops)
    cuts = np.union1d(bounds, np.concatenate([starts, stops]))
    s0, s1 = cuts[:-1], cuts[1:]
    doc_start = bounds[np.searchsorted(bounds, s0, side="right") - 1]
    seg_work = visible_pairs(s0, s1, doc_start, s1)
    which = np.searchsorted(starts, s0, side="right") - 1
    inside = (which >= 0) & (s1 <= stops[np.maximum(which, 0)])
    return np.bincount(which[inside], weights=seg_work[inside], minlength=len(starts)).astype(np.int64)


def greedy_chunk_intervals(lengths: Sequence[int], ring_size: int, chunks_per_rank: int) -> Array:
    """``m R`` equal chunks, heaviest first, each to the lightest rank with fewer than ``m``."""
    seq_len = int(np.sum(lengths))
    n_chunks = chunks_per_rank * ring_size
    if seq_len % n_chunks:
        raise ValueError("seq_len must be divisible by chunks_per_rank * ring_size")
    k = seq_len // n_chunks
    starts = np.arange(n_chunks, dtype=np.int64) * k
    work = query_work(lengths, starts, starts + k)
    load = np.zeros(ring_size, dtype=np.int64)
    room = np.full(ring_size, chunks_per_rank)
    owner = np.empty(n_chunks, dtype=np.int64)
    for c in np.argsort(-work, kind="stable"):
        r = int(np.argmin(np.where(room > 0, load, np.iinfo(np.int64).max)))
        owner[c] = r
        load[r] += work[c]
        room[r] -= 1
    return np.stack([starts, starts + k, owner], axis=1)


def document_zigzag_intervals(lengths: Sequence[int], ring_size: int, min_split: int,
                              greedy_fill: bool = False) -> Array:
    """Zigzag inside every document of ``>= min_split`` tokens; short ones fill the rest.

    Each rank ends with exactly ``S / R`` tokens: the long documents' pieces differ by at most
    one token between ranks, and the short documents (and the fill) are dealt contiguously into
    whatever room each rank has left, a short document split at a rank boundary if need be.
    ``greedy_fill``: short documents longest first, each whole to the rank with the least work
    that has room for it; what fits nowhere whole is then dealt contiguously as above."""
    bounds = document_starts(lengths)
    seq_len = int(bounds[-1])
    R = ring_size
    if seq_len % R:
        raise ValueError("seq_len must be divisible by ring_size")
    # plain Python ints: a row of thousands of documents is dealt in a loop, where numpy scalars cost
    # ten times as much
    owner_of_piece = [*range(R), *reversed(range(R))]
    rows: list[tuple[int, int, int]] = []
    room = [seq_len // R] * R
    short: list[tuple[int, int]] = []
    next_extra = 0  # the ranks take the documents' leftover tokens in turn, across documents
    for d in range(len(bounds) - 1):
        a, b = int(bounds[d]), int(bounds[d + 1])
        if b - a < min_split:
            short.append((a, b))
            continue
        # 2R pieces of q tokens; the n mod 2R left over go one each to the next ranks in turn (a
        # rank's first piece, then its second), so the ranks' long-document totals never differ by
        # more than one token and none exceeds S/R (a cut at n p / 2R could round up on one rank
        # document after document and overfill it)
        q, extra = divmod(b - a, 2 * R)
        extras = [0] * R
        for i in range(extra):
            extras[(next_extra + i) % R] += 1
        next_extra = (next_extra + extra) % R
        cut = a
        for p, o in enumerate(owner_of_piece):
            size = q + int(extras[o] >= 1 if p < R else extras[o] == 2)
            rows.append((cut, cut + size, o))
            room[o] -= size
            cut += size
    if min(room) < 0:
        raise AssertionError("long documents overfill a rank")
    if greedy_fill and short:
        free = np.array(room, dtype=np.int64)
        load = np.zeros(R)
        for row in rows:
            a, b, o = row
            d = int(np.searchsorted(bounds, a, side="right") - 1)
            load[o] += float(visible_pairs(a, b, bounds[d], b))
        rest = []
        for i in np.argsort([a - b for a, b in short], kind="stable"):
            a, b = short[i]
            fits = free >= b - a
            if not fits.any():
                rest.append((a, b))
                continue
            o = int(np.argmin(np.where(fits, load, np.inf)))
            rows.append((a, b, o))
            free[o] -= b - a
            load[o] += (b - a) * (b - a + 1) / 2
        short = sorted(rest)
        room = free.tolist()
    r = 0
    for a, b in short:
        while a < b:
            while room[r] == 0:
                r += 1
            take = min(b - a, room[r])
            rows.append((a, a + take, r))
            room[r] -= take
            a += take
    return np.array(rows, dtype=np.int64)


def causal_work_per_rank(seq_len: int, layout: Array, ring_size: int) -> Array:
    """Plain causal work (one document of ``S`` tokens) per ring rank."""
    return step_work([seq_len], layout, ring_size).sum(axis=1)


def deal_intervals(d: Deal) -> Array:
    """A ``parallel.document_deal.Deal``'s runs as a layout (``[n, 3]`` ``(start, stop, ring_rank)``)."""
    return runs_intervals(d.runs)


def job_intervals(lengths: Sequence[int], ring_size: int, balance: str, min_split: int) -> Array:
    """The layout a job runs one row of documents ``lengths`` in, under ``[upipe] document_balance``:
    ``"zigzag"`` (``zigzag_intervals``) or ``"documents"`` (``parallel.document_deal.row_deal`` at
    ``split_threshold``, as ``parallel.BatchDocumentLayout`` lays out a batch of one row; a batch of
    several rows: ``batch_intervals``)."""
    seq_len = int(sum(lengths))
    if balance == "zigzag":
        return zigzag_intervals(seq_len, ring_size)
    if balance == "documents":
        return deal_intervals(row_deal(lengths, ring_size, split_threshold(seq_len, ring_size, min_split)))
    raise ValueError(f"balance {balance!r}: valid values are zigzag, documents")


def batch_intervals(rows: Sequence[Sequence[int]], ring_size: int, min_split: int) -> list[Array]:
    """Each row's layout under ``"documents"`` as ``parallel.BatchDocumentLayout`` lays the batch out
    (``batch_deals``: the rows' deals, or the fixed zigzag for all where that is not busier)."""
    seq_len = int(sum(rows[0]))
    return [deal_intervals(d) for d in batch_deals(rows, ring_size, split_threshold(seq_len, ring_size, min_split))]


def runs_intervals(ring_runs: Sequence[Sequence[tuple[int, int]]]) -> Array:
    """A layout from each ring rank's ``(start, stop)`` runs (``ring_runs[r]``, as the ring reads them)."""
    return _as_i64([(a, b, r) for r, runs in enumerate(ring_runs) for a, b in runs]).reshape(-1, 3)


def ring_work_ratios(rows: Sequence[Sequence[int]], ring_size: int, min_split: int) -> tuple[float, float]:
    """Busiest / mean ring-rank work of one batch (``rows``: each row's document lengths), summed
    over the rows: ``(fixed zigzag, the job's document-aware layout)`` (``parallel.document_deal``:
    ``zigzag_deal``, and ``batch_deals`` at ``split_threshold`` as ``parallel.BatchDocumentLayout``),
    each rank's work counted exactly as the deal makes it. Under the ring's synchronous steps the
    busiest rank sets every rank's attention time."""
    threshold = split_threshold(int(sum(rows[0])), ring_size, min_split)
    zigzag = np.sum([zigzag_deal(lengths, ring_size).work for lengths in rows], axis=0, dtype=np.float64)
    documents = np.sum([d.work for d in batch_deals(rows, ring_size, threshold)], axis=0, dtype=np.float64)
    return float(zigzag.max() / zigzag.mean()), float(documents.max() / documents.mean())
