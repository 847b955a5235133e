"""CP input preparation (``parallel.inputs.prepare_cp_batch``, what the trainer, the validation loss,
the parity check and the emulator share): ``attn_mask_type`` read from the model args, the documents
built from the global batch by TorchTitan's EOS rule (checked against TorchTitan's own
``block_causal`` mask_mod, materialized), the shards and the whole batch's valid-token count."""

from types import SimpleNamespace

import pytest
import torch
from fake_meshes import OneRankMesh
from torch.nn.attention.flex_attention import and_masks, create_mask
from torchtitan.models.attention import get_causal_mask_mod, get_document_mask_mod

from titan_upipe.data import tokenizer as vocab
from titan_upipe.data.synthetic import docs_sample
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.inputs import prepare_cp_batch
from titan_upipe.torchtitan_0_2.cp_inputs import document_eos_id

EOS = vocab.EOS_ID


def _args(mask_type: str) -> SimpleNamespace:
    return SimpleNamespace(attn_type="flex", attn_mask_type=mask_type)


def test_block_causal_documents_are_torchtitans():
    tokens = torch.stack([torch.from_numpy(docs_sample(i, 256)[:-1]) for i in range(3)])
    tokens[2, -1] = EOS  # an EOS at the last position closes the row's last document
    eos_id = document_eos_id(_args("block_causal"), SimpleNamespace(eos_id=EOS))
    mask = prepare_cp_batch(tokens, tokens, OneRankMesh(), eos_id=eos_id, ignore_index=-100).attention_masks
    positions = torch.arange(tokens.shape[1])
    theirs = create_mask(and_masks(get_causal_mask_mod(), get_document_mask_mod(tokens, EOS)), 3, None, 256, 256,
                         device="cpu")[:, 0]
    assert torch.equal(mask.visible(positions, positions), theirs)
    assert (tokens == EOS).any(dim=1).all() and not torch.equal(theirs, theirs[0].tril().expand_as(theirs))


def test_causal_needs_no_mask_and_other_types_or_no_eos_are_refused():
    assert document_eos_id(_args("causal"), SimpleNamespace(eos_id=EOS)) is None
    assert document_eos_id(SimpleNamespace(), None) is None  # args without mask settings
    with pytest.raises(ConfigError, match=r"attn_mask_type = 'sliding_window' .* valid values are causal, "
                                          r"block_causal"):
        document_eos_id(_args("sliding_window"), SimpleNamespace(eos_id=EOS))
    with pytest.raises(ConfigError, match="the tokenizer has no EOS"):
        document_eos_id(_args("block_causal"), SimpleNamespace(eos_id=None))


def test_a_prepared_batch_counts_the_whole_batchs_valid_tokens_and_keeps_its_shard():
    tokens = torch.arange(16).reshape(2, 8)
    labels = tokens.clone()
    labels[0, :3] = -100
    batch = prepare_cp_batch(tokens, labels, OneRankMesh(), eos_id=None, ignore_index=-100)
    assert batch.valid_tokens.item() == 13 and batch.attention_masks is None
    assert torch.equal(batch.tokens, tokens) and torch.equal(batch.positions, torch.arange(8))
    assert set(batch.model_kwargs()) == {"positions"}
