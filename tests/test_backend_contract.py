"""The local-attention backend contract (``titan_upipe.contracts.backend``) on every backend.

Keys split into two blocks, forward merged by LSE, each block's backward fed the merged
out/lse, gradients summed: they must equal the whole attention's (fp64 autograd), within
``ERROR_FACTOR`` times the error plain attention makes in the same dtype (the dtype's own
error, measured), for causal and full blocks, GQA 4:1 and MHA, fp32 and bf16.

* CPU backends (``sdpa``'s CPU kernel, ``math``) run here, in ``make test``;
* the CUDA ``sdpa`` kernels' Python runs here over a CPU emulation of the four aten ops
  (``aten_sdpa_emulation``), and binds to the real aten schemas on the meta device (the
  ``cudnn`` backend's likewise, in ``test_cudnn_backend.py``);
* on CUDA (marked ``gpu``) every usable backend of ``AUTO_ORDER`` runs on the GPU; ``python -m
  titan_upipe.gpu_suite --stage kernels`` runs the same check and writes a report.

A recompute-style backward (the old CUDA ``sdpa`` branch: it recomputes its own block's
softmax under autograd and ignores the given out/lse) is shown to fail the check.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from aten_sdpa_emulation import EmulatedAtenSdpa, RecomputeBackward

from titan_upipe.attention import backends, flash_backends
from titan_upipe.attention.backends import (
    AUTO_ORDER,
    BACKENDS,
    FlashAttn4Backend,
    LocalAttentionBackend,
    MathBackend,
    SdpaCpuKernels,
    SdpaCudaKernels,
    choose_backend,
    get_backend,
)
from titan_upipe.contracts.backend import ContractCase, check_contract, contract_cases
from titan_upipe.torchtitan_0_2.config import ConfigError

CASES = contract_cases((torch.float32, torch.bfloat16))
SPLIT_CASES = [c for c in CASES if c.dtype == torch.float32]


def _assert_honours(backend: LocalAttentionBackend, case: ContractCase, device: str = "cpu") -> None:
    result = check_contract(backend, case, device)
    assert result.ok, (f"{result.backend} {case.id}: whole {result.whole}, split {result.split}, "
                       f"allowed {result.allowed}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("backend", [SdpaCpuKernels, MathBackend], ids=["sdpa-cpu", "math"])
def test_cpu_backends_honour_the_contract(backend, case):
    _assert_honours(backend(), case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cuda_sdpa_python_honours_the_contract_over_emulated_kernels(case):
    """fp32: the memory-efficient path (K/V expanded, LSE padded); bf16: the flash path (native GQA)."""
    _assert_honours(SdpaCudaKernels(ops=EmulatedAtenSdpa()), case)


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c.id)
def test_recompute_style_backward_fails_the_contract(case):
    result = check_contract(RecomputeBackward(), case)
    assert all(result.whole[n] <= result.allowed[n] for n in result.whole)  # right for the whole attention ...
    assert not result.ok  # ... wrong for a block of a larger one
    assert max(result.split[n] / result.allowed[n] for n in ("dq", "dk", "dv")) > 100


def test_check_catches_a_gradient_that_is_off_by_little():
    """The tolerance is tight: a backward whose dV is off by 1 % fails."""

    class SlightlyWrong(SdpaCpuKernels):
        def backward(self, *args, **kwargs):
            dq, dk, dv = super().backward(*args, **kwargs)
            return dq, dk, dv * 1.01

    assert not check_contract(SlightlyWrong(), SPLIT_CASES[0]).ok


def test_emulated_ops_match_the_aten_schemas():
    for op_name in EmulatedAtenSdpa.OPS:
        schema = getattr(torch.ops.aten, op_name).default._schema
        emulated = list(inspect.signature(getattr(EmulatedAtenSdpa, op_name)).parameters)
        assert emulated == [a.name for a in schema.arguments], op_name


def test_emulation_rejects_what_the_kernels_reject():
    """It would catch a CUDA path that fed the efficient kernel GQA or an unpadded LSE."""
    ops = EmulatedAtenSdpa()
    q, kv = torch.randn(1, 4, 40, 8), torch.randn(1, 2, 40, 8)
    with pytest.raises(RuntimeError, match="as many heads"):
        ops._scaled_dot_product_efficient_attention(q, kv, kv, None, True)
    out, lse, seed, offset = ops._scaled_dot_product_efficient_attention(q, q, q, None, True)
    assert lse.shape[-1] == 64
    with pytest.raises(RuntimeError, match="rows"):
        ops._scaled_dot_product_efficient_attention_backward(
            out, q, q, q, None, out, lse[..., :40], seed, offset, 0.0, [True] * 3 + [False])
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        ops._scaled_dot_product_flash_attention(q, kv, kv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_sdpa_binds_to_the_real_aten_ops_on_meta(dtype):
    """torch's own meta kernels check the argument lists and shapes of every call the CUDA
    path makes (forward, backward, the dense-call placeholders), GQA 4:1."""
    kernels = SdpaCudaKernels()
    q = torch.empty(2, 8, 96, 64, dtype=dtype, device="meta")
    kv = torch.empty(2, 2, 96, 64, dtype=dtype, device="meta")
    out, lse = kernels.forward(q, kv, kv, 0.125, True)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, 8, 96) and lse.dtype == torch.float32
    dq, dk, dv = kernels.backward(out, q, kv, kv, out, lse, 0.125, False)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, kv.shape, kv.shape)
    assert dk.dtype == dtype


def test_sdpa_backend_dispatches_by_device():
    backend = BACKENDS["sdpa"]()
    assert backend._kernels(torch.empty(1)) is backend.cpu
    assert backend._kernels(torch.empty(1, device="meta")) is backend.cuda


# --- choosing a backend -------------------------------------------------------------------


class _Unmerged(SdpaCpuKernels):
    name = "unmerged"
    merged_backward = False


def test_ring_refuses_a_backend_without_the_merged_backward(monkeypatch):
    monkeypatch.setitem(BACKENDS, "unmerged", _Unmerged)
    assert isinstance(get_backend("unmerged"), _Unmerged)  # fine where out/lse are the block's own
    with pytest.raises(ConfigError, match="merged out/lse.*ring"):
        get_backend("unmerged", ring=True)


def test_every_shipped_backend_declares_the_merged_backward():
    assert all(cls.merged_backward for cls in BACKENDS.values())


def test_auto_without_cuda_is_sdpa_and_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(FlashAttn4Backend, "installed", classmethod(lambda cls: True))
    choice = choose_backend("auto", torch.bfloat16)
    assert choice.name == "sdpa"
    assert [name for name, _ in choice.passed_over] == list(AUTO_ORDER[:AUTO_ORDER.index("sdpa")])
    assert "auto -> sdpa (passed over flash_attn4: flash_attn4 needs a CUDA device;" in choice.describe()


def _pretend_usable(monkeypatch, *names: str) -> None:
    for name in names:
        monkeypatch.setattr(BACKENDS[name], "unavailable_reason", classmethod(lambda cls, probe=True: None))


def test_auto_takes_the_fastest_usable_backend_for_the_dtype(monkeypatch):
    _pretend_usable(monkeypatch, "flash_attn4", "cudnn", "flash_attn")
    assert choose_backend("auto", torch.bfloat16).name == "flash_attn4"
    assert choose_backend("auto", None).name == "flash_attn4"
    fp32 = choose_backend("auto", torch.float32)
    assert fp32.name == "sdpa"  # the flash and cuDNN kernels run fp16/bf16 only
    assert "runs float16, bfloat16 inputs, not float32" in fp32.describe()
    monkeypatch.setattr(FlashAttn4Backend, "merged_backward", False)
    assert choose_backend("auto", torch.bfloat16, ring=True).name == "flash_attn"
    monkeypatch.setattr(backends, "AUTO_ORDER", ("flash_attn4", "cudnn", "flash_attn", "sdpa"))  # as if measured
    assert choose_backend("auto", torch.bfloat16, ring=True).name == "cudnn"
    assert choose_backend("auto", torch.bfloat16, ring=True, head_dim=256).name == "flash_attn"  # cuDNN: <= 128


def test_named_backend_that_cannot_run_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(FlashAttn4Backend, "installed", classmethod(lambda cls: False))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="'flash_attn4' is not usable here: .*pip install flash-attn-4"):
        choose_backend("flash_attn4", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="'flash_attn4' is not usable here: flash_attn4 needs a CUDA device"):
        choose_backend("flash_attn4", torch.bfloat16)
    with pytest.raises(ConfigError, match="valid backends are auto, sdpa, math"):
        choose_backend("flash", torch.bfloat16)
    _pretend_usable(monkeypatch, "flash_attn4")
    with pytest.raises(ConfigError, match="mixed_precision_param"):
        choose_backend("flash_attn4", torch.float32)


def test_a_flash_release_that_renamed_the_scale_is_refused():
    """Dropping ``softmax_scale`` silently would run the kernel with its default scale."""

    def renamed(q, k, v, scale=None, causal=False):
        return q

    with pytest.raises(ConfigError, match=r"takes no \['softmax_scale'\]"):
        flash_backends._call_by_name(renamed, {"q": 1, "k": 2, "v": 3, "softmax_scale": 0.1, "causal": True})

    def current(q, k, v, softmax_scale=None, causal=False, window_size_left=None):
        return softmax_scale

    assert flash_backends._call_by_name(current, {"q": 1, "k": 2, "v": 3, "softmax_scale": 0.1, "causal": True,
                                            "window_size": (-1, -1)}) == 0.1


def test_flash_backend_refuses_fp32_at_the_call():
    with pytest.raises(ConfigError, match="not float32"):
        FlashAttn4Backend().forward(torch.empty(1, 1, 8, 8), torch.empty(1, 1, 8, 8), torch.empty(1, 1, 8, 8), 1.0)


def test_probe_free_check_imports_nothing(monkeypatch):
    """Before process groups start, availability is read from package metadata only."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("CUDA queried"))
    monkeypatch.setattr(FlashAttn4Backend, "installed", classmethod(lambda cls: True))

    def no_import(cls):
        raise AssertionError("imported before the process groups")

    monkeypatch.setattr(FlashAttn4Backend, "_module", classmethod(no_import))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: pytest.fail("CUDA queried"))
    assert choose_backend("flash_attn4", torch.bfloat16, probe=False).name == "flash_attn4"


