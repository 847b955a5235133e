"""Packed documents (issue 17 foundation): document rules, visibility, block kinds, exact masked
kernels and the segmented SDPA fast path, all in one process on CPU."""

import pytest
import torch
import torch.nn.functional as F

from titan_upipe.attention.backends import SdpaBackend
from titan_upipe.attention.documents import (
    DocumentMask,
    masked_backward,
    masked_forward,
    merge_partial_masked,
    segmented_causal_backward,
    segmented_causal_forward,
)
from titan_upipe.attention.ring import merge_partial
from titan_upipe.attention.ring_plan import BlockKind, causal_block_kind
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.layout import ContiguousLayout, ZigzagLayout

EOS = 9
SCALE = 0.35
ATOL = 2e-5


def _tensors(b, hq, hkv, sq, sk, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g)
    k = torch.randn(b, hkv, sk, d, generator=g)
    v = torch.randn(b, hkv, sk, d, generator=g)
    return q, k, v, torch.randn(b, hq, sq, d, generator=g)


def _close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-5)


# ------------------------------------------------------------------ document rules


def test_from_eos_rules():
    tokens = torch.tensor([
        [1, 2, EOS, 3, EOS, EOS, 4, 5],    # a document of length 1 (the lone EOS at 5)
        [1, 2, 3, 4, 5, 6, 7, EOS],        # EOS at the last position: one document
        [1, 2, 3, 4, 5, 6, 7, 8],          # no EOS: one document
        [EOS, 1, 2, 3, EOS, 4, 5, EOS],    # EOS first: a document of length 1 at 0
    ])
    mask = DocumentMask.from_eos(tokens, EOS)
    assert mask.doc.tolist() == [
        [0, 0, 0, 1, 1, 2, 3, 3],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 1, 1, 1, 1, 2, 2, 2],
    ]
    assert mask.positions().tolist() == [
        [0, 1, 2, 0, 1, 0, 0, 1],
        [0, 1, 2, 3, 4, 5, 6, 7],
        [0, 1, 2, 3, 4, 5, 6, 7],
        [0, 0, 1, 2, 3, 0, 1, 2],
    ]


def test_from_eos_matches_torchtitan_block_causal():
    from torchtitan.models.attention import get_document_mask_mod

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 4, (3, 24), generator=g)  # EOS = 0 about every 4th token
    tokens[1, -1] = 0
    theirs = get_document_mask_mod(tokens.clone(), 0)
    mask = DocumentMask.from_eos(tokens, 0)
    i = torch.arange(24)
    for b in range(3):
        same = theirs(torch.tensor(b), torch.tensor(0), i[:, None], i[None, :])
        assert torch.equal(same, mask.doc[b][:, None] == mask.doc[b][None, :]), b


def test_from_ids_renumbers_and_refuses_split_documents():
    mask = DocumentMask.from_ids(torch.tensor([[7, 7, 3, 3, 3, 9], [5, 5, 5, 5, 5, 5]]))
    assert mask.doc.tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]]
    with pytest.raises(ConfigError, match=r"document id 4 in batch row 1 is not one contiguous run"):
        DocumentMask.from_ids(torch.tensor([[1, 1, 2, 2], [4, 5, 4, 4]]))
    with pytest.raises(ConfigError, match="integer"):
        DocumentMask.from_ids(torch.zeros(2, 4))
    with pytest.raises(ConfigError, match=r"\[batch, seq_len\]"):
        DocumentMask.from_ids(torch.zeros(4, dtype=torch.long))


# ------------------------------------------------------------------ visibility and blocks

ZIG = ZigzagLayout(16, ring_size=2)  # chunks of 4: rank 0 holds chunks 0, 3; rank 1 chunks 1, 2
# Row 0: documents [0, 6) and [6, 16). Row 1: [0, 3), [3, 11), [11, 16).
IDS = torch.tensor([[0] * 6 + [1] * 10, [0] * 3 + [1] * 8 + [2] * 5])


def _chunk(c):
    return torch.arange(4 * c, 4 * c + 4)


