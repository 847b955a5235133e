"""A per-batch document-aware zigzag layout (issue 35): balanced ring ranks under packed documents.

The fixed zigzag (``ZigzagLayout``) balances *causal* work: ring rank ``r`` of ``R`` owns chunks
``r`` and ``2R-1-r`` of the whole sequence. Under document masking the work is the visible pairs
inside each document, and a fixed cut leaves the busiest ring rank 1.4-3.0x the mean
(``docs/benchmarks/document_balance.md``). This layout is computed per sequence from its document
lengths (``doczz-g`` there):

* every document of at least ``min_split`` tokens is cut into ``2R`` near-equal pieces dealt
  zigzag: rank ``r`` gets pieces ``r`` and ``2R-1-r`` of *that* document (its causal work split
  evenly, as the zigzag splits one long sequence);
* the shorter documents, longest first, go whole to the ring rank with the least work that still
  has room for them (ties: the lowest rank); what fits nowhere whole fills the remaining room of
  each rank in sequence order (split at a rank boundary where needed).

Every ring rank ends with exactly ``S/R`` tokens. A ring rank's *ring-local sequence* is its token
runs in global order (causal order is kept inside the rank); its ``U`` Ulysses ranks hold
contiguous ``S/(RU)``-token pieces of it, as in ``ZigzagLayout``. One document of ``S`` tokens
gives ``ZigzagLayout``'s chunks exactly.

::

    S = 16, R = 2, min_split = 8; documents A = [0, 10), b = [10, 12), c = [12, 16)

    tokens     0 1 | 2 3 4 | 5 6 | 7 8 9 | 10 11 | 12 13 14 15
    A's pieces  p0 |   p1  |  p2 |   p3  |       |
    ring rank   0  |   1   |  1  |   0   |   1   |  0  0  0  1
                     A cut in 2R = 4 pieces dealt 0, 1, 1, 0 (5 tokens each, 3 of room left);
                     b (2 tokens) whole to rank 1 (25 pairs of work against rank 0's 30);
                     c (4 tokens) fits nowhere whole: it fills rank 0's 3 tokens, then rank 1's 1
    runs       rank 0: [0, 2) [7, 10) [12, 15)      rank 1: [2, 7) [10, 12) [15, 16)

Deterministic: a pure function of the document lengths (stable sorts, ties to the lowest rank, integer
arithmetic for the cuts and the room; work compared as exact integers). Every rank derives the same
layout from the same batch (the global document ids every rank already holds for the mask), so no
collective is needed to agree on it; ``positions`` of a rank are sent as ``(start, stop)`` runs
(``position_runs``), a few per document, not per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from titan_upipe.costs.document_balance import document_zigzag_intervals
from titan_upipe.parallel.layout import RingUlyssesRanks, shard_at_positions, unshard_from_positions

Runs = tuple[tuple[int, int], ...]
"""Half-open ``(start, stop)`` token runs in global order."""


def document_zigzag_runs(lengths: Sequence[int], ring_size: int, min_split: int) -> tuple[Runs, ...]:
    """Each ring rank's token runs (module docstring), ``[R]`` tuples of ``(start, stop)`` in global
    order, adjacent runs merged. ``lengths``: the documents packed back to back from token 0. The
    deal is ``costs.document_balance.document_zigzag_intervals`` with ``greedy_fill`` (``doczz-g``,
    whose balance docs/benchmarks/document_balance.md computed)."""
    if sum(lengths) % ring_size:
        raise ValueError(f"{sum(lengths)} tokens do not split over {ring_size} ring ranks")
    intervals = document_zigzag_intervals(lengths, ring_size, min_split, greedy_fill=True)
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(ring_size)]
    for start, stop, rank in intervals.tolist():
        if stop > start:
            per_rank[rank].append((start, stop))
    return tuple(_merged(sorted(runs)) for runs in per_rank)


def _merged(runs: list[tuple[int, int]]) -> Runs:
    out: list[tuple[int, int]] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def document_lengths(doc_ids: torch.Tensor) -> list[int]:
    """Lengths of the runs of equal ids in one sequence's ``[S]`` document ids (a document is one
    contiguous run of positions, as the mask builders define it)."""
    if doc_ids.dim() != 1:
        raise ValueError(f"document ids of one sequence: [S], got {tuple(doc_ids.shape)}")
    change = torch.nonzero(doc_ids[1:] != doc_ids[:-1]).flatten() + 1
    bounds = [0, *change.tolist(), doc_ids.numel()]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@dataclass(frozen=True)
class DocumentZigzagLayout(RingUlyssesRanks):
    """One sequence over ``ring_size`` ring x ``ulysses_size`` Ulysses ranks (CP rank
    ``ring_rank * U + ulysses_rank``), ring rank ``r`` holding the token runs ``ring_runs[r]``."""

    seq_len: int
    ring_size: int
    ulysses_size: int
    ring_runs: tuple[Runs, ...]

    def __post_init__(self) -> None:
        self._check_degrees()
        if len(self.ring_runs) != self.ring_size:
            raise ValueError(f"{len(self.ring_runs)} run lists for {self.ring_size} ring ranks")
        tokens = sorted(run for runs in self.ring_runs for run in runs)
        ends = [0] + [b for _, b in tokens]
        if any(a != end or b <= a for (a, b), end in zip(tokens, ends, strict=False)) or ends[-1] != self.seq_len:
            raise ValueError("the runs must tile [0, seq_len) exactly")
        if any(sum(b - a for a, b in runs) != self.seq_len // self.ring_size for runs in self.ring_runs):
            raise ValueError("every ring rank must hold seq_len / ring_size tokens")

    @classmethod
    def of_documents(cls, lengths: Sequence[int], ring_size: int, ulysses_size: int = 1,
                     min_split: int = 16384) -> DocumentZigzagLayout:
        """The layout of one sequence of documents ``lengths`` (module docstring)."""
        return cls(sum(lengths), ring_size, ulysses_size, document_zigzag_runs(lengths, ring_size, min_split))

    def position_runs(self, rank: int) -> Runs:
        """CP rank ``rank``'s global positions as ``(start, stop)`` runs: its Ulysses piece
        ``[u L, (u+1) L)`` of its ring rank's ring-local sequence (``L = S/(RU)``)."""
        self._check_rank(rank)
        ring_rank, ulysses_rank = divmod(rank, self.ulysses_size)
        lo, hi = ulysses_rank * self.local_len, (ulysses_rank + 1) * self.local_len
        out, offset = [], 0
        for a, b in self.ring_runs[ring_rank]:
            s, e = max(a, a + lo - offset), min(b, a + hi - offset)
            if s < e:
                out.append((s, e))
            offset += b - a
        return tuple(out)

    @cached_property
    def _positions(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.cat([torch.arange(a, b) for a, b in self.position_runs(r)])
                     for r in range(self.world_size))

    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of ``rank``'s tokens, ``[S/(RU)]`` int64, ascending."""
        self._check_rank(rank)
        return self._positions[rank].to(device)

    def global_index(self, rank: int, local_index: int) -> int:
        if not 0 <= local_index < self.local_len:
            raise ValueError(f"local index {local_index} outside [0, {self.local_len})")
        return int(self.positions(rank)[local_index])

    def owner(self, token: int) -> tuple[int, int]:
        """(CP rank, local index) of global token ``token``: the inverse of ``global_index``."""
        if not 0 <= token < self.seq_len:
            raise ValueError(f"token {token} outside [0, {self.seq_len})")
        for rank in range(self.world_size):
            index = 0
            for a, b in self.position_runs(rank):
                if a <= token < b:
                    return rank, index + token - a
                index += b - a
        raise AssertionError("unreachable: the runs tile the sequence")

    def shard(self, t: torch.Tensor, rank: int, seq_dim: int) -> torch.Tensor:
        return shard_at_positions(self, t, rank, seq_dim)

    def unshard(self, shards: Sequence[torch.Tensor], seq_dim: int) -> torch.Tensor:
        """The full sequence from every rank's shard, given in CP rank order."""
        return unshard_from_positions(self, shards, seq_dim)
