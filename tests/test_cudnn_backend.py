"""The ``cudnn`` backend (``titan_upipe.attention.cudnn_backend``) without a GPU.

* its Python honours the backend contract over a CPU emulation of the two aten ops
  (``aten_cudnn_emulation``), causal and full, GQA 4:1 and MHA, bf16, and binds to the real
  aten schemas on the meta device;
* it meets the ops' layout demands (out and dout of the same strides, a contiguous
  ``[B, H, S, 1]`` LSE) whatever layouts it is given;
* a backward that recomputes its block's softmax instead of using the given out/lse fails the
  contract check;
* every refusal is one ConfigError naming what, the valid choices and the fix: fp32, head_dim,
  no CUDA / no cuDNN / an old cuDNN / an unsupported GPU, and a masked call where cuDNN is known
  to compute NaN gradients (pytorch#196678).

On a GPU, ``tests/test_backend_contract.py::test_cuda_backends_honour_the_contract`` and the GPU
suite's kernels stage run the same contract on the real kernels (``cudnn`` is in ``AUTO_ORDER``).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from aten_cudnn_emulation import EmulatedAtenCudnn, emulated_cudnn_backend

from titan_upipe.attention import backends
from titan_upipe.attention.backends import AUTO_ORDER, CudnnBackend, choose_backend
from titan_upipe.attention.cudnn_backend import masked_call_problem
from titan_upipe.contracts.backend import check_contract, contract_cases
from titan_upipe.torchtitan_0_2.config import ConfigError

BF16_CASES = contract_cases((torch.bfloat16,))


def _qkv(heads: int = 8, kv_heads: int = 2, seq: int = 64, dim: int = 64, dtype=torch.bfloat16, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, seq, dim, generator=gen).to(device=device, dtype=dtype)
    k, v = (torch.randn(2, kv_heads, seq, dim, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    return q, k, v


# --- the contract, over the emulated kernels and on meta ------------------------------------


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: c.id)
def test_cudnn_python_honours_the_contract_over_emulated_kernels(case):
    result = check_contract(emulated_cudnn_backend(), case)
    assert result.ok, f"{case.id}: whole {result.whole}, split {result.split}, allowed {result.allowed}"


def test_emulated_cudnn_ops_match_the_aten_schemas():
    for op_name in EmulatedAtenCudnn.OPS:
        schema = getattr(torch.ops.aten, op_name).default._schema
        emulated = list(inspect.signature(getattr(EmulatedAtenCudnn, op_name)).parameters)
        assert emulated == [a.name for a in schema.arguments], op_name


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cudnn_binds_to_the_real_aten_ops_on_meta(dtype, causal):
    """torch's own meta kernels check the argument lists and types of every call the backend
    makes (forward, backward, the RNG placeholders' tiny forward), GQA 4:1."""
    backend = CudnnBackend()
    q, k, v = _qkv(seq=128, dtype=dtype, device="meta")
    out, lse = backend.forward(q, k, v, 0.125, causal)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, 8, 128) and lse.dtype == torch.float32
    dq, dk, dv = backend.backward(out, q, k, v, out, lse, 0.125, causal)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)  # GQA: dK/dV with Hkv heads
    assert dk.dtype == dtype


def test_cudnn_backward_meets_the_layout_demands_of_the_op():
    """out laid out [B, S, H, D] (a ring block's merged output, a transposed projection), dout
    contiguous, the LSE a strided view: the backend hands the op matching strides and a contiguous
    [B, H, S, 1] LSE, and the gradients are those of the plain layouts."""
    backend = emulated_cudnn_backend()
    q, k, v = _qkv()
    out, lse = backend.forward(q, k, v, 0.1, True)
    dout = torch.randn_like(out)
    expected = backend.backward(dout, q, k, v, out.contiguous(), lse.contiguous(), 0.1, True)
    out_bshd = out.transpose(1, 2).contiguous().transpose(1, 2)
    lse_strided = torch.stack([lse, lse], dim=-1)[..., 0]
    assert out_bshd.stride() != dout.stride() and not lse_strided.is_contiguous()
    got = backend.backward(dout, q, k, v, out_bshd, lse_strided, 0.1, True)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected, strict=True):
        assert torch.equal(g, e), name


