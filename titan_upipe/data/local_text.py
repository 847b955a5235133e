"""Local text corpora, no network: JSONL, Parquet and plain-text files named by glob patterns.

``training.dataset = "local_text"`` with ``[local_data] paths = ["/data/books/*.jsonl", …]``.
The files (every pattern's matches, sorted, each once) are read in order, pass after pass:

========== ======================================= ==========================
extension  document                                position (for the cursor)
========== ======================================= ==========================
``.jsonl`` one JSON object per line, its text key  byte offset of the line
``.parquet`` one row, its text column              row number
``.txt``   the whole file                          0
========== ======================================= ==========================

Each document is tokenized with the HF tokenizer of ``model.hf_assets_path`` as
``BOS text EOS`` and packed by :mod:`titan_upipe.data.packing`. :class:`LocalTextStream` is a
stream of packed samples whose state (a :class:`~titan_upipe.data.packing.Cursor` and the
file it points into) resumes it exactly.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
from torchtitan.tools.logging import logger

from titan_upipe.data.packing import Cursor, Document, DocumentStats, pack
from titan_upipe.errors import ConfigError

LOCAL_TEXT_DATASET = "local_text"
READERS_BY_EXTENSION = (".jsonl", ".parquet", ".txt")


def expand_paths(patterns: list[str], setting: str = "local_data.paths") -> list[str]:
    """The files the glob patterns match (``**`` recursive), sorted, each once; ConfigError (naming
    ``setting``) for a pattern that matches nothing or a file of another type."""
    files: set[str] = set()
    for pattern in patterns:
        matches = [p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)]
        if not matches:
            raise ConfigError(f"{setting} pattern {pattern!r} matches no file (relative patterns are "
                              f"resolved from {os.getcwd()}): fix the pattern or copy the data there")
        files.update(os.path.abspath(p) for p in matches)
    wrong = sorted(p for p in files if not p.endswith(READERS_BY_EXTENSION))
    if wrong:
        raise ConfigError(f"{setting} matches {wrong[:3]} ({len(wrong)} file(s)) of an unsupported type: "
                          f"valid extensions are {', '.join(READERS_BY_EXTENSION)}; narrow the patterns")
    return sorted(files)


def _jsonl_documents(path: str, start: int, text_key: str) -> Iterator[tuple[int, int, str]]:
    with open(path, "rb") as f:
        f.seek(start)
        offset = start
        for line in f:
            following = offset + len(line)
            if line.strip():
                record = json.loads(line)
                if text_key not in record:
                    raise ConfigError(f"{path} at byte {offset}: no {text_key!r} key (keys: {sorted(record)[:8]}); "
                                      "set local_data.text_key to the key holding the text")
                yield offset, following, record[text_key]
            offset = following


def _parquet_documents(path: str, start: int, text_key: str) -> Iterator[tuple[int, int, str]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if text_key not in parquet.schema_arrow.names:
        raise ConfigError(f"{path}: no {text_key!r} column (columns: {parquet.schema_arrow.names[:8]}); "
                          "set local_data.text_key to the column holding the text")
    first_row = 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if first_row + rows > start:
            texts = parquet.read_row_group(group, columns=[text_key]).column(0).to_pylist()
            for row in range(max(start - first_row, 0), rows):
                yield first_row + row, first_row + row + 1, texts[row]
        first_row += rows


def _text_documents(path: str, start: int, text_key: str) -> Iterator[tuple[int, int, str]]:
    del text_key
    if start == 0:
        with open(path, encoding="utf-8") as f:
            yield 0, 1, f.read()


_READERS = {".jsonl": _jsonl_documents, ".parquet": _parquet_documents, ".txt": _text_documents}


def read_documents(path: str, start: int, text_key: str) -> Iterator[tuple[int, int, str]]:
    """``(position, position of the next document, text)`` of the file's documents from ``start``."""
    return _READERS[os.path.splitext(path)[1]](path, start, text_key)


class LocalTextStream:
    """Packed samples of ``seq_len + 1`` tokens from the files, forever (pass after pass).

    ``encode(text) -> list[int]`` adds BOS and EOS. The state is the cursor of the next sample and
    the file it names; loading a state whose file differs (files added, removed or renamed)
    raises, because the cursor would then point into another document."""

    def __init__(self, files: list[str], encode: Callable[[str], list[int]], seq_len: int, text_key: str = "text",
                 stats: DocumentStats | None = None) -> None:
        if not files:
            raise ConfigError("local_data.paths names no file: list glob patterns of .jsonl/.parquet/.txt files")
        self.files = files
        self.encode = encode
        self.seq_len = seq_len
        self.text_key = text_key
        self.stats = stats or DocumentStats(seq_len=seq_len)
        self._seek(Cursor())

    def _seek(self, cursor: Cursor) -> None:
        self.cursor = cursor
        self._samples = pack(self._documents(cursor), self.seq_len + 1)

    def _documents(self, cursor: Cursor) -> Iterator[Document]:
        epoch, file, position, skip = cursor.epoch, cursor.file, cursor.position, cursor.token_offset
        while True:
            empty_pass = file == 0 and position == 0
            for index in range(file, len(self.files)):
                for start, following, text in read_documents(self.files[index], position, self.text_key):
                    if not text:
                        continue
                    empty_pass = False
                    tokens = np.asarray(self.encode(text), dtype=np.int64)
                    if skip == 0:
                        self.stats.add(len(tokens))
                    yield Document(Cursor(epoch, index, start, skip), tokens[skip:], Cursor(epoch, index, following))
                    skip = 0
                position = 0
            if empty_pass:
                raise ConfigError(f"local_data.paths: the {len(self.files)} file(s) hold no non-empty document "
                                  f"(text key {self.text_key!r})")
            epoch, file = epoch + 1, 0
            logger.warning(f"local_text: pass {epoch} over {len(self.files)} file(s) begins (the data repeats)")

    def next_sample(self) -> np.ndarray:
        sample, self.cursor = next(self._samples)
        return sample

    def skip_samples(self, count: int) -> None:
        for _ in range(count):
            self.next_sample()

    def state_dict(self) -> dict:
        return {**self.cursor.as_dict(), "file_path": self.files[self.cursor.file]}

    def load_state_dict(self, state: dict) -> None:
        cursor = Cursor.from_dict(state)
        path = state.get("file_path")
        if cursor.file >= len(self.files) or self.files[cursor.file] != path:
            here = self.files[cursor.file] if cursor.file < len(self.files) else "(no such file)"
            raise ConfigError(
                f"the checkpoint's data cursor points into file {cursor.file} = {path}, but local_data.paths now "
                f"lists {here} there: resume with the files of the original run (adding files changes the order)")
        self._seek(replace(cursor))
