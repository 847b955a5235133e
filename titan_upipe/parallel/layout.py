"""Where each token of a context-parallel sequence lives: pure token <-> (rank, index) maps.

* ``ContiguousLayout`` (Ulysses/UPipe on a 1-D mesh): rank ``r`` holds tokens
  ``[r*S/C, (r+1)*S/C)``; after the all-to-all the received chunks, in rank order, are the
  sequence in order, so causal masking needs no permutation.
* ``ZigzagLayout`` (ring, USP, UPipe inside USP; ``R`` ring x ``U`` Ulysses ranks, CP rank
  ``c = ring_rank * U + ulysses_rank``, Ulysses innermost): the sequence is cut into ``2R``
  chunks of ``S/(2R)`` tokens; ring rank ``r`` owns chunks ``r`` and ``2R-1-r`` (zigzag: every
  ring rank gets the same causal work), and its "ring-local sequence" is those two chunks
  concatenated. The ``U`` Ulysses ranks of ring rank ``r`` hold contiguous ``S/(R*U)``-token
  pieces of that ring-local sequence, so the Ulysses all-to-all (chunks joined in Ulysses
  rank order) hands every rank exactly the ring-local sequence the ring step expects.
  With ``R = 1`` it is the contiguous layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from titan_upipe.errors import ConfigError
from titan_upipe.spec.cp_layout import check_sequence_length
from titan_upipe.spec.document_deal import zigzag_chunks


class SequenceLayout(Protocol):
    seq_len: int
    world_size: int

    @property
    def local_len(self) -> int: ...

    def global_index(self, rank: int, local_index: int) -> int: ...

    def owner(self, token: int) -> tuple[int, int]: ...

    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor: ...

    def shard(self, t: torch.Tensor, rank: int, seq_dim: int) -> torch.Tensor: ...

    def unshard(self, shards: Sequence[torch.Tensor], seq_dim: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class ContiguousLayout:
    seq_len: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"context-parallel degree must be >= 1, got {self.world_size}")
        check_sequence_length(self.seq_len, 1, self.world_size)

    @property
    def local_len(self) -> int:
        return self.seq_len // self.world_size

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")

    def global_index(self, rank: int, local_index: int) -> int:
        self._check_rank(rank)
        if not 0 <= local_index < self.local_len:
            raise ValueError(f"local index {local_index} outside [0, {self.local_len})")
        return rank * self.local_len + local_index

    def owner(self, token: int) -> tuple[int, int]:
        """(rank, local index) of global token ``token``."""
        if not 0 <= token < self.seq_len:
            raise ValueError(f"token {token} outside [0, {self.seq_len})")
        return divmod(token, self.local_len)

    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of ``rank``'s tokens, ``[S/C]`` int64."""
        self._check_rank(rank)
        return torch.arange(rank * self.local_len, (rank + 1) * self.local_len, device=device)

    def shard(self, t: torch.Tensor, rank: int, seq_dim: int) -> torch.Tensor:
        self._check_rank(rank)
        if t.shape[seq_dim] != self.seq_len:
            raise ConfigError(f"dim {seq_dim} has {t.shape[seq_dim]} tokens, the layout {self.seq_len}")
        return t.narrow(seq_dim, rank * self.local_len, self.local_len)

    def unshard(self, shards: Sequence[torch.Tensor], seq_dim: int) -> torch.Tensor:
        """The full sequence from every rank's shard, given in rank order."""
        if len(shards) != self.world_size:
            raise ValueError(f"{len(shards)} shards for {self.world_size} ranks")
        return torch.cat(list(shards), dim=seq_dim)


class RingUlyssesRanks:
    """The sizes a layout over ``ring_size`` ring x ``ulysses_size`` Ulysses ranks shares (CP rank
    ``ring_rank * U + ulysses_rank``); the dataclass using it declares the three fields."""

    seq_len: int
    ring_size: int
    ulysses_size: int

    def _check_degrees(self) -> None:
        if self.ring_size < 1 or self.ulysses_size < 1:
            raise ConfigError(f"ring and ulysses degrees must be >= 1, got {self.ring_size} x {self.ulysses_size}")
        check_sequence_length(self.seq_len, self.ring_size, self.ulysses_size)

    @property
    def world_size(self) -> int:
        return self.ring_size * self.ulysses_size

    @property
    def local_len(self) -> int:
        return self.seq_len // self.world_size

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")


