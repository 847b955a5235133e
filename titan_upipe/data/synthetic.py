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

``synthetic_docs`` (packed documents, for ``attn_mask_type = "block_causal"``): each sample is
documents of mixed lengths packed back to back, each ending with EOS (TorchTitan's document
rule), the last one cut at ``seq_len + 1``::

    <bos> a_1 … a_m <sep> a_1 … <eos> <eos> <bos> b_1 … b_k <sep> b_1 … <eos> <bos> c_1 …

A document is a copy task of its own (``<bos>``, its own word runs repeated with ``<sep>``,
``<eos>``), or a lone ``<eos>`` (a 1-token document); lengths mix 1 token, short (2 to
``seq_len / 32``) and long (``seq_len / 8`` to ``seq_len / 2``, across shard boundaries).
A document's tokens depend on nothing outside it, so attention that leaks across documents
only adds noise: the loss depends on the masking.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from titan_upipe.data import tokenizer as vocab

COPY_DATASET = "synthetic_copy"
DOCS_DATASET = "synthetic_docs"
SYNTHETIC_DATASETS = (COPY_DATASET, DOCS_DATASET)
"""The datasets of the embedded tokenizer (no files)."""
_ZIPF_EXPONENT = 1.1
_RUN_CONTINUE_PROB = 0.5
_DEFAULT_SEED = 1234
VALIDATION_SEED = 4321
"""The seed of a synthetic ``validation.dataset``: samples the training stream never draws."""


def _zipf_probabilities(n: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** _ZIPF_EXPONENT
    return weights / weights.sum()


_WORD_PROBS = _zipf_probabilities(vocab.NUM_WORDS)


def _copy_body(rng: np.random.Generator, n: int, length: int) -> np.ndarray:
    """``length`` tokens: a segment of ``n`` word ids and SEP, repeated (cut at ``length``)."""
    # Runs of consecutive words: position i continues the previous run with
    # probability 1/2, otherwise starts a new run at a Zipf-distributed word.
    starts = rng.choice(vocab.NUM_WORDS, size=n, p=_WORD_PROBS)
    new_run = rng.random(n) >= _RUN_CONTINUE_PROB
    new_run[0] = True
    run_start = np.maximum.accumulate(np.where(new_run, np.arange(n), 0))
    segment = (starts[run_start] + (np.arange(n) - run_start)) % vocab.NUM_WORDS
    period = np.append(segment + vocab.WORD_OFFSET, vocab.SEP_ID)
    return np.resize(period, length)  # np.resize repeats the period


def copy_sample(index: int, seq_len: int, seed: int = _DEFAULT_SEED) -> np.ndarray:
    """Token ids (``seq_len + 1`` of them, int64) of sample ``index``."""
    rng = np.random.default_rng([seed, index])
    length = seq_len + 1
    lo, hi = max(4, seq_len // 16), max(8, seq_len // 4)
    n = int(rng.integers(lo, hi + 1))
    body = _copy_body(rng, n, length - 1)
    return np.concatenate(([vocab.BOS_ID], body)).astype(np.int64)


_DOC_KIND_PROBS = (0.2, 0.3, 0.5)
"""How often a ``synthetic_docs`` document is a lone EOS, short, or long."""


def _document_length(rng: np.random.Generator, seq_len: int) -> int:
    kind = rng.choice(3, p=_DOC_KIND_PROBS)
    if kind == 0:
        return 1
    if kind == 1:
        return int(rng.integers(2, max(3, seq_len // 32) + 1))
    return int(rng.integers(max(4, seq_len // 8), max(5, seq_len // 2) + 1))


def _document(rng: np.random.Generator, length: int) -> np.ndarray:
    """A document of ``length`` tokens: ``<eos>`` alone, or ``<bos>``, a copy body, ``<eos>``."""
    if length == 1:
        return np.array([vocab.EOS_ID])
    body_len = length - 2
    n = int(rng.integers(1, max(1, body_len // 3) + 1))  # at least ~2 periods when the body allows
    return np.concatenate(([vocab.BOS_ID], _copy_body(rng, n, body_len), [vocab.EOS_ID]))


def docs_sample(index: int, seq_len: int, seed: int = _DEFAULT_SEED) -> np.ndarray:
    """Token ids (``seq_len + 1`` of them, int64) of packed-documents sample ``index``."""
    rng = np.random.default_rng([seed, index])
    length, pieces, filled = seq_len + 1, [], 0
    while filled < length:
        doc = _document(rng, _document_length(rng, seq_len))
        pieces.append(doc[: length - filled])
        filled += len(pieces[-1])
    return np.concatenate(pieces).astype(np.int64)


SAMPLES = {COPY_DATASET: copy_sample, DOCS_DATASET: docs_sample}
"""Each synthetic dataset's ``sample(index, seq_len, seed)``."""


def copy_text(index: int, seq_len: int = 2048) -> str:
    """Sample ``index`` as text, for TorchTitan's text pipeline (which adds BOS itself)."""
    ids = copy_sample(index, seq_len)[1:]
    words = [vocab.SEP_TOKEN if i == vocab.SEP_ID else vocab.word(i - vocab.WORD_OFFSET) for i in ids]
    return " ".join(words)


class SyntheticCopyStream:
    """The samples ``sample(0), sample(1), …`` (``copy_sample`` or ``docs_sample``) as a
    :class:`~titan_upipe.torchtitan_0_2.data_loader.SampleStream`: its state is the next index."""

    def __init__(self, seq_len: int, seed: int = _DEFAULT_SEED, sample=copy_sample) -> None:
        self.seq_len = seq_len
        self.seed = seed
        self.sample = sample
        self.index = 0

    def next_sample(self) -> np.ndarray:
        sample = self.sample(self.index, self.seq_len, self.seed)
        self.index += 1
        return sample

    def skip_samples(self, count: int) -> None:
        self.index += count

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.index = int(state_dict["index"])
