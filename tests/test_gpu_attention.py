"""The GPU suite's attention stage and the measured kernel table, on a CPU machine: the FLOP counts
against torch's own FLOP counter, the stage end to end on the CPU kernel (its numbers recomputed
from its times), a backend failing its contract reported and left out of the order, the table
applied by GPU architecture (sm90: H100 and H200 alike), unmeasured backends placed by the
architecture's default order, scores of the job's head_dim and dtype, and the rates a plan divides
FLOPs by (``kernel_speed.attention_rate``). The GPU queue and the run estimates: test_gpu_queue.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from titan_upipe.attention.backends import AUTO_ORDER, BACKENDS, SdpaBackend
from titan_upipe.costs import kernel_speed
from titan_upipe.tools import gpu_attention, gpu_queue, gpu_suite

H100, H100_PCIE, H200, A100 = ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200",
                                 "NVIDIA A100-SXM4-80GB")

# --- FLOPs and the document mix ----------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[256], [64, 192, 32]])
def test_causal_flops_are_half_of_torchs_count_of_full_attention(lengths):
    """torch's FLOP counter on full (non-causal) attention of each document, written as its two
    matmuls: the causal mask keeps half of ``QK^T`` and ``PV``. Backward: autograd's four matmuls
    plus the ``QK^T`` a flash backward recomputes (half a forward), 2.5 x forward in all."""
    heads, dim = 4, 32
    counted_fwd = counted_bwd = 0
    for n in lengths:
        q = torch.randn(1, heads, n, dim, requires_grad=True)
        with FlopCounterMode(display=False) as forward:
            out = torch.softmax(q @ q.transpose(-1, -2), dim=-1) @ q
        with FlopCounterMode(display=False) as backward:
            out.backward(torch.ones_like(out))
        counted_fwd += forward.get_total_flops()
        counted_bwd += backward.get_total_flops() + forward.get_total_flops() / 2
    fwd, bwd = gpu_attention.causal_flops(lengths, heads, dim)
    assert counted_fwd > 0 and 2 * fwd == counted_fwd and 2 * bwd == counted_bwd


def test_the_document_mix_packs_exactly_and_is_fixed_by_its_seed():
    lengths = gpu_attention.document_lengths(128 * 1024)
    assert sum(lengths) == 128 * 1024 and min(lengths) >= 1 and len(lengths) > 3
    assert lengths == gpu_attention.document_lengths(128 * 1024)
    assert lengths != gpu_attention.document_lengths(128 * 1024, seed=1)


# --- the stage on CPU ----------------------------------------------------------------------------


def test_attention_stage_on_cpu_reports_every_backend_and_consistent_rates(tmp_path):
    args = gpu_suite.parse_args(["--stage", "attention", "--out", str(tmp_path)])
    report = gpu_suite.run_stage("attention", args, ["--stage", "attention"], device="cpu")
    timed = [r for r in report.results if "fwd_ms" in r]
    assert {(r["backend"], r["shape"]) for r in timed} == {("sdpa", "llama3_8b"), ("sdpa", "qwen3_32b")}
    shapes = {s.name: s for s in gpu_attention.SHAPES}
    for r in timed:  # each rate recomputed from the case's FLOPs and its own time
        fwd, bwd = gpu_attention.causal_flops([r["tokens"]], shapes[r["shape"]].q_heads, 128)
        assert r["fwd_tflops"] == pytest.approx(fwd / (r["fwd_ms"] / 1e3) / 1e12)
        assert r["bwd_tflops"] == pytest.approx(bwd / (r["bwd_ms"] / 1e3) / 1e12)
    skipped = {r["backend"] for r in report.results if r.get("skipped")}
    assert skipped == set(AUTO_ORDER) - {"sdpa"}  # said why, not hidden
    text = (tmp_path / "attention.md").read_text()
    assert "| sdpa | llama3_8b | 256 | dense |" in text and "Ranking" in text and "sdpa (" in text
    # a second call continues the report: nothing is timed again
    again = gpu_suite.run_stage("attention", args, ["--stage", "attention"], device="cpu")
    assert [r for r in again.results if "fwd_ms" in r] == timed


class _RecomputingSdpa(SdpaBackend):
    """A backward that recomputes its block's softmax: right alone, wrong for a block of a larger
    attention (the merged out/lse contract)."""

    name = "sdpa"

    def backward(self, dout, q, k, v, out, lse, scale, causal=True):
        own_out, own_lse = self.forward(q, k, v, scale, causal)
        return super().backward(dout, q, k, v, own_out, own_lse, scale, causal)


def test_a_backend_failing_its_contract_is_not_timed_and_leaves_auto(monkeypatch, tmp_path):
    monkeypatch.setitem(BACKENDS, "sdpa", _RecomputingSdpa)
    results = gpu_attention.run_attention_stage("cpu")
    sdpa = [r for r in results if r["backend"] == "sdpa"]
    assert len(sdpa) == 1 and not sdpa[0]["ok"] and sdpa[0]["contract"].startswith("failed")
    rows = gpu_attention.csv_rows(results, {"device": H100, "date": "2026-11-25"})
    assert [(r["backend"], r["contract"][:6], r["arch"]) for r in rows] == [("sdpa", "failed", "sm90")]
    path = tmp_path / "kernel_speed.csv"
    kernel_speed.write_rows([_row("sdpa", 300.0, H100), _row("cudnn", 600.0, H100)], H100, path)
    kernel_speed.write_rows(rows, H100, path)
    order = kernel_speed.measured_order("sm90", AUTO_ORDER, kernel_speed.read_rows(path))
    assert "sdpa" not in order and order[0] == "flash_attn4"  # FA4 unmeasured, first by the sm90 default
    assert order.index("cudnn") < order.index("flash_attn")


# --- the table by architecture, auto's order, the rates ----------------------------------------------


def _row(backend: str, tflops: float, device: str = H200, length: str = "1M", tokens: int = 1 << 20,
         contract: str = "ok", shape: str = "llama3_8b", head_dim: int = 128, dtype: str = "bf16",
         fwd_share: float = 0.5) -> dict:
    """A dense row whose fwd + bwd TFLOP/s is ``tflops`` (``fwd_share`` of it forward)."""
    fwd, bwd = kernel_speed.causal_flops([tokens], 4, head_dim)
    fwd_tflops, bwd_tflops = tflops * fwd_share, tflops * (1 - fwd_share)
    return {"device": device, "arch": kernel_speed.arch_of_device(device) or "", "date": "2026-11-25",
            "torch": "2.11.0+cu130", "backend": backend, "shape": shape, "q_heads": "4", "kv_heads": "1",
            "head_dim": str(head_dim), "dtype": dtype, "length": length, "tokens": str(tokens), "kind": "dense",
            "contract": contract, "fwd_ms": str(fwd / fwd_tflops / 1e9), "bwd_ms": str(bwd / bwd_tflops / 1e9),
            "fwd_tflops": str(fwd_tflops), "bwd_tflops": str(bwd_tflops)}


def _pretend_gpu(monkeypatch, name: str, capability: tuple[int, int], rows: list[dict],
                 usable: tuple[str, ...] = ("flash_attn4", "cudnn")) -> None:
    """A CUDA device of ``name`` and ``capability`` with ``rows`` as the shipped table; the backends
    of ``usable`` installed (the rest as they are here: flash_attn/flash_attn3 not installed)."""
    from titan_upipe.attention import backends

    monkeypatch.setattr(kernel_speed, "read_rows", lambda path=None: rows)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    for backend in usable:
        monkeypatch.setattr(backends.BACKENDS[backend], "unavailable_reason", classmethod(lambda cls, probe=True: None))


def test_a_gpus_architecture_is_its_compute_capability():
    """H100 SXM, H100 PCIe and H200 are one architecture (sm90), the A100 another (sm80)."""
    assert {kernel_speed.arch_of_device(name) for name in (H100, H100_PCIE, H200, "NVIDIA GH200 480GB")} == {"sm90"}
    assert kernel_speed.arch_of_device(A100) == "sm80" and kernel_speed.arch_of_device("NVIDIA A10") == "sm86"
    assert kernel_speed.arch_of_device("a GPU nothing knows") is None
    assert kernel_speed.arch_of_capability((9, 0)) == "sm90" and kernel_speed.arch_of_capability((10, 0)) == "sm100"
    assert kernel_speed.capability_of_arch("sm100") == (10, 0) and kernel_speed.capability_of_arch("sm86") == (8, 6)
    with pytest.raises(ValueError, match="not a GPU architecture"):
        kernel_speed.capability_of_arch(H100)


def test_an_h100_runs_by_the_h200s_rows(monkeypatch):
    """Rows measured on an H200 rank the kernels of every sm90 GPU: an H100 (SXM or PCIe) without
    FlashAttention-4 gets cuDNN attention (564 vs 332 TFLOP/s forward on the H200), not SDPA."""
    from titan_upipe.attention import backends

    rows = [_row("flash_attn4", 1290), _row("cudnn", 1100), _row("sdpa", 650)]
    by_h100 = kernel_speed.measured_order(kernel_speed.arch_of_device(H100), AUTO_ORDER, rows)
    by_h200 = kernel_speed.measured_order(kernel_speed.arch_of_device(H200), AUTO_ORDER, rows)
    assert by_h100 == by_h200 == ("flash_attn4", "flash_attn3", "cudnn", "flash_attn", "sdpa")
    for name in (H100, H100_PCIE):
        _pretend_gpu(monkeypatch, name, (9, 0), rows, usable=("cudnn",))
        choice = backends.choose_backend("auto", torch.bfloat16, head_dim=128)
        assert choice.name == "cudnn" and [n for n, _ in choice.passed_over] == ["flash_attn4", "flash_attn3"]
    _pretend_gpu(monkeypatch, H100, (9, 0), rows)  # with FA4 installed
    assert backends.choose_backend("auto", torch.bfloat16, head_dim=128).name == "flash_attn4"


def test_an_a100_takes_its_own_default_order(monkeypatch):
    """sm90 rows say nothing about an sm80 GPU: the A100 keeps the pre-Hopper default (cuDNN last,
    unmeasured there), and an A100 row of its own ranks it."""
    from titan_upipe.attention import backends

    rows = [_row("cudnn", 1100), _row("sdpa", 650)]
    assert kernel_speed.measured_order("sm80", AUTO_ORDER, rows) == AUTO_ORDER
    _pretend_gpu(monkeypatch, A100, (8, 0), rows, usable=("cudnn",))
    assert backends.auto_order() == AUTO_ORDER
    assert backends.choose_backend("auto", torch.bfloat16, head_dim=128).name == "sdpa"
    rows.append(_row("cudnn", 500, A100))
    rows.append(_row("sdpa", 300, A100))
    assert backends.choose_backend("auto", torch.bfloat16, head_dim=128).name == "cudnn"
    assert backends.auto_order(probe=False) == AUTO_ORDER  # no CUDA query: the documented default


def test_unmeasured_backends_keep_their_place_in_the_default_order():
    """Measured backends rank by score; each unmeasured one goes where it breaks the fewest of the
    architecture's default claims about it (the lower place on a tie); a failed contract leaves the
    order."""
    hopper = kernel_speed.HOPPER_ORDER
    assert hopper == ("flash_attn4", "flash_attn3", "cudnn", "flash_attn", "sdpa")
    assert kernel_speed.measured_order("sm90", AUTO_ORDER, []) == hopper  # nothing measured: the default
    assert kernel_speed.measured_order("sm100", AUTO_ORDER, []) == hopper  # sm90 and newer
    assert kernel_speed.measured_order("sm89", AUTO_ORDER, []) == AUTO_ORDER
    only_sdpa = [_row("sdpa", 650)]
    assert kernel_speed.measured_order("sm90", AUTO_ORDER, only_sdpa) == hopper  # not behind SDPA
    # measurements against the default: FA3 (faster than cuDNN and SDPA by the default, slower than
    # FA4) leads, one claim broken; FA2 (slower than FA4 and cuDNN, faster than SDPA) goes last
    upside_down = [_row("sdpa", 1300), _row("cudnn", 1100), _row("flash_attn4", 600)]
    assert kernel_speed.measured_order("sm90", AUTO_ORDER, upside_down) == (
        "flash_attn3", "sdpa", "cudnn", "flash_attn4", "flash_attn")
    failed = [*upside_down, _row("cudnn", 0.1, contract="failed dq")]
    assert kernel_speed.measured_order("sm90", AUTO_ORDER, failed) == ("sdpa", "flash_attn4", "flash_attn3",
                                                                       "flash_attn")
    assert kernel_speed.merge_order(("a", "b", "c", "d"), {"d": 1.0, "b": 2.0}) == ("a", "b", "c", "d")
    assert kernel_speed.merge_order(("a", "b", "c", "d"), {"d": 3.0, "b": 2.0}) == ("a", "d", "b", "c")  # c: a tie
    assert kernel_speed.merge_order(("a", "b", "c"), {"a": 1.0, "b": 2.0}) == ("b", "a", "c")
    # the candidates a caller passes (tests narrow AUTO_ORDER) keep the architecture's ranking of them
    assert kernel_speed.measured_order("sm90", ("sdpa", "cudnn"), []) == ("cudnn", "sdpa")


def test_geometric_mean_over_lengths_and_shapes():
    """A backend fast at one length only does not win on it alone."""
    rows = [_row("sdpa", 250), _row("cudnn", 600), _row("sdpa", 1000, length="128K", tokens=128 << 10),
            _row("cudnn", 400, length="128K", tokens=128 << 10, shape="qwen3_32b")]
    assert kernel_speed.scores(rows, "sm90")["sdpa"] == pytest.approx(math.sqrt(250 * 1000))
    assert kernel_speed.scores(rows, "sm90")["cudnn"] == pytest.approx(math.sqrt(600 * 400))
    assert kernel_speed.scores(rows, "sm80") == {}


def test_a_job_is_ranked_by_the_rows_of_its_head_dim_and_dtype(monkeypatch):
    """Rows of the job's head_dim and dtype where the architecture has any, else all of them."""
    from titan_upipe.attention import backends

    rows = [_row("flash_attn4", 1300), _row("cudnn", 1100), _row("sdpa", 650),
            _row("flash_attn4", 700, head_dim=64), _row("cudnn", 900, head_dim=64),
            _row("sdpa", 2000, dtype="fp16")]
    assert kernel_speed.measured_order("sm90", AUTO_ORDER, rows, 128, torch.bfloat16)[0] == "flash_attn4"
    assert kernel_speed.measured_order("sm90", AUTO_ORDER, rows, 64, "bf16")[:3] == ("cudnn", "flash_attn4",
                                                                                     "flash_attn3")
    # fp16: only SDPA measured in it, at a rate bf16 rows do not enter; the rest by the default
    assert kernel_speed.scores(rows, "sm90", 128, torch.float16) == {"sdpa": pytest.approx(2000)}
    assert kernel_speed.measured_order("sm90", AUTO_ORDER, rows, 128, torch.float16) == kernel_speed.HOPPER_ORDER
    # head_dim 256: nothing measured at it on sm90, so every sm90 row
    assert kernel_speed.scores(rows, "sm90", 256, "bf16") == kernel_speed.scores(rows, "sm90")
    _pretend_gpu(monkeypatch, H100, (9, 0), rows)
    assert backends.choose_backend("auto", torch.bfloat16, head_dim=64).name == "cudnn"
    assert backends.choose_backend("auto", torch.bfloat16, head_dim=128).name == "flash_attn4"
    assert kernel_speed.dtype_name(torch.bfloat16) == kernel_speed.dtype_name("bfloat16") == "bf16"


