"""Local text data: packing, cursors, the global-batch loader across data-parallel degrees."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from text_assets import write_corpus, write_tokenizer

from titan_upipe.data.loader import GlobalBatchLoader
from titan_upipe.data.local_text import LocalTextStream, expand_paths
from titan_upipe.data.packing import Cursor, Document, pack
from titan_upipe.data.synthetic import SyntheticCopyStream, copy_sample
from titan_upipe.errors import ConfigError

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
