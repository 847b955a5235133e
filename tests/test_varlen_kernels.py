"""The flash-attn backends' varlen (``cu_seqlens``) path for packed documents, on CPU.

No GPU here, so the three flash-attn packages are replaced by fake modules under their real
import names whose internals have the real names, argument names and tensor layouts (packed
``[T, H, D]``, varlen LSE ``[H, T]``, dense ``[B, S, H, D]`` with LSE ``[B, H, S]``, gradients
written into given buffers where the real one does so, FA3's ``is_causal``, FA2's internals as
``torch.library`` custom ops) and compute exact fp32 attention. What runs for real is the
backends' packing, argument binding and LSE normalisation, and ``documents.py``'s batching of
every document of every row into one call:

* ``segmented_causal_forward/backward`` through the varlen path equal the per-document loop
  and ``masked_forward/backward`` under ``DocumentMask.visible`` to 1e-5 in fp32 (MHA, GQA,
  batch 2 split differently, 1-token documents), in one kernel call each way;
* the backward honours a merged out/lse it is given;
* a varlen LSE in the wrong layout is refused ([T, H], or padded per sequence as flash-attn
  before 2.6) or, when it has the right shape but scrambled values, fails the comparison;
* ``varlen_contract.check_varlen`` (the GPU suite's check) passes on the fakes in bf16 and fails
  on the scrambled one; ``document_kernel_problem`` refuses kernels without varlen on CUDA only.
"""

import functools
import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from titan_upipe.attention import flash_backends
from titan_upipe.attention.backends import (
    FlashAttn2Backend,
    FlashAttn3Backend,
    FlashAttn4Backend,
    MathBackend,
    SdpaBackend,
)
from titan_upipe.attention.documents import (
    _loop_backward,
    _loop_forward,
    document_kernel_problem,
    masked_backward,
    masked_forward,
    segmented_causal_backward,
    segmented_causal_forward,
)
from titan_upipe.contracts.varlen import VarlenCase, check_varlen, document_ids
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.document_mask import DocumentMask
from titan_upipe.tools import gpu_kernels

Tensor = torch.Tensor
SCALE = 0.3
LENGTHS = [[1, 12, 1, 50], [40, 23, 1]]
"""Batch 2, split differently; 1-token documents first, in the middle and last."""
SEQ_LEN = 64
CALLS: dict[str, int] = {}


# --- exact fp32 attention in flash-attn's packed layout ---------------------------------------------


def _sequence_of_tokens(cu_seqlens: Tensor, total: int, max_seqlen: int) -> Tensor:
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    assert cu_seqlens.dtype == torch.int32 and int(cu_seqlens[0]) == 0 and int(cu_seqlens[-1]) == total
    assert int(lengths.min()) > 0 and int(lengths.max()) == max_seqlen, "max_seqlen must be the longest"
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths.long())


def _probabilities(q: Tensor, k: Tensor, scale: float, seq: Tensor, causal: bool, lse: Tensor | None):
    """``P [H, T, T]`` and ``lse [H, T]``: key j visible to query i iff same sequence (and j <= i)."""
    n_rep = q.shape[1] // k.shape[1]
    scores = torch.einsum("ihd,jhd->hij", q.float(), k.float().repeat_interleave(n_rep, 1)) * scale
    visible = seq[:, None] == seq[None, :]
    if causal:
        visible &= torch.ones_like(visible).tril()
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) if lse is None else lse
    return torch.exp(scores - lse[..., None]), lse