def test_attention_rate_measured_ranked_or_assumed():
    """``attention_rate``: a measured backend's own fwd/bwd geometric means; an unmeasured one at the
    rates of the measured backend right after it in the order; else the deliberately low assumption."""
    rows = [_row("flash_attn4", 1300, fwd_share=0.52), _row("flash_attn4", 1200, fwd_share=0.52, shape="qwen3_32b"),
            _row("cudnn", 1100), _row("sdpa", 650)]
    fa4 = kernel_speed.attention_rate("flash_attn4", "sm90", 128, "bf16", rows)
    assert fa4.basis == "measured"
    assert fa4.fwd_tflops == pytest.approx(math.sqrt(1300 * 0.52 * 1200 * 0.52))
    assert fa4.bwd_tflops == pytest.approx(math.sqrt(1300 * 0.48 * 1200 * 0.48))
    fa3 = kernel_speed.attention_rate("flash_attn3", "sm90", 128, "bf16", rows)  # after FA4, above cuDNN
    assert fa3.basis == "ranked below cudnn" and fa3.fwd_tflops == pytest.approx(550)
    fa2 = kernel_speed.attention_rate("flash_attn", "sm90", 128, "bf16", rows)
    assert fa2.basis == "ranked below sdpa" and fa2.bwd_tflops == pytest.approx(325)
    last = kernel_speed.attention_rate("sdpa", "sm90", 128, "bf16", rows[:1])  # nothing measured after it
    assert last.basis == "assumed" and last.fwd_tflops == kernel_speed.ASSUMED_TFLOPS
    assert kernel_speed.attention_rate("cudnn", "sm80", 128, "bf16", rows).basis == "assumed"
    assert kernel_speed.attention_rate("cudnn", None, 128, "bf16", rows).arch == "sm90"  # the newest measured
    fwd, bwd = kernel_speed.causal_flops([1 << 20], 4, 128)
    assert fa4.seconds(fwd, bwd, forwards=2) == pytest.approx(2 * fwd / (fa4.fwd_tflops * 1e12)
                                                              + bwd / (fa4.bwd_tflops * 1e12))


