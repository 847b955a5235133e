"""The GPU queue (``python -m titan_upipe.gpu_suite --next``) and the suite's run-time estimates, on
a CPU machine: the queue's order, its reports as its state (a cold speed report leaves its item
pending; the committed H200 reports of 2026-11-27 make the kernels and the 128K ranking done), the
speed stage's keep_attention runs and ``--select``, the estimates from the measured kernel table,
``--next`` running its children, and the compile caches those children share."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from titan_upipe.attention.backends import AUTO_ORDER
from titan_upipe.costs import kernel_speed
from titan_upipe.tools import compile_caches, gpu_queue, gpu_runs, gpu_suite

REPO = Path(__file__).resolve().parents[1]
SUPERSEDED = gpu_suite.REPORT_DIR / "superseded"

FIRST = ["speed 1M (flash_attn4)", "kernels kept_attention", "speed 1M keep_attention (flash_attn4)", "attention 1M",
         "memory llama3_8b upipe 3M", "memory llama3_8b upipe 4M", "speed 128K (flash_attn4)",
         "speed 2M ulysses (flash_attn4)", "speed 2M upipe (flash_attn4)", "kernels", "attention 128K"]


def _queue(fastest: str = "flash_attn4", estimate=lambda stage, lengths, select: 100.0) -> list:
    return gpu_queue.build_queue(estimate, fastest, AUTO_ORDER)


def _report(stage: str, results: list[dict], **env) -> dict:
    return {"stage": stage, "environment": env, "results": results}


def _speed(method: str, length: str = "1M", warm: bool = True, timed: int = 2, keep: bool = False) -> dict:
    """A speed result as the emulator's warm measurement writes it (``warm``, ``step_times_s``)."""
    argv = ["-m", "titan_upipe.emulate", "--json", *(gpu_queue.KEEP_ATTENTION if keep else gpu_queue.FULL_RECOMPUTE)]
    return {"name": f"llama3_8b {method} {length}", "method": method, "length": length, "argv": argv,
            "measurement": {"warm": warm, "step_times_s": [10.0] * timed}}


# --- the order -----------------------------------------------------------------------------------


def test_the_queue_puts_warm_speed_at_1m_first_then_attention_memory_and_speed():
    names = [i.name for i in _queue()]
    assert names[:len(FIRST)] == FIRST
    assert names[len(FIRST):] == [
        "memory llama3_8b upipe 5M", "memory qwen3_32b upipe_8gpu 2.5M",
        *(f"memory qwen3_32b upipe_usp {x}" for x in ("1M", "2M", "3M", "4M")),
        "tsp llama3_8b 128K", "tsp llama3_8b 1M", "tsp llama3_8b 2M", "attention 2M",
        "ring_documents 128K", "ring_documents 1M"]
    items = {i.name: i for i in _queue()}
    assert items["speed 1M (flash_attn4)"].argv == ("--stage", "speed", "--lengths", "1M")
    keep = items["speed 1M keep_attention (flash_attn4)"]
    assert keep.argv == ("--stage", "speed", "--lengths", "1M", "--select", "keep_attention")
    args = gpu_suite.parse_args([*keep.argv, "--budget-s", "540"])
    assert args.stage == "speed" and args.lengths == ("1M",) and args.select == "keep_attention"
    # the module docstring's table says the same, in 9 rows
    rows = [line.split(None, 1) for line in gpu_queue.__doc__.splitlines() if line[:1].isdigit()]
    assert [n for n, _ in rows] == [str(i) for i in range(1, 10)]
    assert rows[0][1].startswith("``speed`` 1M, warm") and rows[1][1].startswith("``attention`` at 1M")
    assert rows[2][1].startswith("``memory`` Llama3-8B UPipe 3M, then 4M") and rows[3][1].startswith("``speed`` 128K")
    assert rows[4][1].startswith("``kernels``") and "Qwen3-32B UPipe C=8" in rows[5][1]


