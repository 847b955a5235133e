"""The converted model's layout check runs on every forward (training and validation alike)."""

import pytest
import torch

from titan_upipe.errors import ConfigError
from titan_upipe.parallel import shard_sequence
from titan_upipe.parallel.inputs import LayoutCheck


class RingMesh:
    """Rank 1 of a 1-D ring mesh of 2 (zigzag layout), without processes."""

    ndim = 1
    mesh_dim_names = ("ring",)

    def size(self, dim=None):
        return 2

    def get_local_rank(self, dim=None):
        return 1


def test_every_forward_is_checked_not_only_the_first():
    mesh = RingMesh()
    check = LayoutCheck(mesh)
    tokens = torch.zeros(1, 8, dtype=torch.long)
    _, zigzag = shard_sequence(torch.arange(16)[None], mesh, seq_dim=1)
    assert zigzag.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # chunks 1 and 2 of 4
    check(None, (tokens,), {"positions": zigzag})
    check(None, (tokens,), {"positions": zigzag})
    # A later forward with another sharding (e.g. TorchTitan's validator: head-tail / contiguous)
    # is refused although the first forwards passed.
    with pytest.raises(ConfigError, match="not in titan_upipe's sequence layout"):
        check(None, (tokens,), {"positions": torch.arange(8, 16)})
    with pytest.raises(ConfigError, match="not in titan_upipe's sequence layout"):
        check(None, (tokens,), {})
    # [B, S/C] positions: every row is compared, not only the first
    check(None, (tokens.expand(2, 8),), {"positions": zigzag.expand(2, 8)})
    with pytest.raises(ConfigError, match="not in titan_upipe's sequence layout"):
        check(None, (tokens.expand(2, 8),), {"positions": torch.stack([zigzag, torch.arange(8, 16)])})


def test_a_batch_in_its_document_layout_is_checked_row_by_row():
    """With the mask's document-aware layout (document_balance = "documents") the check compares the
    whole [B, S/C] positions with the batch's own layout: the fixed zigzag's shards, a row of
    another batch's layout, or [S/C] positions are refused; the layout's own pass."""
    from titan_upipe.parallel.document_mask import DocumentMask
    from titan_upipe.parallel.inputs import prepare_cp_batch

    mesh = RingMesh()
    check = LayoutCheck(mesh)
    tokens = torch.arange(1, 17).repeat(2, 1)
    tokens[0, [0, 9]] = 0  # row 0: documents [0, 1), [1, 10), [10, 16); row 1: one document
    batch = prepare_cp_batch(tokens, tokens, mesh, eos_id=0, ignore_index=-100, document_balance="documents",
                             document_min_split=4)
    mask = batch.attention_masks
    assert mask.layout is not None and batch.positions.shape == (2, 8)
    assert batch.positions[0].tolist() != batch.positions[1].tolist()  # each row in its own layout
    assert torch.equal(batch.tokens, torch.stack([tokens[b, batch.positions[b]] for b in range(2)]))
    check(None, (batch.tokens,), batch.model_kwargs())
    _, zigzag = shard_sequence(tokens, mesh, seq_dim=1)
    other = DocumentMask.from_eos(tokens.flip(0), 0).balanced(2, 1, 4).layout.positions(1)
    for positions in (zigzag, zigzag.expand(2, 8), other, batch.positions[:1]):
        with pytest.raises(ConfigError, match="not in the batch's document-aware layout"):
            check(None, (batch.tokens,), {"positions": positions, "attention_masks": mask})
    # the fixed layout still reads its own positions when the mask has no layout
    check(None, (batch.tokens,), {"positions": zigzag, "attention_masks": DocumentMask(mask.doc)})
