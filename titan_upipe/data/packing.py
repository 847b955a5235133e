"""Packing tokenized documents into training samples, and where a sample starts.

The corpus is one global token stream (every document as ``BOS d EOS``, TorchTitan's
convention), cut into samples of ``n = seq_len + 1`` tokens that do not overlap
(sample ``k`` is ``stream[k n : (k + 1) n]``; its input is the first ``seq_len`` tokens, its
label the last ``seq_len``)::

    stream   BOS a a a a EOS BOS b b b b b b b b b EOS BOS c c EOS BOS d …
    samples  |----- sample 0 -----|----- sample 1 -----|----- sample 2 ---…
                                  ^ Cursor(file, position of b, token_offset = 2)

A :class:`Cursor` names a point of the stream by the document holding it (its file and the
position of the document in the file) and the token offset inside the document, so a
resumed run re-reads one document, not the stream before it. Everything here is pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace

import numpy as np

LONG_DOCUMENT_TOKENS = 32 * 1024
"""A document at least this long counts as long in the statistics (the length at which most
corpora run out of natural documents)."""


@dataclass(frozen=True)
class Cursor:
    """A point of the token stream: pass ``epoch`` over the files, file index in the sorted file
    list, the document's position in that file (byte offset of a JSONL line, row of a Parquet
    file, 0 for a text file), and the token offset inside the document."""

    epoch: int = 0
    file: int = 0
    position: int = 0
    token_offset: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, int]) -> Cursor:
        return cls(**{k: int(state[k]) for k in ("epoch", "file", "position", "token_offset")})


@dataclass(frozen=True)
class Document:
    """One tokenized document: where it starts (``start.token_offset`` = 0 unless resumed
    inside it), its tokens from there on, and where the next document starts."""

    start: Cursor
    tokens: np.ndarray
    next_start: Cursor


def pack(documents: Iterable[Document], sample_tokens: int) -> Iterator[tuple[np.ndarray, Cursor]]:
    """``(sample, cursor of the next sample)`` for consecutive samples of ``sample_tokens``
    tokens cut from the concatenated documents (a document may span samples)."""
    pieces: list[np.ndarray] = []
    filled = 0
    for doc in documents:
        tokens, pos = doc.tokens, 0
        while pos < len(tokens):
            take = min(sample_tokens - filled, len(tokens) - pos)
            pieces.append(tokens[pos:pos + take])
            filled += take
            pos += take
            if filled == sample_tokens:
                following = (replace(doc.start, token_offset=doc.start.token_offset + pos)
                             if pos < len(tokens) else doc.next_start)
                yield np.concatenate(pieces).astype(np.int64, copy=False), following
                pieces, filled = [], 0


@dataclass
class DocumentStats:
    """Lengths (tokens, BOS and EOS included) of the documents read since the last
    :meth:`take`; every rank reads the whole global stream, so these are the global batch's."""

    long_tokens: int = LONG_DOCUMENT_TOKENS
    seq_len: int = 0
    lengths: list[int] = field(default_factory=list)

    def add(self, length: int) -> None:
        self.lengths.append(length)

    def take(self) -> dict[str, float]:
        """The window's statistics as TensorBoard scalars (``data/…``); starts a new window."""
        lengths, self.lengths = np.asarray(self.lengths, dtype=np.int64), []
        if lengths.size == 0:
            return {}
        total = lengths.sum()
        long_share = lengths[lengths >= self.long_tokens].sum() / total
        full_share = lengths[lengths >= self.seq_len].sum() / total if self.seq_len else 0.0
        return {
            "data/documents": float(lengths.size),
            "data/doc_tokens_p50": float(np.percentile(lengths, 50)),
            "data/doc_tokens_p90": float(np.percentile(lengths, 90)),
            "data/doc_tokens_max": float(lengths.max()),
            f"data/tokens_in_docs_ge_{self.long_tokens // 1024}k_pct": 100.0 * float(long_share),
            "data/tokens_in_docs_ge_seq_len_pct": 100.0 * float(full_share),
        }