def test_the_keep_attention_runs_are_their_own_call():
    """The speed stage's keep_attention runs carry the override and run only where ``--select``
    names them; without it the stage's plain runs (full activation checkpointing)."""
    plain = gpu_suite.plan_runs("speed", ("1M",))
    keep = gpu_suite.plan_runs("speed", ("1M",), "keep_attention")
    assert [r.name for r in plain] == ["llama3_8b ulysses 1M", "llama3_8b upipe 1M"]
    assert [r.name for r in keep] == ["llama3_8b ulysses 1M keep_attention", "llama3_8b upipe 1M keep_attention"]
    assert all(gpu_queue.kept_attention({"argv": r.argv}) and r.method in ("ulysses", "upipe") for r in keep)
    # the plain runs recompute, whatever the recipe says (the GPU recipes keep "auto")
    assert not any(gpu_queue.kept_attention({"argv": r.argv}) for r in plain)
    assert all(" ".join(gpu_queue.FULL_RECOMPUTE) in " ".join(r.argv) for r in plain)
    # the kernels stage's kept_attention check: its own item, its own --select
    check = {i.name: i for i in _queue()}["kernels kept_attention"]
    assert check.argv == ("--stage", "kernels", "--select", "kept_attention")
    assert gpu_suite.parse_args([*check.argv]).select == "kept_attention"
    assert [r.name for r in gpu_suite.plan_runs("kernels", None, "kept_attention")] == ["kept_attention"]
    assert not check.done([]) and check.done([_report("kernels", [{"check": "kept_attention", "ok": False}])])
    assert gpu_suite.plan_runs("speed", ("2M",), "keep_attention") == []  # 1M only
    # --select holds words, not a prefix: the memory items' selections as before
    assert [r.name for r in gpu_suite.plan_runs("memory", ("3M",), "llama3_8b upipe")] == ["llama3_8b upipe 3M"]
    assert [r.name for r in gpu_suite.plan_runs("speed", ("1M",), "upipe keep_attention")] == [
        "llama3_8b upipe 1M keep_attention"]


# --- the reports are the state -----------------------------------------------------------------------


def test_speed_is_done_only_by_warm_reports_of_the_fastest_backend():
    full, keep = (i for i in _queue("cudnn") if i.name.startswith("speed 1M"))
    warm = [_speed("ulysses"), _speed("upipe")]
    assert full.done([_report("speed", warm, attention_backend="cudnn")])
    assert not full.done([_report("speed", warm, attention_backend="sdpa")])  # another kernel
    cold = [_speed("ulysses", warm=False, timed=1), _speed("upipe", warm=False, timed=1)]
    assert not full.done([_report("speed", cold, attention_backend="cudnn")])
    one_step = [_speed("ulysses", timed=1), _speed("upipe", timed=1)]  # warm, but one timed step
    assert not full.done([_report("speed", one_step, attention_backend="cudnn")])
    legacy = [{**r, "measurement": {"step_time_s": 23.1}} for r in warm]  # no warm field at all
    assert not full.done([_report("speed", legacy, attention_backend="cudnn")])
    assert not full.done([_report("speed", warm[:1], attention_backend="cudnn")])  # UPipe still owed
    # the keep_attention item and the plain one: each only by its own runs
    kept = [_speed("ulysses", keep=True), _speed("upipe", keep=True)]
    assert keep.done([_report("speed", kept, attention_backend="cudnn")])
    assert not keep.done([_report("speed", warm, attention_backend="cudnn")])
    assert not full.done([_report("speed", kept, attention_backend="cudnn")])
    # 2M: a call per method, each item done by its own method
    ulysses_2m, upipe_2m = (i for i in _queue("cudnn") if i.name.startswith("speed 2M"))
    assert ulysses_2m.argv == ("--stage", "speed", "--lengths", "2M", "--select", "llama3_8b ulysses")
    report = _report("speed", [_speed("ulysses", "2M")], attention_backend="cudnn")
    assert ulysses_2m.done([report]) and not upipe_2m.done([report])


