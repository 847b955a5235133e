"""Document-length mixes of packed training batches: pure numpy, seeded.

A batch row is a window of ``S`` tokens of a document stream, starting at a random offset inside
its first document, the last one cut, as a packer does. The mixes
(``docs/benchmarks/document_balance.md``, the GPU queue's ring-with-documents item):

* ``mixed-p``: short documents lognormal, median 2048 tokens, sigma 0.9, clipped to [32, 32K];
  with probability ``p`` a document is instead long, log-uniform in [100K, 1M];
* ``all-short``: ``p = 0``;
* ``long-start`` / ``long-end``: one document of ``S/2`` at the start / end, short ones fill;
* ``causal``: one document of ``S`` tokens.
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


def make_batch(mix: str, seq_len: int, seed: int) -> list[int]:
    """The document lengths of one row of ``mix`` (module docstring), ``seq_len`` tokens in all."""
    rng = np.random.default_rng(seed)
    if mix.startswith("mixed-"):
        return pack(mixed_stream(rng, seq_len, float(mix.split("-")[1])), seq_len, rng)
    if mix == "all-short":
        return pack(mixed_stream(rng, seq_len, 0.0), seq_len, rng)
    if mix == "causal":
        return [seq_len]
    if mix in ("long-start", "long-end"):
        fill = pack(mixed_stream(rng, seq_len, 0.0), seq_len // 2, rng)
        return [seq_len // 2, *fill] if mix == "long-start" else [*fill, seq_len // 2]
    raise ValueError(mix)
