"""Packed documents (issue 17 foundation): document rules, visibility, block kinds, exact masked
kernels and the segmented SDPA fast path, all in one process on CPU."""

import pytest
import torch
import torch.nn.functional as F

from titan_upipe.attention.documents import (
    masked_backward,
    masked_forward,
    segmented_causal_backward,
    segmented_causal_forward,
)
from titan_upipe.attention.ring import merge_partial
from titan_upipe.attention.ring_plan import BlockKind, causal_block_kind
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.document_mask import DocumentMask
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


def test_merge_partial_keeps_empty_rows_empty_and_others_bit_for_bit():
    """A row that sees no key in either block stays out = 0, lse = -inf (the plain formula gives
    NaN there: exp(-inf - -inf)); every other row is the plain formula's arithmetic, bit for bit."""
    out_acc, lse_acc = torch.zeros(1, 1, 2, 3), torch.full((1, 1, 2), float("-inf"))
    out, lse = torch.zeros(1, 1, 2, 3), torch.tensor([[[float("-inf"), 0.5]]])
    out[0, 0, 1] = 1.0
    merge_partial(out_acc, lse_acc, out, lse)
    assert (out_acc[0, 0, 0] == 0).all() and torch.isneginf(lse_acc[0, 0, 0])
    assert torch.equal(out_acc[0, 0, 1], torch.ones(3)) and lse_acc[0, 0, 1] == 0.5
    naive = torch.zeros(1, 1, 2, 3)
    naive_lse = torch.logaddexp(torch.full((1, 1, 2), float("-inf")), lse)
    naive = naive * torch.exp(torch.full((1, 1, 2), float("-inf")) - naive_lse).unsqueeze(-1) + out * torch.exp(
        lse - naive_lse).unsqueeze(-1)
    assert torch.isnan(naive[0, 0, 0]).all()  # why the guard exists
    gen = torch.Generator().manual_seed(0)
    acc, acc_lse = torch.randn(2, 4, 8, 16, generator=gen), torch.randn(2, 4, 8, generator=gen) * 5
    block, block_lse = torch.randn(2, 4, 8, 16, generator=gen).bfloat16(), torch.randn(2, 4, 8, generator=gen) * 5
    plain_lse = torch.logaddexp(acc_lse, block_lse)
    plain = acc * torch.exp(acc_lse - plain_lse).unsqueeze(-1) + block.float() * torch.exp(
        block_lse - plain_lse).unsqueeze(-1)
    merge_partial(acc, acc_lse, block, block_lse)
    assert torch.equal(acc, plain) and torch.equal(acc_lse, plain_lse)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)], ids=["mha", "gqa"])