def test_the_h200s_cold_speed_reports_leave_speed_pending(tmp_path):
    """The first FlashAttention-4 run's speed and TSP reports (one cold step, kept under
    superseded/) do not count, wherever they are; the committed folder holds none of them."""
    cold = gpu_queue.load_reports([SUPERSEDED])
    assert {r["environment"]["device"] for r in cold if r["stage"] == "speed"} >= {"NVIDIA H200"}
    items = {i.name: i for i in _queue()}
    for name in ("speed 1M (flash_attn4)", "speed 128K (flash_attn4)"):
        assert not items[name].done(cold)
    for path in SUPERSEDED.glob("speed-*-h200.json"):
        (tmp_path / path.name.replace("-2026-11-27-h200", "")).write_text(path.read_text())
    assert not items["speed 1M (flash_attn4)"].done(gpu_queue.load_reports([tmp_path]))
    assert not items["tsp llama3_8b 128K"].done(cold)  # TSP's step time too: measured again, warm
    tsp = {**_speed("tsp", "128K"), "name": "llama3_8b tsp 128K"}
    assert items["tsp llama3_8b 128K"].done([_report("tsp", [tsp])])
    assert not [r for r in gpu_queue.load_reports([gpu_suite.REPORT_DIR]) if r["stage"] in ("speed", "tsp")]


def test_the_committed_h200_reports_are_the_queues_state():
    """kernels (FA4, cuDNN and SDPA contracts), attention at 128K and Qwen3-32B UPipe-in-USP at 1M
    and 2M are done by the reports of 2026-11-27; everything of items 1-4 is still to measure."""
    committed = gpu_queue.load_reports([gpu_suite.REPORT_DIR])
    assert {r["environment"]["device"] for r in committed if r["stage"] in ("kernels", "attention")} == {"NVIDIA H200"}
    done = {i.name for i in _queue() if i.done(committed)}
    assert done == {"kernels", "attention 128K", "memory qwen3_32b upipe_usp 1M", "memory qwen3_32b upipe_usp 2M"}
    assert gpu_queue.pending(_queue(), committed)[0].name == FIRST[0]


def test_the_kernels_and_attention_rules():
    items = {i.name: i for i in _queue()}
    contracts = [{"check": "contract", "case": f"{b} bf16 causal", "ok": True} for b in ("sdpa", "cudnn")]
    assert not items["kernels"].done([_report("kernels", contracts)])  # flash_attn4 has no verdict
    contracts.append({"check": "contract", "case": "flash_attn4", "ok": True, "skipped": True})
    assert items["kernels"].done([_report("kernels", contracts)])
    attention = [{"backend": b, "skipped": True, "ok": True} for b in AUTO_ORDER if b not in ("sdpa", "cudnn")]
    attention.append({"backend": "cudnn", "ok": False, "contract": "failed bf16 causal"})  # reported: done
    llama = {"backend": "sdpa", "shape": "llama3_8b", "length": "128K", "kind": "dense", "fwd_ms": 1.0}
    assert not items["attention 128K"].done([_report("attention", [*attention, llama])])  # qwen3_32b owed
    qwen = {**llama, "shape": "qwen3_32b", "fwd_ms": None, "ok": False, "error": "RuntimeError: x"}
    assert items["attention 128K"].done([_report("attention", [*attention, llama, qwen])])
    assert not items["attention 1M"].done([_report("attention", [*attention, llama, qwen])])


# --- the estimates ---------------------------------------------------------------------------------


def test_estimates_divide_one_ranks_attention_flops_by_the_kernel_tables_rates():
    """1M on an sm90 GPU with FlashAttention-4: 4 query heads of 128 over 1M tokens per rank (Llama3-8B
    over 8 GPUs), two forwards and a backward (full activation checkpointing) at the H200's measured
    geometric-mean rates; computed here from the shipped table's numbers, not the code's path."""
    fwd_flops = 2 * 4 * 128 * (1 << 20) ** 2  # the causal half of QK^T and PV
    fwd_rate = (675.2 * 674.1) ** 0.5 * 1e12
    bwd_rate = (614.7 * 614.8) ** 0.5 * 1e12
    per_layer = 2 * fwd_flops / fwd_rate + 2.5 * fwd_flops / bwd_rate
    assert gpu_suite.attention_seconds_per_layer("1M", "flash_attn4", "sm90") == pytest.approx(per_layer)
    assert 7.5 < per_layer < 8.5  # the H200 emulator's 1M step: 20 s of attention over 2 cold blocks
    assert gpu_suite.attention_seconds_per_layer("4M", "flash_attn4", "sm90") == pytest.approx(16 * per_layer)
    run = gpu_suite.run_estimate_s("1M", backend="flash_attn4", arch="sm90")
    assert run == pytest.approx(gpu_suite.STARTUP_S + 2 * (per_layer + gpu_suite.OTHER_S_PER_LAYER_M))
    assert 44 <= run <= 50  # the H200's 1M speed runs: 44-47 s each
    two = gpu_suite.run_estimate_s("1M", work=2.0, backend="flash_attn4", arch="sm90")
    assert two - run == pytest.approx(2 * per_layer)