def test_emulation_rejects_what_the_cudnn_op_rejects():
    """It would catch a backend that fed the op mismatched out/dout strides or the contract's
    [B, H, S] LSE, or ran fp32."""
    ops = EmulatedAtenCudnn()
    q, k, v = _qkv()
    out, lse, _, _, max_q, max_k, seed, offset, _ = ops._scaled_dot_product_cudnn_attention(q, k, v, None, True)
    assert lse.shape == (2, 8, 64, 1)
    args = (q, k, v, out, lse, seed, offset, None, None, None, max_q, max_k, 0.0, True)
    ops._scaled_dot_product_cudnn_attention_backward(out, *args)
    with pytest.raises(RuntimeError, match="same_strides"):
        ops._scaled_dot_product_cudnn_attention_backward(out.transpose(1, 2).contiguous().transpose(1, 2), *args)
    with pytest.raises(RuntimeError, match=r"not the forward's contiguous fp32 \[B, H, S, 1\]"):
        ops._scaled_dot_product_cudnn_attention_backward(out, q, k, v, out, lse[..., 0], *args[5:])
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        ops._scaled_dot_product_cudnn_attention(q.float(), k.float(), v.float(), None, True)


class RecomputingCudnn(CudnnBackend):
    """A backward that ignores the given out/lse: it recomputes its own block's softmax and feeds
    the kernel that (right for a block that is the whole attention, wrong inside ring)."""

    name = "cudnn-recompute"
    merged_backward = False

    def backward(self, dout, q, k, v, out, lse, scale, causal=True):
        own_out, own_lse = self.forward(q, k, v, scale, causal)
        return super().backward(dout, q, k, v, own_out, own_lse, scale, causal)


@pytest.mark.parametrize("case", BF16_CASES[:4], ids=lambda c: c.id)
def test_recompute_style_cudnn_backward_fails_the_contract(case):
    result = check_contract(RecomputingCudnn(ops=EmulatedAtenCudnn()), case)
    assert all(result.whole[n] <= result.allowed[n] for n in result.whole)  # right for the whole attention ...
    assert not result.ok  # ... wrong for a block of a larger one
    assert max(result.split[n] / result.allowed[n] for n in ("dq", "dk", "dv")) > 10


# --- refusals ------------------------------------------------------------------------------


def _pretend_cuda(monkeypatch, capability=(9, 0), cudnn_version=91900, built_with_cudnn=True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU nothing was measured on")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: built_with_cudnn)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn_version)


def test_cudnn_is_usable_on_an_h100_with_cudnn_9_19(monkeypatch):
    _pretend_cuda(monkeypatch)
    assert choose_backend("cudnn", torch.bfloat16, ring=True, head_dim=128).name == "cudnn"


def test_cudnn_refuses_fp32_with_the_fix(monkeypatch):
    _pretend_cuda(monkeypatch)
    with pytest.raises(ConfigError, match=r"'cudnn' is not usable here: cudnn runs float16, bfloat16 inputs, not "
                                          r"float32: train in bf16 \(training.mixed_precision_param"):
        choose_backend("cudnn", torch.float32)
    with pytest.raises(ConfigError, match="not float32"):
        emulated_cudnn_backend().forward(*_qkv(dtype=torch.float32), 0.1)


@pytest.mark.parametrize("head_dim, fix", [(76, "'sdpa'"), (192, "'sdpa'"), (256, "'flash_attn4' or 'sdpa'")])
def test_cudnn_refuses_a_head_dim_its_backward_does_not_run(monkeypatch, head_dim, fix):
    """The fix names the backends that do run that head_dim (FlashAttention-4 runs 256, not 76 or 192)."""
    _pretend_cuda(monkeypatch)
    with pytest.raises(ConfigError, match=rf"cudnn runs head_dim a multiple of 8 up to 128 .*, not {head_dim}: use "
                                          rf"attention_backend {fix}$"):
        choose_backend("cudnn", torch.bfloat16, head_dim=head_dim)
    monkeypatch.setattr(backends, "AUTO_ORDER", ("cudnn", "sdpa"))
    choice = choose_backend("auto", torch.bfloat16, head_dim=head_dim)  # passed over, never run
    assert choice.name == "sdpa" and f"not {head_dim}" in dict(choice.passed_over)["cudnn"]


@pytest.mark.parametrize("facts, message", [
    ({"built_with_cudnn": False}, r"needs a torch built with cuDNN .*: install a CUDA build of torch or use "
                                  r"attention_backend 'sdpa'"),
    ({"cudnn_version": 91400}, r"needs cuDNN >= 9\.15\.1 \(.*pytorch#169849\), torch loaded cuDNN 9\.14\.0: install "
                               r"a torch built with a newer cuDNN or use attention_backend 'flash_attn4' or 'sdpa'"),
    ({"capability": (7, 5)}, r"supports compute capability 8\.0 to 12\.1 .*, this GPU is 7\.5: use attention_backend "
                             r"'sdpa'"),
])
def test_cudnn_refuses_a_machine_it_cannot_run_on(monkeypatch, facts, message):
    _pretend_cuda(monkeypatch, **facts)
    with pytest.raises(ConfigError, match=r"'cudnn' is not usable here: cudnn " + message):
        choose_backend("cudnn", torch.bfloat16)


def test_cudnn_without_cuda_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="'cudnn' is not usable here: cudnn needs a CUDA device"):
        choose_backend("cudnn", torch.bfloat16)


