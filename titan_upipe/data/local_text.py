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

A record that cannot be read (a JSONL line that is not a JSON object, without the text key or
whose text is not a string; a Parquet file without a string text column; a text file that is not
UTF-8) stops the stream with a ConfigError naming its file and line, or, with
``local_data.skip_bad_records``, is skipped and counted (:class:`BadRecords`).
:func:`check_first_records` reads a file's first records the same way before launch.
"""

from __future__ import annotations

import codecs
import glob
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np

from titan_upipe.data.packing import Cursor, Document, DocumentStats, pack
from titan_upipe.errors import ConfigError

logger = logging.getLogger()
"""The root logger: where TorchTitan's own ``logger`` writes, so the lines keep its format."""

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


BadRecordHandler = Callable[[str, int | None, str], None]
"""``on_bad(path, position, reason)`` for a record that cannot be read (``position`` None: the
whole file): raises, or returns and the record is skipped."""


def line_number(path: str, offset: int) -> int:
    """The 1-based line of a JSONL file that starts at byte ``offset`` (counted only for a message)."""
    newlines, done = 0, 0
    with open(path, "rb") as f:
        while done < offset:
            chunk = f.read(min(1 << 24, offset - done))
            if not chunk:
                break
            newlines += chunk.count(b"\n")
            done += len(chunk)
    return newlines + 1


def record_place(path: str, position: int | None) -> str:
    """Where a record is, for a message: ``file, line N`` (JSONL), ``file, row N`` (Parquet), or the file."""
    if position is None:
        return path
    if path.endswith(".jsonl"):
        return f"{path}, line {line_number(path, position)}"
    return f"{path}, row {position}" if path.endswith(".parquet") else path


class BadRecords:
    """What a stream does with a record it cannot read: stop with a ConfigError naming its file and
    line (the default), or, with ``local_data.skip_bad_records``, skip and count it (the first
    ``LOGGED`` skips are logged with file and line, then every power of ten)."""

    LOGGED = 10

    def __init__(self, skip: bool = False) -> None:
        self.skip = skip
        self.count = 0

    def __call__(self, path: str, position: int | None, reason: str) -> None:
        # The place (a JSONL line number re-reads the file up to the record) only for a message.
        if not self.skip:
            raise ConfigError(f"{record_place(path, position)}: {reason}, or set local_data.skip_bad_records = true "
                              "to skip bad records")
        self.count += 1
        if self.count <= self.LOGGED:
            logger.warning(f"local_text: skipped bad record {self.count}: {record_place(path, position)}: {reason}")
        elif str(self.count).rstrip("0") == "1":
            logger.warning(f"local_text: {self.count} bad records skipped so far")


def _jsonl_text(line: bytes, text_key: str) -> tuple[str, str | None]:
    """(the record's text, None), or ("", why the line is not a document)."""
    try:
        record = json.loads(line.rstrip(b"\r\n"))
    except json.JSONDecodeError as err:
        return "", f"not JSON ({err.msg} at column {err.colno}): fix or remove the line"
    except UnicodeDecodeError as err:
        return "", f"not UTF-8 ({err.reason} at column {err.start + 1}): fix or remove the line"
    if not isinstance(record, dict):
        return "", f"a JSON {type(record).__name__}, not an object: fix or remove the line"
    if text_key not in record:
        return "", (f"no {text_key!r} key (keys: {sorted(record)[:8]}): set local_data.text_key to the key "
                    "holding the text")
    text = record[text_key]
    if text is not None and not isinstance(text, str):
        return "", f"{text_key!r} is not text ({type(text).__name__}): fix the record"
    return text or "", None


def _jsonl_documents(path: str, start: int, text_key: str, on_bad: BadRecordHandler) -> Iterator[tuple[int, int, str]]:
    with open(path, "rb") as f:
        f.seek(start)
        offset = start
        for line in f:
            following = offset + len(line)
            if line.strip():
                text, problem = _jsonl_text(line, text_key)
                if problem is None:
                    yield offset, following, text
                else:
                    on_bad(path, offset, problem)
            offset = following


