"""Embedded tokenizer and synthetic data: deterministic, rank-invariant, TorchTitan-compatible."""

import numpy as np
import torch

from titan_upipe.data import tokenizer as vocab
from titan_upipe.data.loader import GlobalBatchLoader
from titan_upipe.data.synthetic import SyntheticCopyStream, copy_sample, copy_text


def test_copy_sample_is_deterministic_and_repeats_its_segment():
    a, b = copy_sample(7, 256), copy_sample(7, 256)
    assert np.array_equal(a, b) and len(a) == 257 and a.dtype == np.int64
    assert not np.array_equal(a, copy_sample(8, 256))
    assert a[0] == vocab.BOS_ID and a.min() >= 0 and a.max() < vocab.VOCAB_SIZE
    seps = np.flatnonzero(a == vocab.SEP_ID)
    period = seps[0]  # BOS + n words, then SEP: the body repeats with period n + 1
    assert len(seps) >= 2 and np.array_equal(a[1:period + 1], a[period + 1: 2 * period + 1])


def test_loader_yields_shifted_input_label_pairs_and_resumes():
    loader = GlobalBatchLoader(SyntheticCopyStream(32), local_batch_size=2, dp_rank=1, dp_world_size=2)
    batches = iter(loader)
    inputs, labels = next(batches)
    assert inputs["input"].shape == labels.shape == (2, 32) and torch.equal(inputs["input"][:, 1:], labels[:, :-1])
    # rank 1 of 2 with 2 sequences each: samples 2 and 3 of the global stream
    assert torch.equal(labels[0], torch.from_numpy(copy_sample(2, 32)[1:]))
    resumed = GlobalBatchLoader(SyntheticCopyStream(32), 2, 1, 2)
    resumed.load_state_dict(loader.state_dict())
    assert torch.equal(next(iter(resumed))[0]["input"], next(batches)[0]["input"])


def test_embedded_tokenizer_round_trips_through_torchtitan():
    tok = vocab.build_embedded_tokenizer()
    assert tok.get_vocab_size() == vocab.VOCAB_SIZE
    text = copy_text(3, 64)
    ids = tok.encode(text, add_bos=True, add_eos=False)
    assert ids == copy_sample(3, 64).tolist()
    assert (tok.bos_id, tok.eos_id) == (vocab.BOS_ID, vocab.EOS_ID)


def test_synthetic_copy_is_a_registered_torchtitan_dataset():
    from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset

    assert "synthetic_copy" in DATASETS
    ds = HuggingFaceTextDataset("synthetic_copy", None, vocab.build_embedded_tokenizer(), seq_len=128)
    inputs, labels = next(iter(ds))
    assert inputs["input"].shape == labels.shape == (128,)
    assert torch.equal(inputs["input"], torch.from_numpy(copy_sample(0, 2048)[:128]))
