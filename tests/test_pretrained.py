"""Pretrained Hugging Face weights into a converted model: same parameter names, same logits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from text_assets import hf_model, write_hf_weights

from titan_upipe.transforms.model_forward import enable_fused_rope
from titan_upipe.transforms.surgery import fuse_cross_entropy, tile_feed_forwards, tile_rms_norms


def load_hf(model, adapter, folder) -> None:
    """TorchTitan 0.2.2's ``checkpoint.initial_load_in_hf`` path (``CheckpointManager.dcp_load``)."""
    hf_state = adapter.to_hf(model.state_dict())
    dcp.load(hf_state, storage_reader=adapter.get_hf_storage_reader(str(folder)))
    model.load_state_dict(adapter.from_hf(hf_state))


@pytest.mark.parametrize("model_name", ["upipe_llama3", "upipe_qwen3"])
def test_hf_weights_load_into_the_converted_model_with_equal_logits(tmp_path, model_name):
    original = write_hf_weights(tmp_path, model_name, seed=0)
    plain, adapter = hf_model(model_name, seed=1)  # other weights until loaded
    converted = copy.deepcopy(plain)
    enable_fused_rope(converted)
    tile_feed_forwards(converted, 16)
    tile_rms_norms(converted, 8)
    with_fused_ce = copy.deepcopy(converted)
    fuse_cross_entropy(with_fused_ce, chunk_tokens=24, backend="torch")
    # Parameter names are unchanged by every transform: HF and DCP checkpoints map one to one.
    assert [n for n, _ in with_fused_ce.named_parameters()] == [n for n, _ in plain.named_parameters()]

    tokens = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        before = converted(tokens)
        load_hf(plain, adapter, tmp_path)
        load_hf(converted, adapter, tmp_path)
        expected = original(tokens)
        assert torch.allclose(plain(tokens), expected, rtol=0, atol=0)
        logits = converted(tokens)
    assert torch.allclose(logits, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, expected, rtol=1e-2, atol=1e-2)  # the load changed the weights