def test_visible_against_brute_force():
    mask = DocumentMask.from_ids(IDS)
    for q_pos, k_pos in [(ZIG.positions(1), ZIG.positions(0)), (ZIG.positions(0), ZIG.positions(0)),
                         (torch.arange(16), torch.arange(16))]:
        vis = mask.visible(q_pos, k_pos)
        for b in range(2):
            for i, qi in enumerate(q_pos.tolist()):
                for j, kj in enumerate(k_pos.tolist()):
                    assert bool(vis[b, i, j]) == (kj <= qi and IDS[b, qi] == IDS[b, kj]), (b, qi, kj)


def test_block_kind_on_zigzag_chunks():
    one_row = DocumentMask.from_ids(IDS[:1])
    kind = one_row.block_kind
    assert kind(_chunk(2), _chunk(0)) == "skip"     # causally visible, other document
    assert kind(_chunk(0), _chunk(3)) == "skip"     # after the query chunk
    assert kind(_chunk(3), _chunk(2)) == "full"
    assert kind(_chunk(2), _chunk(2)) == "causal"
    assert kind(_chunk(1), _chunk(1)) == "masked"   # a boundary at 6 inside the chunk
    assert kind(_chunk(1), _chunk(0)) == "masked"   # rows 4, 5 see it, rows 6, 7 do not
    # Rank 0's ring-local diagonal: plain causal would let chunk 3 see chunk 0.
    assert kind(ZIG.positions(0), ZIG.positions(0)) == "masked"
    # Every row must agree: chunk (2, 0) is skip in row 0 but visible in row 1.
    assert DocumentMask.from_ids(IDS).block_kind(_chunk(2), _chunk(0)) == "masked"


def test_block_kind_with_one_document_is_the_ring_rule():
    mask = DocumentMask.from_ids(torch.zeros(2, 16, dtype=torch.long))
    names = {BlockKind.SKIP: "skip", BlockKind.FULL: "full", BlockKind.DIAGONAL: "causal"}
    for qc in range(4):
        for kc in range(4):
            assert mask.block_kind(_chunk(qc), _chunk(kc)) == names[causal_block_kind(qc, kc)], (qc, kc)


def test_segments_and_cu_seqlens():
    mask = DocumentMask.from_ids(IDS)
    rank0 = ZIG.positions(0)  # global 0..3, 12..15
    assert mask.segments(rank0) == [[(0, 4), (4, 8)], [(0, 3), (3, 4), (4, 8)]]
    assert [c.tolist() for c in mask.cu_seqlens(rank0)] == [[0, 4, 8], [0, 3, 4, 8]]
    assert mask.cu_seqlens(rank0)[0].dtype == torch.int32
    assert mask.segments_are_exact(rank0)
    # Rank 1 holds 4..11: row 0's document [6, 16) is one run, row 1's [3, 11) too.
    assert mask.segments(ZIG.positions(1)) == [[(0, 2), (2, 8)], [(0, 7), (7, 8)]]
    # One document over both zigzag chunks: two segments of one document, not exact.
    single = DocumentMask.from_ids(torch.zeros(1, 16, dtype=torch.long))
    assert single.segments(rank0) == [[(0, 4), (4, 8)]]
    assert not single.segments_are_exact(rank0)
    assert single.segments_are_exact(torch.arange(16))


# ------------------------------------------------------------------ masked kernel


def _per_document_sdpa(q, k, v, doc):
    """The reference of the issue: unconverted causal SDPA on each document separately."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for d in doc[b].unique().tolist():
            idx = (doc[b] == d).nonzero().flatten()
            a, c = int(idx[0]), int(idx[-1]) + 1
            out[b:b + 1, :, a:c] = F.scaled_dot_product_attention(
                q[b:b + 1, :, a:c], k[b:b + 1, :, a:c], v[b:b + 1, :, a:c], is_causal=True, scale=SCALE,
                enable_gqa=True)
    return out


def _explicit_masked(q, k, v, mask):
    """Autograd reference: softmax over the visible keys, empty rows exactly 0."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    m = mask[:, None]
    empty = ~m.any(-1, keepdim=True)
    scores = torch.where(m, q @ k.transpose(-1, -2) * SCALE, float("-inf"))
    probs = torch.softmax(torch.where(empty, 0.0, scores), dim=-1) * m
    return probs @ v


