"""The packed-documents case of ``scripts/bench_attention.py``: its length mix and the numbers its
header prints, against direct counts. Fast: no processes, no attention."""

from __future__ import annotations

import importlib.util
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from titan_upipe.parallel.document_mask import document_mask

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_attention.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize("seq_len,seed", [(4096, 0), (4096, 1), (2048, 0), (1000, 3), (1024, 7)])
def test_length_mix_fills_the_row_with_a_few_long_among_many_short(bench, seq_len, seed):
    lengths = bench.document_lengths(seq_len, seed)
    assert sum(lengths) == seq_len and min(lengths) >= 1
    assert lengths == bench.document_lengths(seq_len, seed)  # every rank draws the same row
    long = [n for n in lengths if n > max(seq_len // 16, 8)]  # longer than any short document
    assert 1 <= len(long) <= 2 and all(n <= seq_len // 4 + 1 for n in long)
    assert len(lengths) >= 10 * len(long)


def test_document_ids_give_the_mix_as_segments_and_the_visible_fraction(bench):
    args = Namespace(seq_len=4096, batch=2, doc_seed=5)
    ids = bench.document_ids(args)
    assert ids.shape == (2, 4096) and ids.dtype == torch.int64
    mask = document_mask(ids)
    for row, segments in enumerate(mask.document_segments):
        lengths = bench.document_lengths(4096, 5 + row)
        assert [stop - start for start, stop in segments] == lengths
        # the fraction the header prints, counted from the mask itself
        positions = torch.arange(4096)
        visible = mask.visible(positions, positions)[row].sum().item()
        assert bench.visible_fraction(lengths) == pytest.approx(visible / (4096 * 4097 / 2), rel=1e-12)
    assert f"{len(bench.document_lengths(4096, 5))} documents" in bench.describe_documents(args)
