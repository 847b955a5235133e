"""One global stream of samples, split by data-parallel rank; its checkpoint is layout-free.

Each adapter makes it its TorchTitan's data loader (``GlobalBatchLoader``: 0.2's ``BaseDataLoader``;
0.3's dataloader configurable).

With ``W`` data-parallel ranks of ``B`` sequences each (global batch ``G = W B``), step ``b``
after a resume at stream sample ``S`` trains on samples ``[S + b G, S + (b + 1) G)``; rank
``r`` takes ``[S + b G + r B, S + b G + (r + 1) B)``::

    stream   | s0 s1 | s2 s3 | s4 s5 | s6 s7 | …        W = 2, B = 1
    step 1     r0 r1                                  (both ranks read s0 and s1,
    step 2             r0 r1                           each keeps its own)

Every rank reads the whole global block (for a packed corpus that means tokenizing it), so
every rank knows the cursor of the next block. The checkpoint holds only that cursor and the
number of samples trained on, under the same keys on every rank, and no rank index: a job
resumed with another data-parallel degree, another CP degree or another CP layout continues at
the next unseen sample, none repeated or skipped. With the same global batch, step ``b``
trains on the same samples as the uninterrupted run. (TorchTitan's own loader stores one
state per rank, ``dataloader.dp_rank_<r>``, and refuses a new degree.)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch

logger = logging.getLogger()
"""The root logger: where TorchTitan's own ``logger`` writes, so the lines keep its format."""


class SampleStream(Protocol):
    """Samples of ``seq_len + 1`` tokens, in a deterministic order, with a resumable position."""

    def next_sample(self) -> np.ndarray: ...

    def skip_samples(self, count: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class GlobalBatches:
    """This data-parallel rank's ``({"input": [B, S]}, labels [B, S])`` batches from ``stream``."""

    def __init__(self, stream: SampleStream, local_batch_size: int, dp_rank: int, dp_world_size: int) -> None:
        self.stream = stream
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.samples_consumed = 0

    @property
    def global_batch_size(self) -> int:
        return self.local_batch_size * self.dp_world_size

    def next_block(self) -> torch.Tensor:
        """This rank's ``B`` samples of the next global block, ``[B, seq_len + 1]``."""
        before = self.dp_rank * self.local_batch_size
        self.stream.skip_samples(before)
        mine = [self.stream.next_sample() for _ in range(self.local_batch_size)]
        self.stream.skip_samples(self.global_batch_size - before - self.local_batch_size)
        self.samples_consumed += self.global_batch_size
        return torch.from_numpy(np.stack(mine))

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            # The counters move before the yield: a checkpoint taken while this generator is
            # suspended records the batch just handed out as consumed.
            tokens = self.next_block()
            yield {"input": tokens[:, :-1]}, tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"samples_consumed": self.samples_consumed, "global_batch_size": self.global_batch_size,
                "stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.stream.load_state_dict(state["stream"])
        self.samples_consumed = int(state["samples_consumed"])
        saved_batch = int(state["global_batch_size"])
        if saved_batch != self.global_batch_size:
            logger.warning(f"data: the global batch changed from {saved_batch} to {self.global_batch_size} sequences "
                           f"(data parallel {self.dp_world_size} x local batch {self.local_batch_size}); the data "
                           f"continues at sample {self.samples_consumed}, but steps now cover other samples")
        logger.info(f"data: resumed after {self.samples_consumed} samples; this rank takes {self.local_batch_size} "
                    f"of every {self.global_batch_size}")

    def take_document_stats(self) -> dict[str, float]:
        """Document-length statistics since the last call (packed corpora only)."""
        stats = getattr(self.stream, "stats", None)
        return stats.take() if stats is not None else {}