def _autograd(fn, q, k, v, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _kernel(q, k, v, dout, mask):
    out, lse = masked_forward(q, k, v, SCALE, mask)
    return out, lse, masked_backward(dout, q, k, v, out, lse, SCALE, mask)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_masked_kernel_equals_sdpa_per_document(hq, hkv):
    tokens = torch.tensor([[1, 2, EOS, 3, 4, 5, 6, EOS, EOS, 1, 2, 3],
                           [1, 2, 3, 4, 5, EOS, 1, 2, 3, 4, 5, 6]])
    docs = DocumentMask.from_eos(tokens, EOS)
    pos = torch.arange(12)
    q, k, v, dout = _tensors(2, hq, hkv, 12, 12)
    out, lse, grads = _kernel(q, k, v, dout, docs.visible(pos, pos))
    ref = _autograd(lambda q, k, v: _per_document_sdpa(q, k, v, docs.doc), q, k, v, dout)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (2, hq, 12)
    for got, want in zip((out, *grads), ref, strict=True):
        _close(got, want)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1)], ids=["mha", "gqa"])
def test_masked_kernel_equals_explicit_softmax_with_empty_rows(hq, hkv):
    docs = DocumentMask.from_ids(torch.tensor([[0] * 10 + [1] * 6, [0] * 3 + [1] * 13]))
    q_pos, k_pos = torch.arange(8, 16), torch.arange(0, 8)  # an off-diagonal ring block
    mask = docs.visible(q_pos, k_pos)
    assert not mask[0, 2:].any() and mask[0, :2].any()  # row 0: queries 10..15 see nothing here
    q, k, v, dout = _tensors(2, hq, hkv, 8, 8, seed=1)
    out, lse, grads = _kernel(q, k, v, dout, mask)
    ref = _autograd(lambda q, k, v: _explicit_masked(q, k, v, mask), q, k, v, dout)
    for got, want in zip((out, *grads), ref, strict=True):
        _close(got, want)
    assert torch.isneginf(lse[0, :, 2:]).all() and torch.isfinite(lse[0, :, :2]).all()
    assert (out[0, :, 2:] == 0).all() and (grads[0][0, :, 2:] == 0).all()
    assert all(torch.isfinite(g).all() for g in grads)


def test_merge_partial_masked_keeps_empty_rows_empty():
    out_acc, lse_acc = torch.zeros(1, 1, 2, 3), torch.full((1, 1, 2), float("-inf"))
    out, lse = torch.zeros(1, 1, 2, 3), torch.tensor([[[float("-inf"), 0.5]]])
    out[0, 0, 1] = 1.0
    ring_acc = (out_acc.clone(), lse_acc.clone())
    merge_partial(*ring_acc, out, lse)
    assert torch.isnan(ring_acc[0][0, 0, 0]).all()  # why the masked variant exists
    merge_partial_masked(out_acc, lse_acc, out, lse)
    assert (out_acc[0, 0, 0] == 0).all() and torch.isneginf(lse_acc[0, 0, 0])
    assert torch.equal(out_acc[0, 0, 1], torch.ones(3)) and lse_acc[0, 0, 1] == 0.5


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)], ids=["mha", "gqa"])
def test_merged_lse_backward_sums_to_the_whole(hq, hkv):
    """Two key blocks, forward merged with merge_partial_masked, each block's backward from the
    merged out/lse: the sum is the whole attention's gradient (what ring attention relies on)."""
    docs = DocumentMask.from_ids(torch.tensor([[0] * 3 + [1] * 9 + [2] * 4, [0] * 16]))
    q_pos = ZIG.positions(0)                       # ring-local queries 0..3, 12..15
    blocks = [ZIG.positions(0), ZIG.positions(1)]  # keys: own chunks, then rank 1's 4..11
    q, _, _, dout = _tensors(2, hq, hkv, 8, 8, seed=2)
    kvs = [_tensors(2, hq, hkv, 8, 8, seed=s)[1:3] for s in (3, 4)]
    masks = [docs.visible(q_pos, kp) for kp in blocks]
    out_acc = torch.zeros(q.shape)
    lse_acc = torch.full(q.shape[:3], float("-inf"))
    for (k, v), mask in zip(kvs, masks, strict=True):
        merge_partial_masked(out_acc, lse_acc, *masked_forward(q, k, v, SCALE, mask))
    parts = [masked_backward(dout, q, k, v, out_acc, lse_acc, SCALE, m) for (k, v), m in zip(kvs, masks, strict=True)]
    k_all, v_all = (torch.cat([kv[i] for kv in kvs], dim=2) for i in (0, 1))
    mask_all = torch.cat(masks, dim=2)
    whole_out, whole_lse, whole = _kernel(q, k_all, v_all, dout, mask_all)
    _close(out_acc, whole_out)
    _close(lse_acc, whole_lse)
    _close(parts[0][0] + parts[1][0], whole[0])
    _close(torch.cat([parts[0][1], parts[1][1]], dim=2), whole[1])
    _close(torch.cat([parts[0][2], parts[1][2]], dim=2), whole[2])
    ref = _autograd(lambda q, k, v: _explicit_masked(q, k, v, mask_all), q, k_all, v_all, dout)
    for got, want in zip((whole_out, *whole), ref, strict=True):
        _close(got, want)