@dataclass(frozen=True)
class ZigzagLayout(RingUlyssesRanks):
    """Zigzag over ``ring_size`` ring ranks, contiguous over ``ulysses_size`` ranks within each."""

    seq_len: int
    ring_size: int
    ulysses_size: int = 1

    def __post_init__(self) -> None:
        self._check_degrees()

    @property
    def chunk_len(self) -> int:
        """Tokens per zigzag chunk, ``S / (2R)``."""
        return self.seq_len // (2 * self.ring_size)

    def ring_chunks(self, ring_rank: int) -> tuple[int, int]:
        """The two zigzag chunks ring rank ``ring_rank`` owns, in ring-local order."""
        return zigzag_chunks(ring_rank, self.ring_size)

    def _ring_local_to_global(self, ring_rank: int, index: torch.Tensor | int):
        first, second = self.ring_chunks(ring_rank)
        k = self.chunk_len
        if isinstance(index, int):
            return first * k + index if index < k else second * k + index - k
        return torch.where(index < k, first * k + index, second * k + index - k)

    def global_index(self, rank: int, local_index: int) -> int:
        self._check_rank(rank)
        if not 0 <= local_index < self.local_len:
            raise ValueError(f"local index {local_index} outside [0, {self.local_len})")
        ring_rank, ulysses_rank = divmod(rank, self.ulysses_size)
        return self._ring_local_to_global(ring_rank, ulysses_rank * self.local_len + local_index)

    def owner(self, token: int) -> tuple[int, int]:
        """(CP rank, local index) of global token ``token``: the inverse of ``global_index``."""
        if not 0 <= token < self.seq_len:
            raise ValueError(f"token {token} outside [0, {self.seq_len})")
        chunk, offset = divmod(token, self.chunk_len)
        if chunk < self.ring_size:
            ring_rank, ring_local = chunk, offset
        else:
            ring_rank, ring_local = 2 * self.ring_size - 1 - chunk, self.chunk_len + offset
        ulysses_rank, local_index = divmod(ring_local, self.local_len)
        return ring_rank * self.ulysses_size + ulysses_rank, local_index

    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of ``rank``'s tokens, ``[S/(R*U)]`` int64 (at most two runs)."""
        self._check_rank(rank)
        ring_rank, ulysses_rank = divmod(rank, self.ulysses_size)
        ring_local = torch.arange(ulysses_rank * self.local_len, (ulysses_rank + 1) * self.local_len, device=device)
        return self._ring_local_to_global(ring_rank, ring_local)

    def shard(self, t: torch.Tensor, rank: int, seq_dim: int) -> torch.Tensor:
        return shard_at_positions(self, t, rank, seq_dim)

    def unshard(self, shards: Sequence[torch.Tensor], seq_dim: int) -> torch.Tensor:
        """The full sequence from every rank's shard, given in CP rank order."""
        return unshard_from_positions(self, shards, seq_dim)


def shard_at_positions(layout: SequenceLayout, t: torch.Tensor, rank: int, seq_dim: int) -> torch.Tensor:
    """``rank``'s tokens of ``t`` (``seq_len`` along ``seq_dim``): those at ``layout.positions(rank)``."""
    if t.shape[seq_dim] != layout.seq_len:
        raise ConfigError(f"dim {seq_dim} has {t.shape[seq_dim]} tokens, the layout {layout.seq_len}")
    return t.index_select(seq_dim, layout.positions(rank, device=t.device))


def unshard_from_positions(layout: SequenceLayout, shards: Sequence[torch.Tensor], seq_dim: int) -> torch.Tensor:
    """The full sequence from every rank's shard, in CP rank order: the inverse of the positions' permutation."""
    if len(shards) != layout.world_size:
        raise ValueError(f"{len(shards)} shards for {layout.world_size} ranks")
    in_layout_order = torch.cat(list(shards), dim=seq_dim)
    order = torch.cat([layout.positions(r, device=in_layout_order.device) for r in range(layout.world_size)])
    return in_layout_order.index_select(seq_dim, torch.argsort(order))