def test_the_shipped_table_is_the_h200s_and_ranks_cudnn_above_sdpa(monkeypatch):
    """``titan_upipe/resources/kernel_speed.csv`` holds the H200 run of 2026-11-27 (bf16, head_dim
    128, 128K), the rows of every sm90 GPU; cuDNN's measured 564 / 539 TFLOP/s put it second, so an
    H100 without FlashAttention-4 runs cuDNN attention, not SDPA."""
    from titan_upipe.attention import backends

    rows = kernel_speed.read_rows()
    _pretend_gpu(monkeypatch, H100, (9, 0), rows, usable=("cudnn",))
    assert backends.choose_backend("auto", torch.bfloat16, head_dim=128).name == "cudnn"
    assert {(r["device"], r["arch"], r["dtype"], r["head_dim"], r["date"]) for r in rows} == {
        (H200, "sm90", "bf16", "128", "2026-11-27")}
    assert kernel_speed.latest_arch(rows) == "sm90"
    assert kernel_speed.measured_order("sm90", AUTO_ORDER, rows) == kernel_speed.HOPPER_ORDER
    cudnn = kernel_speed.attention_rate("cudnn", "sm90", 128, "bf16", rows)
    assert cudnn.basis == "measured" and cudnn.fwd_tflops == pytest.approx(math.sqrt(564 * 557.4))


