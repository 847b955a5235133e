"""The GPU suite's attention stage, the measured kernel table and the GPU queue, on a CPU machine:
the FLOP counts against torch's own FLOP counter, the stage end to end on the CPU kernel (its
numbers recomputed from its times), a backend failing its contract reported and left out of the
order, the order ``auto`` takes from the table, the run-time estimates, and ``--next``'s queue
with its reports as its state."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from titan_upipe.attention import kernel_speed
from titan_upipe.attention.backends import AUTO_ORDER, BACKENDS, SdpaBackend
from titan_upipe.tools import gpu_attention, gpu_queue, gpu_suite

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
    rows = gpu_attention.csv_rows(results, {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-25"})
    assert [(r["backend"], r["contract"][:6]) for r in rows] == [("sdpa", "failed")]
    path = tmp_path / "kernel_speed.csv"
    kernel_speed.write_rows([_row("sdpa", 300.0), _row("cudnn", 600.0)], "NVIDIA H100 80GB HBM3", path)
    kernel_speed.write_rows(rows, "NVIDIA H100 80GB HBM3", path)
    order = kernel_speed.measured_order("NVIDIA H100 80GB HBM3", AUTO_ORDER, kernel_speed.read_rows(path))
    assert "sdpa" not in order and order[0] == "cudnn"


# --- the measured order, the estimates -------------------------------------------------------------

H100 = "NVIDIA H100 80GB HBM3"


def _row(backend: str, tflops: float, device: str = H100, length: str = "1M", tokens: int = 1 << 20,
         contract: str = "ok", shape: str = "llama3_8b") -> dict:
    fwd, bwd = gpu_attention.causal_flops([tokens], 4, 128)
    seconds = (fwd + bwd) / (tflops * 1e12)
    return {"device": device, "date": "2026-11-25", "torch": "2.11.0+cu130", "backend": backend, "shape": shape,
            "q_heads": "4", "kv_heads": "1", "head_dim": "128", "length": length, "tokens": str(tokens), "kind": "dense",
            "contract": contract, "fwd_ms": str(seconds * 1e3 * fwd / (fwd + bwd)),
            "bwd_ms": str(seconds * 1e3 * bwd / (fwd + bwd)), "fwd_tflops": str(tflops / 2),
            "bwd_tflops": str(tflops / 2)}


def test_auto_order_is_the_measured_ranking_on_that_gpu_only():
    rows = [_row("sdpa", 250), _row("flash_attn4", 500), _row("cudnn", 600),
            _row("cudnn", 100, device="NVIDIA H200"), _row("flash_attn", 900, contract="failed worst dq")]
    assert kernel_speed.measured_order(H100, AUTO_ORDER, rows) == ("cudnn", "flash_attn4", "sdpa", "flash_attn3")
    assert kernel_speed.measured_order("NVIDIA A100", AUTO_ORDER, rows) == AUTO_ORDER  # nothing measured there
    assert kernel_speed.measured_order(None, AUTO_ORDER, rows) == AUTO_ORDER
    # geometric mean over lengths: a backend fast at one length only does not win on it alone
    rows += [_row("sdpa", 1000, length="128K", tokens=128 << 10), _row("cudnn", 400, length="128K", tokens=128 << 10)]
    assert kernel_speed.scores(rows, H100)["sdpa"] == pytest.approx(math.sqrt(250 * 1000))


def test_auto_takes_the_order_measured_on_the_gpu_it_runs_on(monkeypatch):
    """``choose_backend("auto")`` on an H100 with measurements: the fastest there that runs the job
    (cuDNN has no varlen kernel: packed documents pass it over); before process groups
    (``probe=False``: no CUDA query) and on another GPU, the documented default order."""
    from titan_upipe.attention import backends

    rows = [_row("sdpa", 250), _row("flash_attn4", 500), _row("cudnn", 600)]
    monkeypatch.setattr(kernel_speed, "read_rows", lambda path=None: rows)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: H100)
    for name in ("flash_attn4", "cudnn"):
        monkeypatch.setattr(BACKENDS[name], "unavailable_reason", classmethod(lambda cls, probe=True: None))
    assert backends.auto_order() == ("cudnn", "flash_attn4", "sdpa", "flash_attn3", "flash_attn")
    assert backends.choose_backend("auto", torch.bfloat16, head_dim=128).name == "cudnn"
    documents = backends.choose_backend("auto", torch.bfloat16, head_dim=128, varlen=True)
    assert documents.name == "flash_attn4" and "no varlen" in dict(documents.passed_over)["cudnn"]
    assert backends.choose_backend("auto", torch.bfloat16, head_dim=128, probe=False).name == "flash_attn4"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    assert backends.auto_order() == AUTO_ORDER


def test_a_later_stage_replaces_only_the_cases_it_measured():
    old = [_row("sdpa", 250), _row("sdpa", 300, length="128K", tokens=128 << 10), _row("cudnn", 600),
           _row("cudnn", 50, device="NVIDIA H200")]
    merged = kernel_speed.merge_rows(old, [_row("sdpa", 260)], H100)
    assert sorted((r["backend"], r["length"], r["fwd_tflops"]) for r in merged if r["device"] == H100) == [
        ("cudnn", "1M", "300.0"), ("sdpa", "128K", "150.0"), ("sdpa", "1M", "130.0")]
    failed = kernel_speed.merge_rows(old, [{"device": H100, "backend": "cudnn", "contract": "failed x", "kind": "dense"}],
                                     H100)
    assert [r["contract"] for r in failed if r["backend"] == "cudnn" and r["device"] == H100] == ["failed x"]
    assert any(r["device"] == "NVIDIA H200" for r in failed)


def test_run_estimates_scale_with_the_measured_kernel():
    assert gpu_attention.kernel_slowdown(rows=[]) == gpu_attention.SDPA_SLOWDOWN
    rows = [_row("sdpa", 250), _row("cudnn", 500)]
    assert gpu_attention.kernel_slowdown(H100, rows) == pytest.approx(gpu_attention.SDPA_SLOWDOWN * 250 / 500)
    assert gpu_attention.kernel_slowdown(H100, [_row("cudnn", 500)]) == gpu_attention.SDPA_SLOWDOWN  # no SDPA anchor
    fast = gpu_suite.run_estimate_s("2M", slowdown=1.0)
    slow = gpu_suite.run_estimate_s("2M", slowdown=2.0)
    assert slow - gpu_suite.STARTUP_S == pytest.approx(2 * (fast - gpu_suite.STARTUP_S))


# --- the queue ----------------------------------------------------------------------------------------


def _queue(fastest: str = "cudnn") -> list:
    return gpu_queue.build_queue(lambda stage, lengths, select: 100.0, fastest, AUTO_ORDER)


def _report(stage: str, results: list[dict], **env) -> dict:
    return {"stage": stage, "environment": env, "results": results}


def test_the_queue_starts_with_the_kernels_and_is_judged_by_the_reports():
    items = _queue()
    assert [i.name for i in items][:3] == ["kernels", "attention 128K", "attention 1M"]
    assert [i.name for i in items][-3:] == ["attention 2M", "ring_documents 128K", "ring_documents 1M"]
    # the committed 2026-11-23 kernels report has no cudnn contract: not done
    committed = gpu_queue.load_reports([gpu_suite.REPORT_DIR])
    assert not items[0].done(committed)
    contracts = [{"check": "contract", "case": f"{b} bf16 causal", "ok": True} for b in ("sdpa", "cudnn")]
    contracts.append({"check": "contract", "case": "flash_attn4", "ok": True, "skipped": True})
    assert items[0].done([_report("kernels", contracts)])
    attention = [{"backend": b, "skipped": True, "ok": True} for b in AUTO_ORDER if b not in ("sdpa", "cudnn")]
    attention.append({"backend": "cudnn", "ok": False, "contract": "failed bf16 causal"})  # reported: done
    llama = {"backend": "sdpa", "shape": "llama3_8b", "length": "128K", "kind": "dense", "fwd_ms": 1.0}
    # a call cut short after one shape is not done: the other shape of that length is still owed
    assert not items[1].done([_report("attention", [*attention, llama])])
    qwen = {**llama, "shape": "qwen3_32b", "fwd_ms": None, "ok": False, "error": "RuntimeError: x"}  # failed: reported
    assert items[1].done([_report("attention", [*attention, llama, qwen])])
    assert not items[2].done([_report("attention", [*attention, llama, qwen])])


def test_speed_is_done_only_with_the_fastest_backend():
    speed = [{"method": m, "length": "1M", "measurement": {"x": 1}} for m in ("ulysses", "upipe")]
    item = next(i for i in _queue("cudnn") if i.name.startswith("speed 1M"))
    assert not item.done([_report("speed", speed, attention_backend="sdpa")])
    assert item.done([_report("speed", speed, attention_backend="cudnn")])


def test_next_takes_the_first_pending_item_that_fits_and_never_retries_one():
    items = gpu_queue.build_queue(lambda stage, lengths, select: 900.0 if "5M" in lengths else 50.0, "cudnn",
                                  AUTO_ORDER)
    first = gpu_queue.next_item(items, [], 540, set())
    assert first.name == "kernels"
    memory_5m = next(i for i in items if i.name == "memory llama3_8b upipe 5M")
    attempted = {i.name for i in items[: items.index(memory_5m)]}
    after = gpu_queue.next_item(items, [], 540, attempted)
    assert after.name == "memory qwen3_32b upipe_8gpu 2.5M"  # 5M does not fit a 10-minute call: passed over
    assert gpu_queue.next_item(items, [], 10, set()) is None


def test_next_runs_children_until_nothing_fits(monkeypatch, tmp_path):
    """``--next`` on a GPU: each item a child call of the suite with what is left of the budget; a
    child that writes its report moves the queue on."""
    calls = []

    class Done:
        returncode = 0

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        stage = cmd[cmd.index("--stage") + 1]
        if stage == "kernels":
            results = [{"check": "contract", "case": f"{b} x", "ok": True} for b in gpu_queue.KERNEL_BACKENDS]
            (tmp_path / "kernels.json").write_text(json.dumps(_report("kernels", results)))
        return Done()

    monkeypatch.setattr(gpu_suite.subprocess, "run", fake_run)
    monkeypatch.setattr(gpu_suite, "REPORT_DIR", tmp_path / "committed")
    monkeypatch.setattr(gpu_suite, "call_estimate_s", lambda stage, lengths, select: 200.0)
    args = gpu_suite.parse_args(["--next", "--out", str(tmp_path), "--budget-s", "500"])
    assert gpu_suite.run_next(args, time.monotonic() + 500) == 0
    stages = [c[c.index("--stage") + 1] for c in calls]
    assert stages[0] == "kernels" and len(calls) == len(_queue())  # each pending item tried once
    assert all(float(c[c.index("--budget-s") + 1]) <= 500 and c[c.index("--out") + 1] == str(tmp_path)
               for c in calls)


def test_next_is_refused_with_a_stage(capsys):
    with pytest.raises(SystemExit):
        gpu_suite.parse_args(["--next", "--stage", "memory"])
    assert "--next picks its own stages" in capsys.readouterr().err


def test_dry_run_prints_the_queue(capsys, tmp_path):
    assert gpu_suite.main(["--dry-run", "--next", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GPU queue (" in out and "pending" in out and "attention 128K" in out and "stage attention:" in out


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
    assert gpu_queue.kernels_done([_report("kernels", results)])  # the queue moves on


def test_attention_lengths_must_be_the_stages(capsys):
    with pytest.raises(SystemExit):
        gpu_suite.parse_args(["--stage", "attention", "--lengths", "3M"])
    assert "--lengths for the attention stage: 128K, 1M, 2M" in capsys.readouterr().err
    assert gpu_suite.attention_lengths(("3M",)) == {} and gpu_attention.plan_cases("cuda", ["sdpa"], {}) == []


def test_a_backend_passing_again_loses_its_old_failure_even_untimed():
    old = [{**_row("sdpa", 250), "backend": "cudnn", "contract": "failed bf16", "fwd_ms": "", "fwd_tflops": ""},
           _row("sdpa", 250)]
    merged = kernel_speed.merge_rows(old, [], H100, passed={"cudnn"})
    assert [r["backend"] for r in merged] == ["sdpa"]
    assert kernel_speed.measured_order(H100, AUTO_ORDER, merged)[:2] == ("sdpa", "flash_attn4")
