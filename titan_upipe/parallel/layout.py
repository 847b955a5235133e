"""Where each token of a context-parallel sequence lives: pure token <-> (rank, index) maps.

Only the contiguous layout exists for now (rank ``r`` holds tokens ``[r*S/C, (r+1)*S/C)``),
which is what Ulysses and UPipe need: after their all-to-all the received chunks, in rank
order, are the sequence in order, so causal masking needs no permutation. A zigzag
(ring x ulysses) layout will be another ``SequenceLayout``: the attention then permutes
the gathered sequence with ``global_index``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from titan_upipe.config import ConfigError


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
        if self.seq_len <= 0 or self.seq_len % self.world_size:
            raise ConfigError(
                f"sequence length {self.seq_len} is not divisible by the context-parallel degree "
                f"{self.world_size}: use a multiple of {self.world_size}"
            )

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
