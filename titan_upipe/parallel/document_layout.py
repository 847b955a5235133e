"""A per-batch document-aware zigzag layout (issues 35, 42): balanced ring ranks under packed documents.

The fixed zigzag (``ZigzagLayout``) balances *causal* work: ring rank ``r`` of ``R`` owns chunks
``r`` and ``2R-1-r`` of the whole sequence. Under document masking the work is the visible pairs
inside each document, and a fixed cut leaves the busiest ring rank 1.4-3.0x the mean
(``docs/benchmarks/document_balance.md``). This layout is computed per sequence from its document
lengths by ``parallel.document_deal`` (the deal and its exact work count live there):

* every document of at least ``min_split`` tokens is cut into ``2R`` near-equal pieces dealt
  zigzag: rank ``r`` gets pieces ``r`` and ``2R-1-r`` of *that* document (its causal work split
  evenly, as the zigzag splits one long sequence);
* the shorter documents, heaviest first, go whole to the ring rank with the least work that still
  has room for them (ties: the lowest rank); what fits nowhere whole fills the remaining room of
  each rank in sequence order (split at a rank boundary where needed);
* where that leaves the busiest rank more than 2 % above the mean, the shorter documents whose work
  is too big for one rank are split too (over all ranks, or over a few where all would cut pieces
  under a kernel tile), the fewest that bring it within 2 % (``document_deal.balanced_deal``);
* a row (and a batch) keeps the fixed zigzag's runs where the deal is not better by the exact count
  (``document_deal.row_deal``, ``batch_deals``): never worse than the zigzag.

Every ring rank ends with exactly ``S/R`` tokens. A ring rank's *ring-local sequence* is its token
runs in global order (causal order is kept inside the rank); its ``U`` Ulysses ranks hold
contiguous ``S/(RU)``-token pieces of it, as in ``ZigzagLayout``. One document of ``S`` tokens
gives ``ZigzagLayout``'s chunks exactly.

::

    S = 16, R = 2, min_split = 8; documents A = [0, 10), b = [10, 12), c = [12, 16);
    T = 55 + 3 + 10 = 68 visible pairs, 34 per ring rank when balanced

    tokens     0 1 2 | 3 4 5 | 6 7 | 8 9 | 10 | 11 | 12 | 13 14 | 15
    A's pieces   p0  |   p1  |  p2 |  p3 |    |    |    |       |
    ring rank    0   |   1   |  1  |  0  |  0 |  1 |  0 |  1  1 |  0
                     A cut in 2R = 4 pieces dealt 0, 1, 1, 0 (10 = 4 x 2 + 2: the two tokens
                     left over go to ranks 0 and 1 in turn; 5 tokens each, 3 of room left);
                     with b and c whole (issue 35's deal) the ranks do 29 and 39 pairs, 1.15x
                     the mean, so the cap T / (8R) = 4.25 pairs per share splits c (10 pairs)
                     over both ranks, pieces dealt 0, 1, 1, 0; b (3 pairs, under the cap) fits
                     nowhere whole and fills rank 0's last token, then rank 1's
    runs       rank 0: [0, 3) [8, 11) [12, 13) [15, 16)      rank 1: [3, 8) [11, 12) [13, 15)
    work       rank 0: 31 pairs, rank 1: 37 (1.09x the mean); the fixed zigzag's 20 and 48 (1.41x)
               are busier, so this layout is kept

Deterministic: a pure function of the document lengths (stable sorts, ties to the lowest rank,
integer arithmetic for the cuts, the room and the work). Every rank derives the same layout from the
same batch (the global document ids every rank already holds for the mask), so no collective is
needed to agree on it; ``positions`` of a rank are sent as ``(start, stop)`` runs
(``position_runs``), a few per document, not per token.

A batch of ``B`` rows gets one layout per row (``BatchDocumentLayout``): a rank's tokens, labels and
positions are ``[B, S/C]`` with each row in its own layout, which the ring's plan reads as per-row
runs (``attention.ring_plan.document_step_calls``). A row on the fixed zigzag is such a layout too
(its runs the zigzag's two chunks per rank), so the ring and ``shard_sequence`` have one code path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from titan_upipe.errors import ConfigError
from titan_upipe.parallel.layout import RingUlyssesRanks, shard_at_positions, unshard_from_positions
from titan_upipe.spec.document_deal import Runs, batch_deals, row_deal, split_threshold
from titan_upipe.spec.settings import DEFAULT_MIN_SPLIT


def document_zigzag_runs(lengths: Sequence[int], ring_size: int, min_split: int) -> tuple[Runs, ...]:
    """Each ring rank's token runs (module docstring), ``[R]`` tuples of ``(start, stop)`` in global
    order, adjacent runs merged. ``lengths``: the documents packed back to back from token 0. The
    deal is ``parallel.document_deal.row_deal`` (``doczz-b`` in docs/benchmarks/document_balance.md)."""
    return row_deal(lengths, ring_size, min_split).runs


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
                     min_split: int = DEFAULT_MIN_SPLIT) -> DocumentZigzagLayout:
        """The layout of one sequence of documents ``lengths`` (module docstring); ``min_split`` is the
        split length as given (a job's layout caps it: ``BatchDocumentLayout.of_document_ids``)."""
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
    def _positions(self) -> dict[int, torch.Tensor]:
        """Positions by rank, each built at its first use (a rank needs its own, ``unshard`` all)."""
        return {}

    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of ``rank``'s tokens, ``[S/(RU)]`` int64, ascending."""
        self._check_rank(rank)
        if rank not in self._positions:
            runs = torch.tensor(self.position_runs(rank), dtype=torch.int64).reshape(-1, 2)
            lengths = runs[:, 1] - runs[:, 0]
            # token k of run i is at runs[i, 0] + (k - first local index of run i)
            shift = runs[:, 0] - (torch.cumsum(lengths, 0) - lengths)
            self._positions[rank] = torch.arange(self.local_len) + torch.repeat_interleave(shift, lengths)
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


@dataclass(frozen=True)
class BatchDocumentLayout(RingUlyssesRanks):
    """A ``[B, S]`` batch over ``ring x ulysses`` ranks, row ``b`` in its own ``rows[b]`` layout: a
    rank's shard of a ``[B, S, ...]`` tensor is ``[B, S/C, ...]`` and its positions ``[B, S/C]``
    (the sizes, ``world_size`` and ``local_len`` those of every row)."""

    rows: tuple[DocumentZigzagLayout, ...]

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("a batch layout needs at least one row")
        shapes = {(r.seq_len, r.ring_size, r.ulysses_size) for r in self.rows}
        if len(shapes) != 1:
            raise ValueError(f"the rows' layouts differ in (seq_len, ring, ulysses): {sorted(shapes)}")

    @classmethod
    def of_document_ids(cls, doc_ids: torch.Tensor, ring_size: int, ulysses_size: int = 1,
                        min_split: int = DEFAULT_MIN_SPLIT) -> BatchDocumentLayout:
        """From the batch's ``[B, S]`` document ids (equal id = one document, one contiguous run); the
        documents of ``parallel.document_deal.split_threshold(S, R, min_split)`` tokens or more (the
        configured ``min_split``, or ``S/(4R)`` but at least ``2R x 128`` when shorter) are zigzagged inside
        themselves; the batch keeps the fixed zigzag where that is not busier
        (``parallel.document_deal.batch_deals``)."""
        ids = doc_ids.cpu()
        threshold = split_threshold(ids.shape[1], ring_size, min_split)
        deals = batch_deals([document_lengths(row) for row in ids], ring_size, threshold)
        return cls(tuple(DocumentZigzagLayout(ids.shape[1], ring_size, ulysses_size, d.runs) for d in deals))

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def seq_len(self) -> int:
        return self.rows[0].seq_len

    @property
    def ring_size(self) -> int:
        return self.rows[0].ring_size

    @property
    def ulysses_size(self) -> int:
        return self.rows[0].ulysses_size

    def ring_runs(self) -> tuple[tuple[Runs, ...], ...]:
        """``[B][R]``: each row's runs per ring rank (what the ring's plan reads)."""
        return tuple(row.ring_runs for row in self.rows)

    def check_degrees(self, ring_size: int, ulysses_size: int) -> None:
        """ConfigError unless this layout is for ``ring x ulysses`` ranks (the attention's mesh)."""
        if (self.ring_size, self.ulysses_size) != (ring_size, ulysses_size):
            raise ConfigError(
                f"the batch's document layout is for ring {self.ring_size} x ulysses {self.ulysses_size} ranks but "
                f"the attention runs on ring {ring_size} x ulysses {ulysses_size}: build the mask with the model's "
                "cp_mesh (titan_upipe.attention.document_mask(ids, cp_mesh, balance=\"documents\"))")

    @cached_property
    def _positions(self) -> dict[tuple[int, str], torch.Tensor]:
        """``[B, S/C]`` positions by (rank, device): stacked and copied to a device once per batch,
        not at every layer that asks (the attention without explicit positions, the layout check)."""
        return {}

    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``[B, S/C]`` int64: each row's global positions of ``rank``'s tokens, ascending."""
        key = (rank, str(torch.device(device) if device is not None else torch.device("cpu")))
        if key not in self._positions:
            self._positions[key] = torch.stack([row.positions(rank) for row in self.rows]).to(device)
        return self._positions[key]

    def _check_batch(self, t: torch.Tensor) -> None:
        if t.dim() < 2 or t.shape[0] != self.batch:
            raise ConfigError(f"a batch layout of {self.batch} rows shards [batch, seq, ...] tensors; got "
                              f"shape {tuple(t.shape)}")

    def shard(self, t: torch.Tensor, rank: int, seq_dim: int) -> torch.Tensor:
        """``rank``'s tokens of ``t`` ``[B, ..., S (at seq_dim), ...]``, each row in its own layout."""
        self._check_batch(t)
        if seq_dim < 1:
            raise ValueError(f"seq_dim {seq_dim}: dim 0 is the batch")
        return torch.stack([row.shard(t[b], rank, seq_dim - 1) for b, row in enumerate(self.rows)])

    def unshard(self, shards: Sequence[torch.Tensor], seq_dim: int) -> torch.Tensor:
        """The full ``[B, ..., S, ...]`` tensor from every rank's shard, given in CP rank order."""
        self._check_batch(shards[0])
        return torch.stack([row.unshard([s[b] for s in shards], seq_dim - 1) for b, row in enumerate(self.rows)])
