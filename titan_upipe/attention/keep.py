"""Kept attention: what a checkpointed block's attention keeps from its forward so that the
recomputation in its backward does not run the attention kernel's forward again.

Under full activation checkpointing a block's backward first re-runs the block's forward. At long
contexts the attention kernel's forward is most of that rerun (Llama3-8B at 1M tokens on 8 ranks,
FlashAttention-4 on an H200: ~1.7 s of a block's ~8 s). Keeping its results instead costs, per
block and rank,

    kept bytes = T x H x (D x a + 4)

with ``T`` this rank's tokens (batch x S / CP), ``H`` the query heads, ``D`` the head dim and ``a``
the bytes of an activation: the attention output before ``wo`` (``T x H x D`` values in the
compute dtype, in whichever layout the mode holds it: sequence-sharded for UPipe, head-sharded over
the full sequence for Ulysses/ring/USP, per owner and KV bucket for TSP -- the same count) and the
fp32 log-sum-exp of every query head and token (1.016 GiB at Llama3-8B 1M / 8).

Record, then replay. The block's forward (no autograd) runs the attention as always and records
the results of its kernel calls in call order (:meth:`KeptAttention.record`); the checkpoint
wrapper then seals the record; the recomputation calls the attention again, which takes the
recorded tensors back in the same order (:meth:`KeptAttention.replay`) instead of calling the
kernel, and skips whatever communication only fed the kernel (UPipe: the whole stage loop; TSP:
the K/V all-gathers; ring: the ring's passes). The replayed tensors *are* the recorded ones, so
the recomputed forward, the loss and every gradient are bit for bit those of full recomputation.
Every rank of the job must keep the same blocks (the skipped communication must be skipped by all).

Where the results wait: on the device (:class:`OnDevice`), or in host memory through a holder the
checkpoint wrapper supplies (``transforms.offload``: pinned copies on the offload side stream,
fetched back ahead of the block's backward together with its input).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

Tensor = torch.Tensor


class Holder(Protocol):
    """One kept tensor between the forward and the recomputation."""

    def prefetch(self) -> None:
        """Start bringing the tensor back to the compute device (a no-op where it is there)."""

    def fetch(self) -> Tensor:
        """The tensor on the compute device; the holder lets go of it."""


class OnDevice:
    """A kept tensor that stays where it is."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor: Tensor | None = tensor

    def prefetch(self) -> None:
        pass

    def fetch(self) -> Tensor:
        tensor, self.tensor = self.tensor, None
        if tensor is None:
            raise RuntimeError("kept attention fetched twice")
        return tensor


class KeptAttention:
    """The kernel results of one block's attention, from its forward to its recomputation.

    ``hold`` wraps each recorded tensor (default: :class:`OnDevice`). A record is a tuple of
    tensors (a mode's ``(out, lse)``, UPipe's output buffer and per-stage LSEs, ...); records are
    replayed first in, first out.
    """

    def __init__(self, hold: Callable[[Tensor], Holder] = OnDevice) -> None:
        self._hold = hold
        self._records: deque[tuple[Holder, ...]] = deque()
        self.replaying = False

    def record(self, *tensors: Tensor) -> None:
        if self.replaying:
            raise RuntimeError("kept attention recorded after it was sealed (a second forward of one block call)")
        self._records.append(tuple(self._hold(t) for t in tensors))

    def seal(self) -> None:
        """The forward is over: the next calls replay."""
        self.replaying = True

    def prefetch(self) -> None:
        """Start bringing every record back to the device (ahead of the block's backward)."""
        for record in self._records:
            for held in record:
                held.prefetch()

    def replay(self) -> tuple[Tensor, ...]:
        """The oldest record's tensors, in the order recorded."""
        if not self.replaying or not self._records:
            raise RuntimeError("kept attention replayed before its forward recorded it, or more often than it "
                               "was recorded (backward through the graph twice needs retain_graph, which "
                               "checkpointing with kept attention does not support)")
        return tuple(held.fetch() for held in self._records.popleft())

    def __len__(self) -> int:
        return len(self._records)


def replaying(kept: KeptAttention | None) -> bool:
    """Whether an attention call is the recomputation of a block that kept its results."""
    return kept is not None and kept.replaying


def recording(kept: KeptAttention | None) -> bool:
    """Whether an attention call is a block forward that keeps its results."""
    return kept is not None and not kept.replaying