def test_fold_kv_grad_sums_each_groups_copies():
    grad = torch.arange(2 * 8 * 3 * 2, dtype=torch.float32).view(2, 8, 3, 2)
    folded = backends.fold_kv_grad(grad, 4)
    assert torch.equal(folded, grad.view(2, 2, 4, 3, 2).sum(2))
    assert torch.equal(backends.expand_kv(folded, 4)[:, ::4], folded)


# --- on a CUDA GPU --------------------------------------------------------------------------


def _installed_cuda_backends() -> list[str]:
    return [name for name in AUTO_ORDER if BACKENDS[name].unavailable_reason() is None]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cuda_backends_honour_the_contract(case):
    names = _installed_cuda_backends()
    assert "sdpa" in names
    for name in names:
        backend = BACKENDS[name]()
        if backend.dtype_problem(case.dtype) is None:
            _assert_honours(backend, case, "cuda")


def test_job_with_an_unusable_backend_fails_before_any_process_group(monkeypatch):
    """Before process groups: package metadata and dtype only (it may run on a login node)."""
    from titan_upipe.torchtitan_0_2.checks import check_job
    from titan_upipe.torchtitan_0_2.config_parse import parse_config

    monkeypatch.setattr(FlashAttn4Backend, "installed", classmethod(lambda cls: False))
    ring = ["--job.config_file", "configs/debug/ring.toml", "--upipe.attention_backend"]
    with pytest.raises(ConfigError, match="'flash_attn4' is not usable here: flash_attn4 needs the 'flash-attn-4' "
                                          r"package \(pip install flash-attn-4\)"):
        check_job(parse_config([*ring, "flash_attn4", "--training.mixed_precision_param", "bfloat16"]), 4)
    with pytest.raises(ConfigError, match="flash_attn4 runs float16, bfloat16 inputs, not float32: train in bf16"):
        check_job(parse_config([*ring, "flash_attn4"]), 4)  # the debug configs train in fp32
    check_job(parse_config([*ring, "auto"]), 4)
    # Installed but no GPU on this machine (a login node): not refused before the job starts.
    monkeypatch.setattr(FlashAttn4Backend, "installed", classmethod(lambda cls: True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_job(parse_config([*ring, "flash_attn4", "--training.mixed_precision_param", "bfloat16"]), 4)


def test_flash_attn4_refuses_a_head_dim_it_cannot_run_before_any_kernel(monkeypatch):
    """FA4 4.0.0b36 asserts on an unsupported head_dim at its first call, mid-step; the backend
    refuses it where it is chosen: before process groups (``probe=False``) and at conversion."""
    from test_attention_validation import NoCommMesh
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Attention as Qwen3Attention

    from titan_upipe.attention import convert_attention

    refusal = (r"'flash_attn4' is not usable here: flash_attn4 \(FlashAttention-4 4\.0\.0b36\) runs head_dim a "
               r"multiple of 8 from 8 to 128, or 256, forward and backward .*, not {}: use attention_backend 'sdpa'")
    monkeypatch.setattr(FlashAttn4Backend, "installed", classmethod(lambda cls: True))
    for head_dim in (4, 100, 192, 264):  # not a multiple of 8; Hopper-only; above 256
        with pytest.raises(ConfigError, match=refusal.format(head_dim)):
            choose_backend("flash_attn4", torch.bfloat16, head_dim=head_dim, probe=False)
    for head_dim in (8, 64, 128, 256, None):
        assert choose_backend("flash_attn4", torch.bfloat16, head_dim=head_dim, probe=False).name == "flash_attn4"

    _pretend_usable(monkeypatch, "flash_attn4", "flash_attn")

    def attention(head_dim: int) -> Qwen3Attention:
        return Qwen3Attention(Qwen3ModelArgs(dim=64, n_heads=4, n_kv_heads=2, head_dim=head_dim))

    with pytest.raises(ConfigError, match=refusal.format(192)):
        convert_attention(attention(192), "ulysses", NoCommMesh(1), backend="flash_attn4")
    assert convert_attention(attention(128), "ulysses", NoCommMesh(1), backend="flash_attn4").backend.name == "flash_attn4"
    choice = choose_backend("auto", torch.bfloat16, head_dim=192)  # passed over, never run
    assert choice.name == "flash_attn" and "not 192" in dict(choice.passed_over)["flash_attn4"]
