"""Deterministic synthetic long-context data: no download, a loss that visibly falls.

Each sample is addressed by a global index and built from it alone, so the
global batch of a step is the same set of samples for any number of
data-parallel ranks: a 2-rank run sees exactly the tokens of a 1-rank run with
twice the local batch, which is what makes loss-parity tests exact.

``synthetic_copy`` (a copy task, long-range by construction)::

    <bos> s_1 … s_n <sep> s_1 … s_n <sep> s_1 … (truncated to seq_len + 1)

The segment ``s`` is drawn per sample: runs of consecutive words (``w_k``,
``w_{k+1}``, …, learnable as bigrams within a few steps) that start at
Zipf-distributed words (learnable as unigrams). Its repeats are only
predictable by attending back ``n + 1`` tokens, so the later loss drop needs
attention across the whole context, across context-parallel shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from titan_upipe.data import tokenizer as vocab

SYNTHETIC_DATASETS = ("synthetic_copy",)
_ZIPF_EXPONENT = 1.1
_RUN_CONTINUE_PROB = 0.5
_DEFAULT_SEED = 1234


def _zipf_probabilities(n: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** _ZIPF_EXPONENT
    return weights / weights.sum()


_WORD_PROBS = _zipf_probabilities(vocab.NUM_WORDS)


def copy_sample(index: int, seq_len: int, seed: int = _DEFAULT_SEED) -> np.ndarray:
    """Token ids (``seq_len + 1`` of them, int64) of sample ``index``."""
    rng = np.random.default_rng([seed, index])
    length = seq_len + 1
    lo, hi = max(4, seq_len // 16), max(8, seq_len // 4)
    n = int(rng.integers(lo, hi + 1))
    # Runs of consecutive words: position i continues the previous run with
    # probability 1/2, otherwise starts a new run at a Zipf-distributed word.
    starts = rng.choice(vocab.NUM_WORDS, size=n, p=_WORD_PROBS)
    new_run = rng.random(n) >= _RUN_CONTINUE_PROB
    new_run[0] = True
    run_start = np.maximum.accumulate(np.where(new_run, np.arange(n), 0))
    segment = (starts[run_start] + (np.arange(n) - run_start)) % vocab.NUM_WORDS
    period = np.append(segment + vocab.WORD_OFFSET, vocab.SEP_ID)
    body = np.resize(period, length - 1)  # np.resize repeats the period
    return np.concatenate(([vocab.BOS_ID], body)).astype(np.int64)


def copy_text(index: int, seq_len: int = 2048) -> str:
    """Sample ``index`` as text, for TorchTitan's text pipeline (which adds BOS itself)."""
    ids = copy_sample(index, seq_len)[1:]
    words = [vocab.SEP_TOKEN if i == vocab.SEP_ID else vocab.word(i - vocab.WORD_OFFSET) for i in ids]
    return " ".join(words)


class SyntheticCopyDataset(IterableDataset, Stateful):
    """This data-parallel rank's stream of ``(input, label)`` samples.

    Rank ``r`` of ``W`` with local batch ``B`` takes global indices
    ``(b * W + r) * B + j`` for blocks ``b = 0, 1, …`` and ``j < B``: step ``b``'s
    global batch is indices ``[b*W*B, (b+1)*W*B)`` whatever ``W`` is.
    """

    def __init__(self, seq_len: int, local_batch_size: int, dp_rank: int, dp_world_size: int,
                 seed: int = _DEFAULT_SEED) -> None:
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.seed = seed
        self._position = 0  # samples this rank has produced

    def global_index(self, position: int) -> int:
        block, offset = divmod(position, self.local_batch_size)
        return (block * self.dp_world_size + self.dp_rank) * self.local_batch_size + offset

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            tokens = torch.from_numpy(copy_sample(self.global_index(self._position), self.seq_len, self.seed))
            self._position += 1
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self._position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._position = int(state_dict["position"])


def _load_copy_documents(path: str):
    """Loader for TorchTitan's ``DATASETS`` registry: a lazy stream of text documents."""
    del path
    from datasets import IterableDataset as HFIterableDataset

    def documents():
        index = 0
        while True:
            yield {"text": copy_text(index)}
            index += 1

    return HFIterableDataset.from_generator(documents)


def register_with_torchtitan() -> None:
    """Make ``training.dataset = "synthetic_copy"`` valid for any TorchTitan train spec."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS.setdefault(
        "synthetic_copy",
        DatasetConfig(path="synthetic_copy", loader=_load_copy_documents, sample_processor=lambda s: s["text"]),
    )


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, infinite: bool = True):
    """Train-spec dataloader: index-addressed synthetic data, or TorchTitan's text pipeline."""
    from dataclasses import asdict

    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.hf_datasets.text_datasets import build_text_dataloader

    training = job_config.training
    if training.dataset not in SYNTHETIC_DATASETS:
        return build_text_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite)
    dataset = SyntheticCopyDataset(training.seq_len, training.local_batch_size, dp_rank, dp_world_size)
    kwargs = {**asdict(training.dataloader), "batch_size": training.local_batch_size}
    return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, **kwargs)


def build_tokenizer(job_config):
    """The synthetic datasets bring their own vocabulary; real data uses ``model.hf_assets_path``."""
    from torchtitan.components.tokenizer import build_hf_tokenizer

    if job_config.training.dataset in SYNTHETIC_DATASETS:
        return vocab.build_embedded_tokenizer()
    return build_hf_tokenizer(job_config)