# ------------------------------------------------------------------ segmented fast path


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("positions", [ContiguousLayout(16, 1).positions(0), ZIG.positions(0)],
                         ids=["contiguous", "zigzag"])
def test_segmented_path_equals_masked_math(hq, hkv, positions):
    docs = DocumentMask.from_ids(IDS)
    assert docs.segments_are_exact(positions)
    segs = docs.segments(positions)
    mask = docs.visible(positions, positions)
    q, k, v, dout = _tensors(2, hq, hkv, positions.numel(), positions.numel(), seed=5)
    out, lse = segmented_causal_forward(q, k, v, SCALE, segs)
    want_out, want_lse = masked_forward(q, k, v, SCALE, mask)
    _close(out, want_out)
    _close(lse, want_lse)
    # Backward from a merged out/lse (a larger attention this block is part of).
    merged_out = torch.randn_like(out)
    merged_lse = lse + torch.rand_like(lse)
    got = segmented_causal_backward(dout, q, k, v, merged_out, merged_lse, SCALE, segs)
    want = masked_backward(dout, q, k, v, merged_out, merged_lse, SCALE, mask)
    for g, w in zip(got, want, strict=True):
        _close(g, w)


def test_segmented_path_refuses_segments_that_do_not_tile():
    q, k, v, _ = _tensors(1, 2, 2, 8, 8)
    with pytest.raises(ValueError, match="do not tile"):
        segmented_causal_forward(q, k, v, SCALE, [[(0, 4), (5, 8)]])


class _Mesh:
    """A 1-D CP mesh of 2 without processes, named ``name`` (``ring``: the zigzag ring layout)."""

    ndim = 1

    def __init__(self, name: str) -> None:
        self.mesh_dim_names = (name,)

    def size(self, dim=None):
        return 2


def test_document_mask_runs_under_the_1d_meshes_and_refuses_ring_layouts_for_now():
    from titan_upipe.attention.documents import DocumentMaskedBackend, document_mask, masked_backend

    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2]])
    assert document_mask(ids, _Mesh("cp")).seq_len == 8
    with pytest.raises(ConfigError, match="ulysses and upipe .* only so far"):
        document_mask(ids, _Mesh("ring"))
    with pytest.raises(ConfigError, match="only so far"):
        masked_backend(document_mask(ids), SdpaBackend(), ring_degree=2, seq_len=8)
    backend = masked_backend(document_mask(ids), SdpaBackend(), ring_degree=1, seq_len=8)
    assert isinstance(backend, DocumentMaskedBackend) and backend.segments == [[(0, 2), (2, 5), (5, 8)]]
    assert masked_backend(None, backend.inner, ring_degree=2, seq_len=8) is backend.inner