def _packed_forward(q, k, v, scale, seq, causal):
    probs, lse = _probabilities(q, k, scale, seq, causal, None)
    out = torch.einsum("hij,jhd->ihd", probs, v.float().repeat_interleave(q.shape[1] // k.shape[1], 1))
    return out.to(q.dtype), lse


def _packed_backward(dout, q, k, v, out, lse, scale, seq, causal):
    """The merged-out/lse gradient (flash-attn's): P from the given lse, delta from the given out."""
    n_rep = q.shape[1] // k.shape[1]
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    probs, _ = _probabilities(q, k, scale, seq, causal, lse)
    do, vf = dout.float(), v.float().repeat_interleave(n_rep, 1)
    delta = (do * out.float()).sum(-1).t()  # [H, T]
    dscores = probs * (torch.einsum("ihd,jhd->hij", do, vf) - delta[..., None])
    dq = torch.einsum("hij,jhd->ihd", dscores, k.float().repeat_interleave(n_rep, 1)) * scale
    dk = torch.einsum("hij,ihd->jhd", dscores, q.float()) * scale
    dv = torch.einsum("hij,ihd->jhd", probs, do)

    def fold(g):  # GQA: each KV head's gradient summed over its query heads
        return g.view(g.shape[0], k.shape[1], n_rep, g.shape[-1]).sum(2)

    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


def _rows(t: Tensor) -> Tensor:
    """Dense ``[B, S, H, D]`` as packed ``[B*S, H, D]``."""
    return t.reshape(-1, *t.shape[2:])


def _dense_forward(q, k, v, scale, causal):
    """Dense flash layout: ``q [B, S, H, D] -> out [B, S, H, D], lse [B, H, S]``."""
    assert q.dim() == 4 and q.stride(-1) == 1
    b, s, h, _ = q.shape
    out, lse = _packed_forward(_rows(q), _rows(k), _rows(v), scale, torch.arange(b).repeat_interleave(s), causal)
    return out.view(q.shape), lse.view(h, b, s).transpose(0, 1).contiguous()


def _dense_backward(dout, q, k, v, out, lse, scale, causal):
    b, s, h, _ = q.shape
    assert lse.shape == (b, h, s)
    seq = torch.arange(b).repeat_interleave(s)
    packed_lse = lse.transpose(0, 1).reshape(h, b * s)
    grads = _packed_backward(_rows(dout), _rows(q), _rows(k), _rows(v), _rows(out), packed_lse, scale, seq, causal)
    return [g.view(t.shape) for g, t in zip(grads, (q, k, v), strict=True)]


def _count(name: str) -> None:
    CALLS[name] = CALLS.get(name, 0) + 1


# --- flash-attn 2: flash_attn.flash_attn_interface (varlen internals are custom ops there) ------------


def _fa2_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                 alibi_slopes, return_softmax):
    _count("dense_forward")
    out, lse = _dense_forward(q, k, v, softmax_scale, causal)
    return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)


def _fa2_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
                  window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    _count("dense_backward")
    for buf, grad in zip((dq, dk, dv), _dense_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal),
                         strict=True):
        buf.copy_(grad)
    return torch.empty(0)


def _fa2_varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int = -1,
    window_size_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    return_softmax: bool = False, block_table: Tensor | None = None, leftpad_k: Tensor | None = None,
    seqused_k: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _count("varlen_forward")
    assert q.dim() == 3 and q.stride(-1) == 1 and torch.equal(cu_seqlens_q, cu_seqlens_k)
    seq = _sequence_of_tokens(cu_seqlens_q, q.shape[0], max_seqlen_q)
    out, lse = _packed_forward(q, k, v, softmax_scale, seq, causal)
    return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)


def _fa2_varlen_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, dq: Tensor | None,
    dk: Tensor | None, dv: Tensor | None, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
    window_size_right: int, softcap: float, alibi_slopes: Tensor | None, deterministic: bool,
    rng_state: Tensor | None = None,
) -> Tensor:
    _count("varlen_backward")
    seq = _sequence_of_tokens(cu_seqlens_q, q.shape[0], max_seqlen_q)
    for buf, grad in zip((dq, dk, dv), _packed_backward(dout, q, k, v, out, softmax_lse, softmax_scale, seq, causal),
                         strict=True):
        buf.copy_(grad)
    return torch.empty(0)


@functools.cache
def _fa2_custom_ops():
    """Registered once per process, as flash-attn 2.6+ registers its own on torch >= 2.4."""
    return (torch.library.custom_op("titan_upipe_tests::fa2_varlen_fwd", _fa2_varlen_forward, mutates_args=()),
            torch.library.custom_op("titan_upipe_tests::fa2_varlen_bwd", _fa2_varlen_backward,
                                    mutates_args=("dq", "dk", "dv")))