def test_cudnn_probe_free_check_reads_only_the_build_flag(monkeypatch):
    """Before process groups (maybe a login node): no cuDNN library load, no CUDA query."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("CUDA queried"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: pytest.fail("CUDA queried"))
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: pytest.fail("cuDNN loaded"))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    assert choose_backend("cudnn", torch.bfloat16, probe=False, head_dim=128).name == "cudnn"
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="needs a torch built with cuDNN"):
        choose_backend("cudnn", torch.bfloat16, probe=False)


def test_auto_takes_cudnn_by_default_only_where_nothing_else_runs():
    """cuDNN's contract has run only over an emulation: unmeasured, it comes after sdpa (a GPU's
    measured ranking, after its contract there, promotes it: tests/test_gpu_attention.py)."""
    assert AUTO_ORDER == ("flash_attn4", "flash_attn3", "flash_attn", "sdpa", "cudnn")


# --- the masked-call guard (pytorch#196678) ------------------------------------------------


@pytest.mark.parametrize("capability, version, s_kv, bad", [
    ((9, 0), 91900, 64, True),
    ((9, 0), 91900, 704, True),
    ((9, 0), 92501, 192, True),
    ((9, 0), 91900, 128, False),
    ((9, 0), 91900, 100, False),
    ((9, 0), 92600, 64, False),
    ((8, 0), 91900, 64, False),
    ((10, 0), 91900, 64, False),
])
def test_masked_call_problem_names_the_nan_dq_case(capability, version, s_kv, bad):
    problem = masked_call_problem(capability, version, s_kv)
    assert (problem is not None) == bad
    if bad:
        assert f"(here {s_kv}; pytorch#196678, fixed in cuDNN 9.26.0)" in problem
        assert "use a torch with cuDNN >= 9.26 or attention_backend 'flash_attn4' or 'sdpa'" in problem


class _NoKernel:
    def __getattr__(self, name):
        def called(*args, **kwargs):
            raise AssertionError(f"{name} called: the mask reached the kernel")
        return called


def test_no_kernel_call_passes_a_mask_around_the_guard():
    """Both kernel calls route ``attn_bias`` through the guard: on an H100 with cuDNN 9.19 and 64
    keys a mask is refused before the op runs; with 128 keys it is handed to the op."""
    h100 = CudnnBackend(ops=_NoKernel(), device_facts=lambda device: ((9, 0), 91900))
    q, k, v = _qkv(seq=64)
    mask = torch.ones(64, 64, dtype=torch.bool)
    with pytest.raises(ConfigError, match="NaN dQ for a key length % 128 == 64"):
        h100._kernel_forward(q, k, v, 0.1, False, attn_bias=mask)
    seed = torch.zeros((), dtype=torch.int64)
    lse = torch.zeros(2, 8, 64, 1)
    with pytest.raises(ConfigError, match="NaN dQ for a key length % 128 == 64"):
        h100._kernel_backward(q, q, k, v, q, lse, seed, seed, 0.1, False, attn_bias=mask)
    emulated = CudnnBackend(ops=EmulatedAtenCudnn(), device_facts=lambda device: ((9, 0), 91900))
    q, k, v = _qkv(seq=128)
    with pytest.raises(RuntimeError, match="attn_bias is not modelled"):  # past the guard, at the op
        emulated._kernel_forward(q, k, v, 0.1, False, attn_bias=torch.ones(128, 128, dtype=torch.bool))

