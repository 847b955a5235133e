"""Local text data: packing, cursors, the global-batch loader across data-parallel degrees."""

from __future__ import annotations

import re
from functools import partial

import numpy as np
import pytest
import torch
from text_assets import write_corpus, write_tokenizer

from titan_upipe.data.local_text import (
    LocalTextStream,
    check_first_records,
    check_some_document,
    expand_paths,
)
from titan_upipe.data.packing import Cursor, Document, pack
from titan_upipe.data.synthetic import SyntheticCopyStream, copy_sample
from titan_upipe.errors import ConfigError
from titan_upipe.torchtitan_0_2.data_loader import GlobalBatchLoader

SEQ = 48


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("local_text")
    docs = write_corpus(root / "data")
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(str(write_tokenizer(root / "tokenizer")))
    return root, docs, partial(tokenizer.encode, add_bos=True, add_eos=True), tokenizer


def _stream(corpus, seq=SEQ):
    root, _, encode, _ = corpus
    return LocalTextStream(expand_paths([str(root / "data" / "*")]), encode, seq)


def _reference_stream(corpus) -> np.ndarray:
    """The corpus's token stream, one pass, built without the readers or the packer."""
    _, docs, encode, _ = corpus
    return np.concatenate([np.asarray(encode(d)) for path in sorted(docs) for d in docs[path]])


def test_pack_cuts_the_concatenation_and_each_cursor_resumes_it():
    docs = [np.arange(n) + 100 * i for i, n in enumerate([5, 1, 12, 3, 7])]

    def documents_from(cursor: Cursor):
        for i in range(cursor.position, len(docs)):
            skip = cursor.token_offset if i == cursor.position else 0
            yield Document(Cursor(0, 0, i, skip), docs[i][skip:], Cursor(0, 0, i + 1))

    stream = np.concatenate(docs)
    samples = list(pack(documents_from(Cursor()), 4))
    assert len(samples) == len(stream) // 4
    assert np.array_equal(np.concatenate([s for s, _ in samples]), stream[: 4 * len(samples)])
    for k, (_, cursor) in enumerate(samples[:-1]):
        assert np.array_equal(next(pack(documents_from(cursor), 4))[0], samples[k + 1][0]), k
    assert [c for _, c in samples[:3]] == [Cursor(0, 0, 0, 4), Cursor(0, 0, 2, 2), Cursor(0, 0, 2, 6)]


def test_stream_is_the_corpus_packed_with_bos_and_eos(corpus):
    _, _, _, tokenizer = corpus
    reference = _reference_stream(corpus)
    stream = _stream(corpus)
    n = len(reference) // (SEQ + 1)
    got = np.concatenate([stream.next_sample() for _ in range(n)])
    assert np.array_equal(got, reference[: n * (SEQ + 1)])
    assert (got == tokenizer.bos_id).sum() > 50 and (got == tokenizer.eos_id).sum() > 50
    # Pass after pass, the stream goes on (the passes joined, not cut at a sample boundary).
    more = np.concatenate([got, *(stream.next_sample() for _ in range(n))])
    assert stream.cursor.epoch == 1 and np.array_equal(more, np.tile(reference, 2)[: len(more)])


def test_a_saved_cursor_resumes_every_sample_exactly(corpus):
    stream = _stream(corpus)
    states, samples = [], []
    for _ in range(40):  # more than one pass
        states.append(stream.state_dict())
        samples.append(stream.next_sample())
    for k in (1, 7, 13, 22, 39):
        resumed = _stream(corpus)
        resumed.load_state_dict(states[k])
        assert np.array_equal(resumed.next_sample(), samples[k]), k


def test_a_cursor_into_changed_files_is_refused(corpus):
    root, _, encode, _ = corpus
    stream = _stream(corpus)
    while stream.cursor.file < 2:
        stream.next_sample()
    state = stream.state_dict()
    stream.load_state_dict(state)  # the same files: accepted
    fewer = LocalTextStream(expand_paths([str(root / "data" / "*.jsonl")]), encode, SEQ)
    with pytest.raises(ConfigError, match="resume with the files of the original run"):
        fewer.load_state_dict(state)