def test_merged_lse_backward_sums_to_the_whole(hq, hkv):
    """Two key blocks, forward merged with merge_partial, each block's backward from the
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
        merge_partial(out_acc, lse_acc, *masked_forward(q, k, v, SCALE, mask))
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


def test_document_mask_checks_the_layout_and_masks_their_length():
    from titan_upipe.parallel.document_mask import check_attention_masks, document_mask

    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2]])
    assert document_mask(ids, _Mesh("cp")).seq_len == 8
    assert document_mask(ids, _Mesh("ring")).seq_len == 8  # zigzag over 2 ranks: 4 chunks of 2
    with pytest.raises(ConfigError, match="not divisible"):
        document_mask(ids[:, :6], _Mesh("ring"))  # 6 tokens do not make 4 zigzag chunks
    mask = document_mask(ids)
    assert check_attention_masks(None, 8) is None and check_attention_masks(mask, 8) is mask
    assert mask.document_segments == [[(0, 2), (2, 5), (5, 8)]]
    with pytest.raises(ConfigError, match="covers 8 tokens but the sequence has 16"):
        check_attention_masks(mask, 16)
    with pytest.raises(ConfigError, match="document_mask"):
        check_attention_masks(torch.ones(8, 8, dtype=torch.bool), 8)


def _ring_local_positions(runs) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in runs])


def _plan_coverage(calls, ring_len: int, batch: int) -> torch.Tensor:
    """``[B, S_r, S_r]`` int: how many calls cover each (ring-local query, held key) pair."""
    from titan_upipe.attention.ring_plan import DiagonalCall

    cover = torch.zeros(batch, ring_len, ring_len, dtype=torch.long)
    for call in calls:
        if isinstance(call, DiagonalCall):
            for row, runs in enumerate(call.segments):
                for a, c in runs:
                    cover[row, a:c, a:c] += _plain_causal_long(c - a)
        else:
            cover[call.row, call.q[0]:call.q[1], call.kv[0]:call.kv[1]] += 1
    return cover


def _plain_causal_long(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.long).tril()


def _random_document_ids(ring: int, seq: int) -> torch.Tensor:
    """Three rows: a few long documents behind a 1-token one, many short documents, one document."""
    gen = torch.Generator().manual_seed(ring)
    ids = torch.zeros(3, seq, dtype=torch.long)
    for row, n_splits in ((0, 3), (1, seq // 3)):
        for start in torch.randperm(seq - 1, generator=gen)[:n_splits] + 1:
            ids[row, int(start):] += 1
    ids[0, 1:] += 1  # a 1-token document at position 0
    return ids


@pytest.mark.parametrize("balance", ["zigzag", "documents"])
@pytest.mark.parametrize("ring", [1, 2, 3, 4])
def test_document_ring_plan_covers_exactly_the_visible_pairs(ring, balance):
    """Over every rank and step, the plan's calls cover each visible (query, key) pair exactly once
    and nothing else, in the fixed zigzag and in the batch's document-aware layout (min_split 6:
    long documents zigzagged inside themselves, short ones dealt whole or split at a rank's end):
    ids with 1-token documents, documents across chunk and rank boundaries, one row that is a
    single document (the causal plan's blocks)."""
    from titan_upipe.attention.ring_plan import RectangleCall, document_step_calls, kv_source

    seq = 2 * ring * 5
    mask = DocumentMask.from_ids(_random_document_ids(ring, seq))
    if balance == "documents":
        mask = mask.balanced(ring, 1, min_split=6)
        assert mask.ring_runs(ring) != DocumentMask.from_ids(mask.doc).ring_runs(ring) or ring == 1
    ring_runs = mask.ring_runs(ring)
    rectangles = 0
    for rank in range(ring):
        q_pos = [_ring_local_positions(runs[rank]) for runs in ring_runs]
        for step in range(ring):
            calls = document_step_calls(rank, ring, step, ring_runs, mask.document_segments)
            rectangles += sum(isinstance(c, RectangleCall) for c in calls)
            source = kv_source(rank, ring, step)
            cover = _plan_coverage(calls, seq // ring, 3)
            for row, runs in enumerate(ring_runs):
                visible = DocumentMask(mask.doc[row:row + 1]).visible(q_pos[row], _ring_local_positions(runs[source]))
                assert torch.equal(cover[row], visible[0].long()), (rank, step, row)
    assert ring == 1 or rectangles > 0


def test_document_ring_plan_fails_on_a_wrong_layout():
    """The coverage check above is not vacuous: the document-aware layout's plan read with the fixed
    zigzag's positions (a rank sharded the old way) covers other pairs than the visible ones."""
    from titan_upipe.attention.ring_plan import document_step_calls

    ring, seq = 2, 20
    mask = DocumentMask.from_ids(_random_document_ids(ring, seq)).balanced(ring, 1, min_split=6)
    zigzag = DocumentMask.from_ids(mask.doc).ring_runs(ring)
    calls = document_step_calls(1, ring, 1, mask.ring_runs(ring), mask.document_segments)
    visible = DocumentMask(mask.doc[:1]).visible(_ring_local_positions(zigzag[0][1]), _ring_local_positions(zigzag[0][0]))
    assert not torch.equal(_plan_coverage(calls, seq // ring, 3)[0], visible[0].long())


def test_document_ring_plan_skips_blocks_with_no_visible_key():
    """Two documents, each within one ring rank's chunks, at R = 2: no rectangle crosses them."""
    from titan_upipe.attention.ring_plan import RectangleCall, document_step_calls
    from titan_upipe.spec.document_deal import zigzag_ring_runs

    documents = [[(0, 4), (4, 8)]]  # chunks of 2 tokens: rank 0 holds chunks 0, 3; rank 1 chunks 1, 2
    runs = [zigzag_ring_runs(8, 2)]
    calls = document_step_calls(1, 2, 1, runs, documents)  # rank 1 holds rank 0's K/V (chunks 0, 3)
    assert calls == (RectangleCall(0, (0, 2), (0, 2)),)  # chunk 1 sees chunk 0 (document 0)
    assert document_step_calls(0, 2, 1, runs, documents) == (RectangleCall(0, (2, 4), (2, 4)),)
    assert document_step_calls(0, 2, 1, runs, [[(0, 2), (2, 6), (6, 8)]]) == ()  # chunk 3 starts document 2


def test_document_ring_plan_of_the_docstring_layout():
    """``ring_plan``'s docstring example, call by call (DocumentZigzagLayout's own example)."""
    from titan_upipe.attention.ring_plan import DiagonalCall, RectangleCall, document_step_calls
    from titan_upipe.parallel.document_layout import DocumentZigzagLayout

    # issue 35's deal of documents [10, 2, 4] over 2 ring ranks (since issue 42 the job's layout splits
    # the 4-token document for balance: DocumentZigzagLayout's docstring)
    layout = DocumentZigzagLayout(16, 2, 1, (((0, 3), (8, 13)), ((3, 8), (13, 16))))
    runs, documents = [layout.ring_runs], [[(0, 10), (10, 12), (12, 16)]]
    assert document_step_calls(0, 2, 0, runs, documents) == (DiagonalCall((((0, 5), (5, 7), (7, 8)),)),)
    assert document_step_calls(1, 2, 0, runs, documents) == (DiagonalCall((((0, 5), (5, 8)),)),)
    assert document_step_calls(0, 2, 1, runs, documents) == (RectangleCall(0, (3, 5), (0, 5)),)
    assert document_step_calls(1, 2, 1, runs, documents) == (RectangleCall(0, (0, 5), (0, 3)),
                                                             RectangleCall(0, (5, 8), (7, 8)))


def test_segment_tables_are_built_once_per_mask_and_device():
    """Every layer and stage of a step reads the same block segments: their table (and its varlen
    cu_seqlens on the device) is built once per mask, not once per kernel call."""
    from titan_upipe.parallel.document_mask import check_attention_masks, document_mask

    mask = document_mask(torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1]]))
    table = mask.table(mask.document_segments)
    assert mask.table([list(r) for r in mask.document_segments]) is table
    cu, longest = table.boundaries(8, torch.device("cpu"))
    assert cu.tolist() == [0, 2, 5, 8, 9, 16] and longest == 7
    assert table.boundaries(8, torch.device("cpu"))[0] is cu
    with pytest.raises(ConfigError, match="2 rows but the batch has 1"):
        check_attention_masks(mask, 8, batch=1)


def test_fsdp_input_casting_passes_the_mask_through_unchanged():
    """FSDP2 casts block inputs with ``torch.distributed.utils._apply_to_tensors``, which rebuilds
    dataclasses: the mask must reach every layer as the same object, its per-step caches intact."""
    from torch.distributed.utils import _apply_to_tensors

    from titan_upipe.parallel.document_mask import document_mask

    mask = document_mask(torch.tensor([[0, 0, 1, 1]]))
    segments = mask.document_segments
    assert _apply_to_tensors(lambda t: t.clone(), {"attention_masks": mask})["attention_masks"] is mask
    assert mask.document_segments is segments