def _fa2_module(varlen_forward=None) -> types.ModuleType:
    fwd_op, bwd_op = _fa2_custom_ops()
    return types.SimpleNamespace(_flash_attn_forward=_fa2_forward, _flash_attn_backward=_fa2_backward,
                                 _flash_attn_varlen_forward=varlen_forward or fwd_op,
                                 _flash_attn_varlen_backward=bwd_op)


# --- flash-attn 3: flash_attn_interface (one forward and one backward, varlen with cu_seqlens) --------


def _fa3_forward(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
                 softmax_scale=None, causal=False, window_size_left=-1, window_size_right=-1, attention_chunk=0,
                 softcap=0.0, num_splits=1, pack_gqa=None, sm_margin=0):
    if cu_seqlens_q is None:
        _count("dense_forward")
        out, lse = _dense_forward(q, k, v, softmax_scale, causal)
    else:
        _count("varlen_forward")
        seq = _sequence_of_tokens(cu_seqlens_q, q.shape[0], max_seqlen_q)
        out, lse = _packed_forward(q, k, v, softmax_scale, seq, causal)
    return out, lse, torch.empty(0), torch.empty(0)


def _fa3_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None,
                  sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None, softmax_scale=None,
                  is_causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False,
                  sm_margin=0):
    if cu_seqlens_q is None:
        _count("dense_backward")
        grads = _dense_backward(dout, q, k, v, out, softmax_lse, softmax_scale, is_causal)
    else:
        _count("varlen_backward")
        seq = _sequence_of_tokens(cu_seqlens_q, q.shape[0], max_seqlen_q)
        grads = _packed_backward(dout, q, k, v, out, softmax_lse, softmax_scale, seq, is_causal)
    for buf, grad in zip((dq, dk, dv), grads, strict=True):
        buf.copy_(grad)
    return torch.empty(0)


# --- FlashAttention-4: flash_attn.cute.interface -------------------------------------------------------


def _fa4_forward(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
                 causal=False, softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None,
                 num_splits=1, pack_gqa=None, return_lse=False, out=None, lse=None):
    if cu_seqlens_q is None:
        _count("dense_forward")
        res, lse_ = _dense_forward(q, k, v, softmax_scale, causal)
    else:
        _count("varlen_forward")
        seq = _sequence_of_tokens(cu_seqlens_q, q.shape[0], max_seqlen_q)
        res, lse_ = _packed_forward(q, k, v, softmax_scale, seq, causal)
    return res, lse_ if return_lse else None, None, None, None


def _fa4_backward(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
                  window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                  max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None):
    if cu_seqlens_q is None:
        _count("dense_backward")
        return tuple(_dense_backward(dout, q, k, v, out, lse, softmax_scale, causal))
    _count("varlen_backward")
    seq = _sequence_of_tokens(cu_seqlens_q, q.shape[0], max_seqlen_q)
    return _packed_backward(dout, q, k, v, out, lse, softmax_scale, seq, causal)


FAKE_MODULES = {
    FlashAttn2Backend: lambda: _fa2_module(),
    FlashAttn3Backend: lambda: types.SimpleNamespace(_flash_attn_forward=_fa3_forward,
                                                     _flash_attn_backward=_fa3_backward),
    FlashAttn4Backend: lambda: types.SimpleNamespace(_flash_attn_fwd=_fa4_forward, _flash_attn_bwd=_fa4_backward),
}
BACKEND_CLASSES = list(FAKE_MODULES)


@pytest.fixture
def fake_flash(monkeypatch):
    """The three packages importable under their real module names, calls counted in ``CALLS``."""
    for cls, make in FAKE_MODULES.items():
        monkeypatch.setitem(sys.modules, cls.module_name, make())
    CALLS.clear()
    return CALLS


def _any_dtype(cls):
    """The backend class with its fp16/bf16 refusal lifted: the fakes compute exact fp32."""
    return type(f"AnyDtype{cls.__name__}", (cls,), {"dtypes": None})()


# --- inputs and the comparisons ------------------------------------------------------------------------