def test_paths_errors_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="matches no file"):
        expand_paths([str(tmp_path / "missing*.jsonl")])
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ConfigError, match="valid extensions are .jsonl, .parquet, .txt"):
        expand_paths([str(tmp_path / "*")])
    (tmp_path / "y.jsonl").write_text('{"body": "a"}\n')
    stream = LocalTextStream(expand_paths([str(tmp_path / "*.jsonl")]), lambda t: [1, 2, 3], 4)
    with pytest.raises(ConfigError, match="set local_data.text_key"):
        stream.next_sample()


def test_document_stats_match_an_independent_count(corpus):
    _, docs, encode, _ = corpus
    stream = _stream(corpus, seq=400)
    stream.stats.long_tokens = 100
    n = len(_reference_stream(corpus)) // 401
    stream.skip_samples(n)
    stats = stream.stats.take()
    # every document whose start was read: all but those after the last sample's end
    # every document that starts before the end of the last sample read
    lengths = np.asarray([len(encode(d)) for path in sorted(docs) for d in docs[path]])
    lengths = lengths[np.cumsum(lengths) - lengths < n * 401]
    assert stats["data/documents"] == len(lengths)
    assert stats["data/doc_tokens_max"] == lengths.max()
    assert stats["data/doc_tokens_p50"] == np.median(lengths)
    assert stats["data/tokens_in_docs_ge_0k_pct"] == pytest.approx(100 * lengths[lengths >= 100].sum() / lengths.sum())
    assert stats["data/tokens_in_docs_ge_seq_len_pct"] == pytest.approx(
        100 * lengths[lengths >= 400].sum() / lengths.sum())
    assert stream.stats.take() == {}  # a new window


def _run(loader: GlobalBatchLoader, steps: int) -> list[torch.Tensor]:
    batches = iter(loader)
    return [next(batches)[0]["input"] for _ in range(steps)]


def _global_batches(make_stream, world: int, batch: int, steps: int, state=None):
    """Per step, the global batch (rank-major) of ``world`` loaders; and their final states."""
    loaders = [GlobalBatchLoader(make_stream(), batch, r, world) for r in range(world)]
    for loader in loaders:
        loader.load_state_dict(state or {})
    per_rank = [_run(loader, steps) for loader in loaders]
    return [torch.cat([per_rank[r][s] for r in range(world)]) for s in range(steps)], [ld.state_dict() for ld in loaders]


@pytest.mark.parametrize("kind", ["synthetic", "local_text"])
def test_resume_under_another_data_parallel_degree_repeats_and_skips_nothing(corpus, kind):
    make = (lambda: SyntheticCopyStream(SEQ)) if kind == "synthetic" else (lambda: _stream(corpus))
    uninterrupted, _ = _global_batches(make, 1, 4, 5)
    first, states = _global_batches(make, 2, 2, 2)
    assert all(s == states[0] for s in states)  # one state, whatever the rank: nothing keyed by rank
    second, _ = _global_batches(make, 4, 1, 3, states[0])
    assert all(torch.equal(a, b) for a, b in zip(first + second, uninterrupted, strict=True))
    # A broken variant (resuming from scratch) repeats samples: the comparison can fail.
    again, _ = _global_batches(make, 4, 1, 1)
    assert torch.equal(again[0], uninterrupted[0]) and not torch.equal(again[0], uninterrupted[2])


def test_changed_global_batch_continues_at_the_next_sample():
    _, states = _global_batches(lambda: SyntheticCopyStream(SEQ), 2, 2, 3)
    resumed, _ = _global_batches(lambda: SyntheticCopyStream(SEQ), 1, 2, 1, states[0])
    expected = torch.stack([torch.from_numpy(copy_sample(i, SEQ)[:-1]) for i in (12, 13)])
    assert torch.equal(resumed[0], expected)


