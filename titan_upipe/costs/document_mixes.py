"""Document-length mixes of packed training batches: pure numpy, seeded.

A batch row is a window of ``S`` tokens of a document stream, starting at a random offset inside
its first document, the last one cut, as a packer does. The mixes
(``docs/benchmarks/document_balance.md``, the GPU queue's ring-with-documents item):

* ``mixed-p``: short documents lognormal, median 2048 tokens, sigma 0.9, clipped to [32, 32K];
  with probability ``p`` a document is instead long, log-uniform in [100K, 1M];
* ``all-short``: ``p = 0``;
* ``long-start`` / ``long-end``: one document of ``S/2`` at the start / end, short ones fill;
* ``causal``: one document of ``S`` tokens.

Adversarial for the document-aware layout's split length ``N`` (issue 42):

* ``near-N``: ``all-short`` with a quarter of the documents instead just under ``N`` tokens
  (``N - 1`` down to ``N - N/16``);
* ``one-near-N``: one document of ``N - 1`` tokens among shorter ones (a quarter of ``all-short``'s
  lengths, at least 8 tokens), at a random place;
* ``pareto-a``: heavy tails, ``64 (1 + X)`` tokens with ``X`` Pareto of index ``a``, at most ``S``.
"""

from __future__ import annotations

import numpy as np

SHORT_MEDIAN = 2048
SHORT_SIGMA = 0.9
SHORT_MIN, SHORT_MAX = 32, 32 * 1024
LONG_MIN, LONG_MAX = 100 * 1024, 1024 * 1024


def short_docs(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.lognormal(np.log(SHORT_MEDIAN), SHORT_SIGMA, size=n)
    return np.clip(np.round(x), SHORT_MIN, SHORT_MAX).astype(np.int64)


def long_docs(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.round(np.exp(rng.uniform(np.log(LONG_MIN), np.log(LONG_MAX), size=n))).astype(np.int64)


def pack(stream: np.ndarray, seq_len: int, rng: np.random.Generator) -> list[int]:
    """A window of ``seq_len`` tokens of the document stream, starting inside its first document."""
    offset = int(rng.integers(0, stream[0]))
    lengths, need = [int(stream[0]) - offset], seq_len - (int(stream[0]) - offset)
    for L in stream[1:]:
        if need <= 0:
            break
        lengths.append(int(min(L, need)))
        need -= lengths[-1]
    if need > 0:
        raise RuntimeError("stream too short")
    if lengths[0] > seq_len:
        lengths = [seq_len]
    elif sum(lengths) > seq_len:
        lengths[-1] -= sum(lengths) - seq_len
    return [L for L in lengths if L > 0]


def mixed_stream(rng: np.random.Generator, seq_len: int, p_long: float) -> np.ndarray:
    n = 4 * seq_len // SHORT_MEDIAN + 16
    docs = short_docs(rng, n)
    is_long = rng.random(n) < p_long
    docs[is_long] = long_docs(rng, int(is_long.sum()))
    return docs


def near_stream(rng: np.random.Generator, seq_len: int, near: int) -> np.ndarray:
    docs = mixed_stream(rng, seq_len, 0.0)
    is_near = rng.random(len(docs)) < 0.25
    docs[is_near] = near - rng.integers(1, max(2, near // 16), size=int(is_near.sum()), endpoint=True)
    return docs


def one_near_batch(rng: np.random.Generator, seq_len: int, near: int) -> list[int]:
    fill = pack(np.maximum(mixed_stream(rng, seq_len, 0.0) // 4, 8), seq_len - (near - 1), rng)
    at = int(rng.integers(0, len(fill) + 1))
    return [*fill[:at], near - 1, *fill[at:]]


def pareto_stream(rng: np.random.Generator, seq_len: int, index: float) -> np.ndarray:
    n = 4 * seq_len // 64 + 16
    return np.minimum(np.round(64 * (1 + rng.pareto(index, size=n))), seq_len).astype(np.int64)


def make_batch(mix: str, seq_len: int, seed: int) -> list[int]:
    """The document lengths of one row of ``mix`` (module docstring), ``seq_len`` tokens in all."""
    rng = np.random.default_rng(seed)
    if mix.startswith("mixed-"):
        return pack(mixed_stream(rng, seq_len, float(mix.split("-")[1])), seq_len, rng)
    if mix == "all-short":
        return pack(mixed_stream(rng, seq_len, 0.0), seq_len, rng)
    if mix == "causal":
        return [seq_len]
    if mix.startswith("near-"):
        return pack(near_stream(rng, seq_len, int(mix.split("-")[1])), seq_len, rng)
    if mix.startswith("one-near-"):
        return one_near_batch(rng, seq_len, int(mix.split("-")[2]))
    if mix.startswith("pareto-"):
        return pack(pareto_stream(rng, seq_len, float(mix.split("-")[1])), seq_len, rng)
    if mix in ("long-start", "long-end"):
        fill = pack(mixed_stream(rng, seq_len, 0.0), seq_len // 2, rng)
        return [seq_len // 2, *fill] if mix == "long-start" else [*fill, seq_len // 2]
    raise ValueError(mix)