def test_estimates_follow_the_kernel_that_runs():
    """SDPA's rates give SDPA's time; a machine without a GPU plans with the newest measured
    architecture and the fastest kernel the GPU machines carry (FA4), not with SDPA's slowdown."""
    fa4 = gpu_suite.attention_seconds_per_layer("1M", "flash_attn4", "sm90")
    sdpa = gpu_suite.attention_seconds_per_layer("1M", "sdpa", "sm90")
    assert 1.9 < sdpa / fa4 < 2.1  # 332 / 315 TFLOP/s against 675 / 615
    assert gpu_suite.planning_arch() == "sm90" and gpu_suite.fastest_backend() == "flash_attn4"
    assert gpu_suite.attention_seconds_per_layer("1M") == pytest.approx(fa4)
    # unmeasured there: the deliberately low assumption
    assumed = gpu_suite.attention_seconds_per_layer("1M", "sdpa", "sm80")
    assert assumed == pytest.approx(4.5 * 2 * 4 * 128 * (1 << 20) ** 2 / (kernel_speed.ASSUMED_TFLOPS * 1e12))


def test_estimates_scale_with_the_table(monkeypatch):
    rows = kernel_speed.read_rows()
    faster = [{**r, "fwd_tflops": str(2 * float(r["fwd_tflops"])), "bwd_tflops": str(2 * float(r["bwd_tflops"]))}
              for r in rows]
    monkeypatch.setattr(kernel_speed, "read_rows", lambda path=None: faster)
    assert gpu_suite.attention_seconds_per_layer("2M", "cudnn", "sm90") == pytest.approx(
        kernel_speed.attention_rate("cudnn", "sm90", rows=rows).seconds(
            *kernel_speed.causal_flops([2 << 20], 4, 128), forwards=2) / 2)


def test_the_queue_items_estimates_are_their_calls():
    items = {i.name: i for i in gpu_queue.build_queue(gpu_suite.call_estimate_s, "flash_attn4", AUTO_ORDER)}
    speed = items["speed 1M (flash_attn4)"].estimate_s
    assert speed == pytest.approx(sum(r.estimate_s for r in gpu_suite.plan_runs("speed", ("1M",))))
    assert items["speed 1M keep_attention (flash_attn4)"].estimate_s == pytest.approx(speed)
    assert items["memory llama3_8b upipe 4M"].estimate_s == pytest.approx(
        gpu_suite.run_estimate_s("4M", backend="flash_attn4", arch="sm90"))
    # each item of items 1-4 fits one 10-minute call (their warm runs included)
    for name in FIRST:
        assert items[name].estimate_s <= gpu_suite.DEFAULT_BUDGET_S, name
    # with FA4 on sm90 the 5M run fits one 10-minute call; 6M does not
    assert items["memory llama3_8b upipe 5M"].estimate_s < gpu_suite.DEFAULT_BUDGET_S
    assert gpu_suite.run_estimate_s("6M") > gpu_suite.DEFAULT_BUDGET_S


def test_the_2m_kernel_ranking_is_taken_in_several_calls():
    """The attention stage keeps what an earlier call timed: its item needs only its first case to
    fit a call, not all of them (at 2M over a 10-minute call)."""
    items = {i.name: i for i in gpu_queue.build_queue(gpu_suite.call_estimate_s, "flash_attn4", AUTO_ORDER,
                                                      gpu_suite.call_start_s)}
    whole = items["attention 2M"]
    assert whole.estimate_s > gpu_suite.DEFAULT_BUDGET_S
    assert whole.needs_s == pytest.approx(gpu_suite.plan_runs("attention", ("2M",))[0].estimate_s)
    assert whole.needs_s < 60
    assert items["memory llama3_8b upipe 4M"].needs_s == items["memory llama3_8b upipe 4M"].estimate_s
    committed = gpu_queue.load_reports([gpu_suite.REPORT_DIR])
    attempted = {i.name for i in items.values() if i.name != "attention 2M"}
    assert gpu_queue.next_item(list(items.values()), committed, 540, attempted) is whole