def _broken_file(tmp_path):
    """Five lines: documents at lines 1, 4 and 5; a line that is not JSON (2) and one without the key (3)."""
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "w1 w2"}\n{"text": "w3"\n{"body": "w4"}\n{"text": "w5 w6"}\n{"text": "w7"}\n')
    return path


def test_a_bad_record_at_run_time_names_its_file_and_line(tmp_path):
    path = _broken_file(tmp_path)
    stream = LocalTextStream([str(path)], lambda text: [1] * len(text.split()), 2)
    with pytest.raises(ConfigError, match=rf"^{path}, line 2: not JSON \(Expecting ',' delimiter at column 14\): fix "
                                          "or remove the line, or set local_data.skip_bad_records = true"):
        stream.skip_samples(3)
    # Resumed past line 2 (a byte offset), the next bad line is still named by its line number.
    second_line = len(path.read_text().splitlines()[0]) + 1
    later = LocalTextStream([str(path)], lambda text: [1] * len(text.split()), 2)
    later.load_state_dict({"epoch": 0, "file": 0, "position": second_line + 14, "token_offset": 0,
                           "file_path": str(path)})
    with pytest.raises(ConfigError, match=rf"^{path}, line 3: no 'text' key \(keys: \['body'\]\)"):
        later.next_sample()


def test_skip_bad_records_skips_and_counts_them(tmp_path, caplog):
    path = _broken_file(tmp_path)
    stream = LocalTextStream([str(path)], lambda text: [int(w[1:]) for w in text.split()], 2, skip_bad_records=True)
    with caplog.at_level("WARNING"):
        samples = [stream.next_sample() for _ in range(3)]
    assert np.concatenate(samples).tolist() == [1, 2, 5, 6, 7, 1, 2, 5, 6]  # lines 1, 4, 5, then the next pass
    assert stream.bad_records.count == 4  # two per pass
    assert f"skipped bad record 1: {path}, line 2: not JSON" in caplog.text
    assert f"skipped bad record 2: {path}, line 3: no 'text' key" in caplog.text
    assert "pass 1 over 1 file(s) begins (the data repeats); 2 bad records skipped so far" in caplog.text


@pytest.mark.parametrize("name, content, message", [
    ("list.jsonl", b'[1, 2]\n', "line 1: a JSON list, not an object"),
    ("number.jsonl", b'{"text": 7}\n', "line 1: 'text' is not text (int): fix the record"),
    ("latin1.jsonl", b'{"text": "caf\xe9"}\n', "line 1: not UTF-8"),
    ("latin1.txt", b"caf\xe9", "latin1.txt: not UTF-8 text"),
])
def test_other_bad_records_are_named(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(message)):
        LocalTextStream([str(tmp_path / name)], lambda text: [1, 2], 4).next_sample()
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_first_records(str(tmp_path / name), "text")


def test_the_first_records_check_reads_as_the_stream_reads(tmp_path, corpus):
    root = corpus[0]
    for path in expand_paths([str(root / "data" / "*")]):
        check_first_records(path, "text")  # every supported type, blank line included
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert not check_first_records(str(tmp_path / "empty.jsonl"), "text")
    assert check_first_records(str(root / "data" / "a.jsonl"), "text")
    with pytest.raises(ConfigError, match="no file of local_data.paths holds a document"):
        check_some_document([str(tmp_path / "empty.jsonl")], [False], "local_data.paths")
    check_some_document([str(tmp_path / "empty.jsonl"), "a.jsonl"], [False, True], "local_data.paths")
    with pytest.raises(ConfigError, match=r"b.parquet: no 'body' column \(columns: \['text'\]\)"):
        check_first_records(str(root / "data" / "b.parquet"), "body")
    check_first_records(str(_broken_file(tmp_path)), "text", records=1)  # the bad line 2 is not among the first 1
    with pytest.raises(ConfigError, match="line 2: not JSON"):
        check_first_records(str(_broken_file(tmp_path)), "text", records=2)