def test_rows_written_before_the_architecture_column_read_by_their_device(tmp_path):
    path = tmp_path / "kernel_speed.csv"
    legacy = [c for c in kernel_speed.COLUMNS if c not in ("arch", "dtype")]
    row = _row("cudnn", 1100, H100)
    path.write_text(",".join(legacy) + "\n" + ",".join(row[c] for c in legacy) + "\n")
    read, = kernel_speed.read_rows(path)
    assert read["arch"] == "sm90" and read["dtype"] == "bf16"


def test_a_later_stage_replaces_only_the_cases_it_measured():
    old = [_row("sdpa", 250, H100), _row("sdpa", 300, H100, length="128K", tokens=128 << 10),
           _row("cudnn", 600, H100), _row("cudnn", 50)]
    merged = kernel_speed.merge_rows(old, [_row("sdpa", 260, H100)], H100)
    assert sorted((r["backend"], r["length"], r["fwd_tflops"]) for r in merged if r["device"] == H100) == [
        ("cudnn", "1M", "300.0"), ("sdpa", "128K", "150.0"), ("sdpa", "1M", "130.0")]
    failed = kernel_speed.merge_rows(old, [{"device": H100, "arch": "sm90", "backend": "cudnn", "contract": "failed x",
                                            "kind": "dense"}], H100)
    assert [r["contract"] for r in failed if r["backend"] == "cudnn" and r["device"] == H100] == ["failed x"]
    assert any(r["device"] == H200 for r in failed)