# --- --next -------------------------------------------------------------------------------------------


def test_next_takes_the_first_pending_item_that_fits_and_never_retries_one():
    items = _queue(estimate=lambda stage, lengths, select: 900.0 if "5M" in lengths else 50.0)
    assert gpu_queue.next_item(items, [], 540, set()).name == FIRST[0]
    memory_5m = next(i for i in items if i.name == "memory llama3_8b upipe 5M")
    attempted = {i.name for i in items[: items.index(memory_5m)]}
    after = gpu_queue.next_item(items, [], 540, attempted)
    assert after.name == "memory qwen3_32b upipe_8gpu 2.5M"  # 900 s does not fit a 10-minute call: passed over
    assert gpu_queue.next_item(items, [], 10, set()) is None


def test_next_runs_children_until_nothing_fits(monkeypatch, tmp_path):
    """``--next`` on a GPU: each item a child call of the suite with what is left of the budget; a
    child that writes its report moves the queue on."""
    calls = []

    class Done:
        returncode = 0

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        if cmd[cmd.index("--stage") + 1] == "kernels" and "--select" in cmd:  # one check: its own report
            (tmp_path / "kernels-check.json").write_text(json.dumps(_report("kernels", [{"check": "kept_attention"}])))
        elif cmd[cmd.index("--stage") + 1] == "kernels":
            results = [{"check": "contract", "case": f"{b} x", "ok": True} for b in gpu_queue.KERNEL_BACKENDS]
            (tmp_path / "kernels.json").write_text(json.dumps(_report("kernels", results)))
        return Done()

    monkeypatch.setattr(gpu_suite.subprocess, "run", fake_run)
    monkeypatch.setattr(gpu_suite, "REPORT_DIR", tmp_path / "committed")
    monkeypatch.setattr(gpu_suite, "call_estimate_s", lambda stage, lengths, select: 200.0)
    args = gpu_suite.parse_args(["--next", "--out", str(tmp_path), "--budget-s", "500"])
    assert gpu_suite.run_next(args, time.monotonic() + 500) == 0
    stages = [c[c.index("--stage") + 1] for c in calls]
    assert stages[:3] == ["speed", "kernels", "speed"] and len(calls) == len(_queue())
    assert all(float(c[c.index("--budget-s") + 1]) <= 500 and c[c.index("--out") + 1] == str(tmp_path)
               for c in calls)


def test_next_is_refused_with_a_stage(capsys):
    with pytest.raises(SystemExit):
        gpu_suite.parse_args(["--next", "--stage", "memory"])
    assert "--next picks its own stages" in capsys.readouterr().err


def test_dry_run_prints_the_queue(capsys, tmp_path):
    assert gpu_suite.main(["--dry-run", "--next", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GPU queue (" in out and "pending" in out and "stage attention:" in out
    lines = [line for line in out.splitlines() if line.startswith("  pending") or line.startswith("  done")]
    assert lines[0].split("s  ", 1)[1].startswith(FIRST[0]) and lines[FIRST.index("kernels")].startswith("  done")


# --- the compile caches ----------------------------------------------------------------------------


def test_the_suites_children_share_compile_caches_in_tmp(monkeypatch):
    """FlashAttention-4's disk cache switched on, every compiler's cache under /tmp (kept between
    the calls of one machine); a variable already set is the user's and stays."""
    for name in (*compile_caches.CACHE_DIRS, *compile_caches.SWITCHES):
        monkeypatch.delenv(name, raising=False)
    env = gpu_runs.child_env()
    assert env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    for name in ("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "CUTE_DSL_CACHE_DIR", "TRITON_CACHE_DIR",
                 "TORCHINDUCTOR_CACHE_DIR"):
        assert env[name].startswith("/tmp/")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/scratch/triton")
    assert gpu_runs.child_env()["TRITON_CACHE_DIR"] == "/scratch/triton"
    # scripts/gpu_suite.sh evaluates what the module prints, before any package import
    printed = subprocess.run(["python3", str(REPO / "titan_upipe/tools/compile_caches.py")], capture_output=True,
                             text=True, check=True, env={"PATH": "/usr/bin:/bin"}).stdout
    assert "export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1" in printed.splitlines()
    assert "titan_upipe/tools/compile_caches.py" in (REPO / "scripts/gpu_suite.sh").read_text()
