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

from typing import Any

import numpy as np

from titan_upipe.data import tokenizer as vocab

SYNTHETIC_DATASETS = ("synthetic_copy",)
_ZIPF_EXPONENT = 1.1
_RUN_CONTINUE_PROB = 0.5
_DEFAULT_SEED = 1234
VALIDATION_SEED = 4321
"""The seed of ``validation.dataset = "synthetic_copy"``: samples the training stream never draws."""


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


class SyntheticCopyStream:
    """The samples ``copy_sample(0), copy_sample(1), …`` as a
    :class:`~titan_upipe.data.loader.SampleStream`: its state is the next index."""

    def __init__(self, seq_len: int, seed: int = _DEFAULT_SEED) -> None:
        self.seq_len = seq_len
        self.seed = seed
        self.index = 0

    def next_sample(self) -> np.ndarray:
        sample = copy_sample(self.index, self.seq_len, self.seed)
        self.index += 1
        return sample

    def skip_samples(self, count: int) -> None:
        self.index += count

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.index = int(state_dict["index"])


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