def test_a_case_that_raises_is_reported_and_the_stage_goes_on(monkeypatch):
    calls = []

    def flaky(case, device, repeats=None):
        calls.append(case.name)
        if len(calls) == 1:
            raise RuntimeError("cuDNN: not supported at this shape")
        return {"fwd_ms": 1.0, "bwd_ms": 2.0, "fwd_tflops": 1.0, "bwd_tflops": 1.0, "documents": 1}

    monkeypatch.setattr(gpu_attention, "time_case", flaky)
    results = [r for r in gpu_attention.run_attention_stage("cpu") if "shape" in r]
    assert len(results) == 2 and not results[0]["ok"] and "not supported" in results[0]["error"]
    assert results[1]["ok"] and results[1]["fwd_ms"] == 1.0


def test_one_backends_crashing_contract_does_not_hide_the_others(monkeypatch):
    from titan_upipe.attention.backends import SdpaCpuKernels
    from titan_upipe.tools import gpu_kernels

    def crash(self, *args, **kwargs):
        raise RuntimeError("kernel crashed")

    monkeypatch.setattr(SdpaCpuKernels, "forward", crash)
    results = gpu_kernels.contract_checks("cpu")
    assert {r["case"].split()[0] for r in results} == set(AUTO_ORDER)  # every backend has its verdict
    sdpa = [r for r in results if r["case"] == "sdpa"]
    assert len(sdpa) == 1 and not sdpa[0]["ok"] and "kernel crashed" in sdpa[0]["detail"]
    assert gpu_queue.kernels_done([{"stage": "kernels", "environment": {}, "results": results}])  # the queue moves on


def test_attention_lengths_must_be_the_stages(capsys):
    with pytest.raises(SystemExit):
        gpu_suite.parse_args(["--stage", "attention", "--lengths", "3M"])
    assert "--lengths for the attention stage: 128K, 1M, 2M" in capsys.readouterr().err
    assert gpu_suite.attention_lengths(("3M",)) == {} and gpu_attention.plan_cases("cuda", ["sdpa"], {}) == []


def test_a_backend_passing_again_loses_its_old_failure_even_untimed():
    old = [{**_row("sdpa", 250, H100), "backend": "cudnn", "contract": "failed bf16", "fwd_ms": "", "fwd_tflops": ""},
           _row("sdpa", 250, H100)]
    assert "cudnn" not in kernel_speed.measured_order("sm90", AUTO_ORDER, old)
    merged = kernel_speed.merge_rows(old, [], H100, passed={"cudnn"})
    assert [r["backend"] for r in merged] == ["sdpa"]
    assert "cudnn" in kernel_speed.measured_order("sm90", AUTO_ORDER, merged)