def parquet_problem(parquet, text_key: str) -> str | None:
    """Why a Parquet file (``pyarrow.parquet.ParquetFile``) has no text column ``text_key``, or None."""
    import pyarrow as pa

    schema = parquet.schema_arrow
    if text_key not in schema.names:
        return (f"no {text_key!r} column (columns: {schema.names[:8]}): set local_data.text_key to the column "
                "holding the text")
    kind = schema.field(text_key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return f"column {text_key!r} holds {kind}, not strings: point local_data.text_key at a text column"
    return None


def _parquet_documents(path: str, start: int, text_key: str, on_bad: BadRecordHandler) -> Iterator[tuple[int, int, str]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if problem := parquet_problem(parquet, text_key):
        on_bad(path, None, problem)
        return
    first_row = 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if first_row + rows > start:
            texts = parquet.read_row_group(group, columns=[text_key]).column(0).to_pylist()
            for row in range(max(start - first_row, 0), rows):
                yield first_row + row, first_row + row + 1, texts[row]
        first_row += rows


def _text_documents(path: str, start: int, text_key: str, on_bad: BadRecordHandler) -> Iterator[tuple[int, int, str]]:
    del text_key
    if start == 0:
        with open(path, "rb") as f:
            data = f.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            on_bad(path, None, f"not UTF-8 text ({err.reason} at byte {err.start}): convert it to UTF-8")
            return
        yield 0, 1, text


_READERS = {".jsonl": _jsonl_documents, ".parquet": _parquet_documents, ".txt": _text_documents}


def read_documents(path: str, start: int, text_key: str,
                   on_bad: BadRecordHandler | None = None) -> Iterator[tuple[int, int, str]]:
    """``(position, position of the next document, text)`` of the file's documents from ``start``;
    a record that cannot be read goes to ``on_bad`` (default: a ConfigError naming file and line)."""
    return _READERS[os.path.splitext(path)[1]](path, start, text_key, on_bad or BadRecords())


FIRST_RECORDS = 8
"""Records of each file that ``check_first_records`` reads."""
TEXT_HEAD_BYTES = 1 << 16
"""Bytes of a text file (one document) that ``check_first_records`` decodes."""


def _first_documents(path: str, text_key: str, on_bad: BadRecordHandler, records: int) -> tuple[int, bool]:
    """(non-empty documents among the first ``records``, whether the file ended before that)."""
    if path.endswith(".txt"):  # one document: its head says whether it is UTF-8 text
        with open(path, "rb") as f:
            head = f.read(TEXT_HEAD_BYTES)
        try:  # a character cut at the end of the head is not an error, at the end of the file it is
            codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < TEXT_HEAD_BYTES)
        except UnicodeDecodeError as err:
            on_bad(path, None, f"not UTF-8 text ({err.reason} at byte {err.start}): convert it to UTF-8")
            return 0, True
        return int(bool(head.strip())), True
    if path.endswith(".parquet"):  # the schema and the row count; no row is read
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        if problem := parquet_problem(parquet, text_key):
            on_bad(path, None, problem)
            return 0, True
        rows = parquet.metadata.num_rows
        return min(rows, records), rows <= records
    found = read = 0
    for _, _, text in _jsonl_documents(path, 0, text_key, on_bad):
        found, read = found + bool(text), read + 1
        if read == records:
            return found, False
    return found, True


def check_first_records(path: str, text_key: str, skip_bad_records: bool = False, setting: str = "local_data.paths",
                        records: int = FIRST_RECORDS) -> bool:
    """Read the first ``records`` records of ``path`` as the stream will (a bad record raises the
    stream's ConfigError naming file and line, unless ``skip_bad_records``; ``setting`` names the
    paths it came from). False when the file holds no document at all (the stream skips such a
    file; :func:`check_some_document` refuses files of which none holds one)."""
    try:
        found, ended = _first_documents(path, text_key, BadRecords(skip_bad_records), records)
    except OSError as err:
        raise ConfigError(f"{path} cannot be read ({err.strerror or err}): fix its permissions or remove it from "
                          f"{setting}") from None
    except ConfigError:
        raise
    except Exception as err:  # pyarrow's error for a file that is not Parquet
        raise ConfigError(f"{path} cannot be read ({type(err).__name__}: {err}): replace the file or remove it "
                          f"from {setting}") from None
    return bool(found) or not ended


def check_some_document(files: list[str], holds_document: list[bool], setting: str) -> None:
    """The stream needs one document among ``files`` (``holds_document``: :func:`check_first_records`
    of each); an empty file beside others is skipped, as the stream skips it."""
    if not any(holds_document):
        empty = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        raise ConfigError(f"no file of {setting} holds a document (empty, or only blank records: {empty}): "
                          f"fill them or point {setting} at the data")


class LocalTextStream:
    """Packed samples of ``seq_len + 1`` tokens from the files, forever (pass after pass).

    ``encode(text) -> list[int]`` adds BOS and EOS. The state is the cursor of the next sample and
    the file it names; loading a state whose file differs (files added, removed or renamed)
    raises, because the cursor would then point into another document."""

    def __init__(self, files: list[str], encode: Callable[[str], list[int]], seq_len: int, text_key: str = "text",
                 stats: DocumentStats | None = None, skip_bad_records: bool = False) -> None:
        if not files:
            raise ConfigError("local_data.paths names no file: list glob patterns of .jsonl/.parquet/.txt files")
        self.files = files
        self.encode = encode
        self.seq_len = seq_len
        self.text_key = text_key
        self.stats = stats or DocumentStats(seq_len=seq_len)
        self.bad_records = BadRecords(skip_bad_records)
        self._seek(Cursor())

    def _seek(self, cursor: Cursor) -> None:
        self.cursor = cursor
        self._samples = pack(self._documents(cursor), self.seq_len + 1)

    def _documents(self, cursor: Cursor) -> Iterator[Document]:
        epoch, file, position, skip = cursor.epoch, cursor.file, cursor.position, cursor.token_offset
        while True:
            empty_pass = file == 0 and position == 0
            for index in range(file, len(self.files)):
                for start, following, text in read_documents(self.files[index], position, self.text_key,
                                                                 self.bad_records):
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
            skipped = f"; {self.bad_records.count} bad records skipped so far" if self.bad_records.count else ""
            logger.warning(f"local_text: pass {epoch} over {len(self.files)} file(s) begins (the data repeats){skipped}")

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