def _inputs(n_heads: int, n_kv_heads: int, dtype=torch.float32, head_dim: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def rand(heads):  # [B, S, H, D] transposed to [B, H, S, D], as the projections hand them over
        return torch.randn(2, SEQ_LEN, heads, head_dim, generator=gen).to(dtype).transpose(1, 2)

    return rand(n_heads), rand(n_kv_heads), rand(n_kv_heads), rand(n_heads).contiguous()


def _documents():
    mask = DocumentMask.from_ids(document_ids(LENGTHS))
    positions = torch.arange(SEQ_LEN)
    return mask.document_segments, mask.visible(positions, positions)


def _close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def _assert_matches(backend, q, k, v, dout) -> None:
    """Varlen path == per-document loop == exact masked attention, forward and backward."""
    segments, visible = _documents()
    out, lse = segmented_causal_forward(q, k, v, SCALE, segments, backend)
    ref_out, ref_lse = masked_forward(q, k, v, SCALE, visible)
    loop_out, loop_lse = _loop_forward(q, k, v, SCALE, segments, backend)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    for got, ref, loop, name in ((out, ref_out, loop_out, "out"), (lse, ref_lse, loop_lse, "lse")):
        _close(got, ref, f"{name} vs masked")
        _close(got, loop, f"{name} vs loop")
    grads = segmented_causal_backward(dout, q, k, v, out, lse, SCALE, segments, backend)
    ref_grads = masked_backward(dout, q, k, v, ref_out, ref_lse, SCALE, visible)
    loop_grads = _loop_backward(dout, q, k, v, loop_out, loop_lse, SCALE, segments, backend)
    for name, got, ref, loop, like in zip(("dq", "dk", "dv"), grads, ref_grads, loop_grads, (q, k, v), strict=True):
        assert got.shape == like.shape and got.dtype == like.dtype
        _close(got, ref, f"{name} vs masked")
        _close(got, loop, f"{name} vs loop")


# --- the varlen path ---------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["MHA", "GQA"])
@pytest.mark.parametrize("cls", BACKEND_CLASSES, ids=lambda c: c.name)
def test_varlen_path_equals_the_loop_and_masked_attention(fake_flash, cls, heads):
    backend = _any_dtype(cls)
    q, k, v, dout = _inputs(*heads)
    segments, _ = _documents()
    out, lse = segmented_causal_forward(q, k, v, SCALE, segments, backend)
    segmented_causal_backward(dout, q, k, v, out, lse, SCALE, segments, backend)
    # every document of both rows in one call each way, no dense call
    assert fake_flash == {"varlen_forward": 1, "varlen_backward": 1}
    _assert_matches(backend, q, k, v, dout)


@pytest.mark.parametrize("cls", BACKEND_CLASSES, ids=lambda c: c.name)
def test_varlen_backward_uses_the_merged_out_and_lse(fake_flash, cls):
    """As a ring's diagonal block: out/lse merged with another key block, not this block's own."""
    backend = _any_dtype(cls)
    q, k, v, dout = _inputs(8, 2, seed=1)
    segments, visible = _documents()
    out, lse = segmented_causal_forward(q, k, v, SCALE, segments, backend)
    gen = torch.Generator().manual_seed(2)
    other_out, other_lse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    merged_lse = torch.logaddexp(lse, other_lse)
    merged_out = out * torch.exp(lse - merged_lse)[..., None] + other_out * torch.exp(other_lse - merged_lse)[..., None]
    got = segmented_causal_backward(dout, q, k, v, merged_out, merged_lse, SCALE, segments, backend)
    ref = masked_backward(dout, q, k, v, merged_out, merged_lse, SCALE, visible)
    own = masked_backward(dout, q, k, v, out, lse, SCALE, visible)
    for name, g, r, o in zip(("dq", "dk", "dv"), got, ref, own, strict=True):
        _close(g, r, name)
        assert (g - o).abs().max() > 1e-2  # the merged lse changes the answer: it was used


# --- a wrong LSE layout is caught ---------------------------------------------------------------------


def _sabotaged_fa2(monkeypatch, transform) -> None:
    """flash-attn 2 whose varlen forward hands back ``transform(lse, kwargs)`` instead of ``[H, T]``."""
    @functools.wraps(_fa2_varlen_forward)
    def forward(**kwargs):
        out, lse, *rest = _fa2_varlen_forward(**kwargs)
        return (out, transform(lse, kwargs), *rest)

    monkeypatch.setitem(sys.modules, FlashAttn2Backend.module_name, _fa2_module(forward))


def _padded(lse: Tensor, kwargs: dict) -> Tensor:
    """flash-attn < 2.6: ``[N, H, max_seqlen]``, each sequence's rows from 0, padding after."""
    cu, longest = kwargs["cu_seqlens_q"].tolist(), kwargs["max_seqlen_q"]
    padded = torch.full((len(cu) - 1, lse.shape[0], longest), float("inf"))
    for n, (start, stop) in enumerate(zip(cu, cu[1:], strict=False)):
        padded[n, :, : stop - start] = lse[:, start:stop]
    return padded


@pytest.mark.parametrize("transform, layout", [
    (lambda lse, kw: lse.t().contiguous(), r"\(128, 8\)"),  # token-major [T, H]
    (_padded, r"\(7, 8, 50\)"),
])
def test_varlen_lse_of_another_shape_is_refused(fake_flash, monkeypatch, transform, layout):
    _sabotaged_fa2(monkeypatch, transform)
    q, k, v, _ = _inputs(8, 2)
    with pytest.raises(ConfigError, match=rf"flash_attn's varlen forward returned lse of shape {layout}, expected "
                                          r"\[heads, tokens\] = \(8, 128\).*before 2.6"):
        segmented_causal_forward(q, k, v, SCALE, _documents()[0], _any_dtype(FlashAttn2Backend))


def _scrambled(lse: Tensor, kwargs: dict) -> Tensor:
    """The right shape, token-major values: what reshaping a ``[T, H]`` LSE to ``[H, T]`` gives."""
    return lse.t().contiguous().reshape(lse.shape)


def test_a_scrambled_lse_of_the_right_shape_fails_the_comparison(fake_flash, monkeypatch):
    """The sabotage case: the comparison of the test above fails on it."""
    _sabotaged_fa2(monkeypatch, _scrambled)
    with pytest.raises(AssertionError, match="lse vs masked"):
        _assert_matches(_any_dtype(FlashAttn2Backend), *_inputs(8, 2))


# --- the GPU suite's check, run here on the fakes --------------------------------------------------------


def test_gpu_suite_varlen_check_passes_on_the_fakes_in_bf16(fake_flash):
    case = VarlenCase(8, 2, torch.bfloat16, seq_len=64)
    for cls in BACKEND_CLASSES:
        result = check_varlen(cls(), case, "cpu")
        assert result.ok, (cls.name, result)
        assert any(1 in row for row in result.lengths) and result.lengths[0] != result.lengths[1]


def test_gpu_suite_varlen_check_fails_on_a_scrambled_lse(fake_flash, monkeypatch):
    _sabotaged_fa2(monkeypatch, _scrambled)
    result = check_varlen(FlashAttn2Backend(), VarlenCase(8, 2, torch.bfloat16, seq_len=64), "cpu")
    assert not result.ok and result.varlen["lse"] > 100 * result.allowed["lse"]
    assert result.loop["lse"] <= result.allowed["lse"]  # the per-document yardstick itself is fine


def test_gpu_suite_reports_a_raising_kernel_as_failed_and_goes_on(fake_flash, monkeypatch):
    calls = []

    def refuse(self, *args, **kwargs):
        calls.append(1)
        raise AssertionError("varlen backward is not yet supported on sm90")

    monkeypatch.setattr(FlashAttn4Backend, "varlen_backward", refuse)
    monkeypatch.setattr(gpu_kernels, "varlen_cases", lambda dtype: [VarlenCase(4, 4, dtype, seq_len=32),
                                                                     VarlenCase(8, 2, dtype, seq_len=32)])
    results = gpu_kernels.varlen_backend_checks(FlashAttn4Backend(), "cpu")
    assert len(results) == len(calls) == 2 and not any(r["ok"] for r in results)
    assert "AssertionError: varlen backward is not yet supported on sm90" in results[0]["detail"]
    ok = gpu_kernels.varlen_backend_checks(FlashAttn2Backend(), "cpu")
    assert all(r["ok"] and r["check"] == "varlen" for r in ok), ok
    assert "worst" in ok[0]["detail"] and "documents [[" in ok[0]["detail"]


def test_gpu_suite_skips_the_varlen_check_without_the_kernels():
    results = gpu_kernels.varlen_checks("cpu")
    assert [r["case"] for r in results] == ["flash_attn4", "flash_attn3", "flash_attn"]
    assert all(r["skipped"] and r["ok"] and r["detail"] for r in results)


# --- who may run documents where -------------------------------------------------------------------------


def test_document_kernel_problem_refuses_kernels_without_varlen_on_cuda_only():
    for backend in (SdpaBackend(), MathBackend, MathBackend()):
        message = document_kernel_problem(backend, "cuda")
        assert message.startswith(f"attention backend {backend.name!r} has no varlen (cu_seqlens) kernel")
        assert "one of flash_attn4, flash_attn3, flash_attn" in message
        assert "install one of flash-attn-4, flash_attn_3, flash-attn with pip" in message and "\n" not in message
        assert document_kernel_problem(backend, "cpu") is None  # the loop is the exact CPU path
        assert document_kernel_problem(backend, "meta") is None
    for cls in BACKEND_CLASSES:
        assert document_kernel_problem(cls, "cuda") is None and document_kernel_problem(cls(), "cuda") is None


def test_documents_on_cuda_tensors_without_varlen_raise_before_any_kernel():
    with FakeTensorMode():
        q = torch.empty(1, 2, 8, 4, device="cuda")
    for backend in (None, MathBackend()):
        with pytest.raises(ConfigError, match="has no varlen .* one of flash_attn4"):
            segmented_causal_forward(q, q, q, SCALE, [[(0, 3), (3, 8)]], backend)


def test_backends_without_varlen_refuse_varlen_calls():
    t = torch.zeros(4, 1, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ConfigError, match="'math' has no varlen"):
        MathBackend().varlen_forward(t, t, t, SCALE, cu, 4)
    with pytest.raises(ConfigError, match="'sdpa' has no varlen"):
        SdpaBackend().varlen_backward(t, t, t, t, t, t[:, 0].t(), SCALE, cu, 4)
    assert not SdpaBackend.varlen and not MathBackend.varlen and all(c.varlen for c in BACKEND_CLASSES)


def test_flash_varlen_refuses_fp32_at_the_call(fake_flash):
    t = torch.zeros(4, 1, 8)
    with pytest.raises(ConfigError, match="not float32"):
        FlashAttn2Backend().varlen_forward(t, t, t, SCALE, torch.tensor([0, 4], dtype=torch.int32), 4)


# --- binding arguments by name ----------------------------------------------------------------------------


def test_call_by_name_reads_the_signature_behind_a_custom_op():
    fwd_op, _ = _fa2_custom_ops()
    assert isinstance(fwd_op, torch._library.custom_ops.CustomOpDef)
    assert flash_backends._python_function(fwd_op) is _fa2_varlen_forward


def test_call_by_name_refuses_a_release_that_would_drop_the_sequence_boundaries():
    def dense_only(q, k, v, softmax_scale=None, causal=False):
        return q

    with pytest.raises(ConfigError, match=r"dense_only takes no \['cu_seqlens_q', 'cu_seqlens_k'\]"):
        flash_backends._call_by_name(dense_only, {"q": 1, "k": 2, "v": 3, "softmax_scale": 0.1, "causal": True,
                                            "cu_seqlens_q": 4, "cu_seqlens_k": 4})

    def renamed_causal(q, softmax_scale=None, is_causal=False):
        return is_causal

    assert flash_backends._call_by_name(renamed_causal, {"q": 1, "softmax_scale": 0.1, "causal": True, "is_causal": True})
    with pytest.raises(ConfigError, match=r"takes no \['causal'\]"):
        flash_backends._call_by_name(lambda q, softmax_scale=None: q, {"q": 1, "softmax_scale": 0.1, "causal": True})
