"""The GPU validation suite on a CPU machine: its dry run, its plan of runs, its kernels stage (run
for real with the CPU kernels), its emulator-stage bookkeeping and the wheel manifest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_upipe.attention.backends import SdpaCpuKernels
from titan_upipe.tools import gpu_reports, gpu_runs, gpu_suite, gpu_wheels

REPO = Path(__file__).resolve().parents[1]


def test_dry_run_exits_0_and_lists_every_stage(capsys):
    assert gpu_suite.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for stage in gpu_suite.STAGES:
        assert f"stage {stage}:" in out
    assert "configs/llama3_8b/upipe_5m.toml" in out and "configs/qwen3_32b/upipe_usp_4m.toml" in out
    assert "wheels:" in out and "dry run: ready" in out
    # the closure of the carried set, and what it means for FlashAttention-4 (tests/test_gpu_wheels.py)
    assert "closure over the image's" in out and "flash_attn.cute.interface: would import" in out


def test_dry_run_as_a_module_command():
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "titan_upipe.gpu_suite", "--dry-run", "--stage", "speed"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "stage speed: 6 runs" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "9M"], "valid lengths are 128K"),
    (["--budget-s", "0"], "--budget-s must be positive"),
    (["--stage", "memroy"], "invalid choice"),
])
def test_bad_arguments_are_one_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_suite.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_the_suite_says_so(capsys):
    assert gpu_suite.main(["--stage", "kernels"]) == 2
    assert "no CUDA device here" in capsys.readouterr().err


def test_memory_plan_covers_the_issue():
    runs = gpu_suite.plan_runs("memory")
    names = [r.name for r in runs]
    for method in ("ulysses", "upipe"):
        for length in ("128K", "1M", "2M", "3M", "4M", "5M", "6M", "7M", "8M"):
            assert f"llama3_8b {method} {length}" in names
    assert [r.length for r in runs if r.method == "upipe_usp"] == ["1M", "2M", "3M", "4M", "5M", "6M"]
    # Ulysses beyond its recipes: the 5M recipe, longer; UPipe's 6M and 7M recipes (issue 18) as shipped
    beyond = next(r for r in runs if r.name == "llama3_8b ulysses 7M")
    assert "configs/llama3_8b/ulysses_5m.toml" in beyond.argv and str(7 * 2**20) in beyond.argv
    recipe = next(r for r in runs if r.name == "llama3_8b upipe 7M")
    assert "configs/llama3_8b/upipe_7m.toml" in recipe.argv and "--training.seq_len" not in recipe.argv
    assert "configs/qwen3_32b/upipe_usp_6m.toml" in next(r for r in runs if r.name == "qwen3_32b upipe_usp 6M").argv
    assert all("--n-layers" in r.argv for r in runs)


def test_the_queue_runs_qwen3_32b_on_one_node_after_the_llama3_memory_lengths():
    """Issue 34: the memory stage on the 2.5M one-node Qwen3-32B recipe comes right after the
    Llama3-8B memory lengths and before the 16-GPU Qwen3-32B ones (item 6; the whole order:
    tests/test_gpu_queue.py); its child call's arguments parse, and the module docstring's table
    says the same."""
    from titan_upipe.tools import gpu_queue

    names = [i.name for i in gpu_queue.build_queue(lambda stage, lengths, select: 100.0, "sdpa", ("sdpa",))]
    one_node = names.index("memory qwen3_32b upipe_8gpu 2.5M")
    assert names[one_node - 1] == "memory llama3_8b upipe 5M"
    assert names[one_node + 1:one_node + 5] == [f"memory qwen3_32b upipe_usp {x}" for x in ("1M", "2M", "3M", "4M")]
    items = gpu_queue.build_queue(lambda stage, lengths, select: 100.0, "sdpa", ("sdpa",))
    item = next(i for i in items if i.name == "memory qwen3_32b upipe_8gpu 2.5M")
    assert item.argv == ("--stage", "memory", "--lengths", "2.5M", "--select", "qwen3_32b upipe_8gpu")
    args = gpu_suite.parse_args([*item.argv, "--budget-s", "540"])
    assert args.lengths == ("2.5M",) and args.select == "qwen3_32b upipe_8gpu"
    run = {"name": "qwen3_32b upipe_8gpu 2.5M", "measurement": {"x": 1}}
    assert not item.done([]) and item.done([{"stage": "memory", "environment": {}, "results": [run]}])
    assert not item.done([{"stage": "memory", "environment": {}, "results": [{**run, "measurement": None}]}])
    rows = [line.split(None, 1) for line in gpu_queue.__doc__.splitlines() if line[:1].isdigit()]
    assert [n for n, _ in rows] == [str(i) for i in range(1, 10)]
    assert rows[5][1].startswith("``memory`` Llama3-8B UPipe 5M; Qwen3-32B UPipe C=8") and "on one node, 2.5M" in \
        gpu_queue.__doc__


def test_the_memory_stage_selects_and_runs_the_one_node_qwen3_recipe(monkeypatch, capsys):
    """Dry, without a GPU: ``--select 'qwen3_32b upipe_8gpu' --lengths 2.5M`` is one emulator run of
    the committed 2.5M recipe over 8 ranks on 2 blocks with every input offloaded (resident_blocks 0:
    in a 2-block model the recipe's 2 resident inputs would be all of them); its estimate is twice
    Llama3-8B's attention work per layer (64 / 8 heads per rank against 32 / 8); the planner columns
    plan what the run measures (the override included) and no paper column (the paper ran 16 GPUs)."""
    from dataclasses import replace

    from titan_upipe.plan import plan
    from titan_upipe.torchtitan_0_2.config_parse import parse_config
    from titan_upipe.torchtitan_0_2.job_plan import plan_input_from_job_config

    runs = gpu_suite.plan_runs("memory", ("2.5M",), "qwen3_32b upipe_8gpu")
    assert [r.name for r in runs] == ["qwen3_32b upipe_8gpu 2.5M"]
    run = runs[0]
    assert run.argv[1:] == ("-m", "titan_upipe.emulate", "--job.config_file", "configs/qwen3_32b/upipe_8gpu_2_5m.toml",
                            "--cp-world", "8", "--n-layers", "2", "--json", "--activation_checkpoint.keep_attention", "off",
                            "--activation_checkpoint.resident_blocks", "0")
    assert (REPO / "configs/qwen3_32b/upipe_8gpu_2_5m.toml").exists()
    per_layer = gpu_suite.attention_seconds_per_layer("2.5M")  # Llama3-8B's (the kernel table's rates)
    rest = gpu_suite.OTHER_S_PER_LAYER_M * 2.5
    assert run.estimate_s == pytest.approx(gpu_suite.STARTUP_S + 2 * (2 * per_layer + rest))
    assert run.estimate_s <= gpu_suite.DEFAULT_BUDGET_S  # one 10-minute call
    assert [r.length for r in gpu_suite.plan_runs("memory") if r.method == "upipe_8gpu"] == ["1M", "2M", "2.5M"]
    assert gpu_suite.main(["--dry-run", "--stage", "memory", "--lengths", "2.5M", "--select", "qwen3_32b upipe_8gpu"]) == 0
    out = capsys.readouterr().out
    assert "stage memory: 1 runs, 1 within 540 s" in out and "upipe_8gpu_2_5m.toml" in out and "dry run: ready" in out

    def fake(run, timeout_s=None):
        return run.result(ok=True, oom=False, measurement={"n_layers": 2})

    planned = []
    monkeypatch.setattr(gpu_runs, "run_emulator", fake)
    from titan_upipe.tools import gpu_context  # plans what a run measured

    monkeypatch.setattr(gpu_context, "parse_config", lambda argv: planned.append(argv) or parse_config(argv))
    result, = gpu_suite.run_emulator_stage("memory", runs)
    assert planned[-1][-2:] == ["--activation_checkpoint.resident_blocks", "0"]  # what the run measured
    job = plan_input_from_job_config(parse_config(["--job.config_file", str(REPO / "configs/qwen3_32b/upipe_8gpu_2_5m.toml")]),
                                     world_size=8, device="cuda")
    assert job.resident_blocks == 2 and job.optimizer_state_on_host
    measured_job = replace(job, resident_blocks=0)
    assert result["planner_gib"] == plan(measured_job).peak_gpu_bytes / 2**30
    two = replace(measured_job, model=replace(job.model, n_layers=2))
    assert result["planner_gib_run_depth"] == plan(two).peak_gpu_bytes / 2**30
    assert result["paper_gib"] is None and result["method"] == "upipe_8gpu"
    assert gpu_context.config_overrides(["--json", "--training.seq_len", "4096", "--activation_checkpoint.cpu_offload",
                                         "--n-layers", "2"]) == ["--training.seq_len", "4096",
                                                                 "--activation_checkpoint.cpu_offload"]


def test_every_stage_has_a_selection_within_a_call_and_each_run_fits_alone():
    """A stage is a call under 9 minutes: what does not fit is left for the next call, and every
    single run fits a call on its own (else it could never be measured)."""
    for stage in gpu_suite.STAGES:
        runs = gpu_suite.plan_runs(stage)
        now, later = gpu_suite.schedule_within(runs, gpu_suite.DEFAULT_BUDGET_S)
        assert now and sum(r.estimate_s for r in now) <= gpu_suite.DEFAULT_BUDGET_S
        assert now + later == runs
    # 6M and beyond take longer than one call with FlashAttention-4 on sm90 (the kernel table's
    # H200 rates, 2026-11-27): a node without a call limit runs them with a larger --budget-s
    too_long = {r.name for r in gpu_suite.plan_runs("memory") if r.estimate_s > gpu_suite.DEFAULT_BUDGET_S}
    assert too_long == {f"{model} {n}" for model in ("llama3_8b ulysses", "llama3_8b upipe", "qwen3_32b upipe_usp")
                        for n in ("6M", "7M", "8M") if not (model.startswith("qwen") and n in ("7M", "8M"))}


def test_schedule_stops_at_the_first_run_over_budget():
    runs = [gpu_suite.Run("memory", str(i), estimate_s=s) for i, s in enumerate((100, 300, 50, 200))]
    now, later = gpu_suite.schedule_within(runs, 420)
    assert [r.name for r in now] == ["0", "1"] and [r.name for r in later] == ["2", "3"]


def test_a_run_that_does_not_fit_before_the_deadline_is_not_started(monkeypatch):
    """Each (fake) run takes its estimate on a fake clock; the third does not fit what is left."""
    runs = gpu_suite.plan_runs("memory", ("128K", "1M"))
    clock, started, saved = [0.0], [], []

    def fake(run, timeout_s=None):
        started.append((run.name, timeout_s))
        clock[0] += run.estimate_s
        return {"name": run.name, "method": run.method, "length": run.length, "model": "llama3_8b",
                "command": "", "argv": list(run.argv[1:]), "ok": True, "oom": False, "measurement": None}

    monkeypatch.setattr(gpu_runs, "run_emulator", fake)
    monkeypatch.setattr(gpu_suite.time, "monotonic", lambda: clock[0])
    deadline = runs[0].estimate_s + runs[1].estimate_s + runs[2].estimate_s / 2
    results = gpu_suite.run_emulator_stage("memory", runs, deadline, lambda r, rest: saved.append((len(r), len(rest))))
    assert [name for name, _ in started] == [runs[0].name, runs[1].name]
    assert started[0][1] == pytest.approx(deadline) and started[1][1] == pytest.approx(deadline - runs[0].estimate_s)
    assert len(results) == 2 and saved[-1] == (2, len(runs) - 2)  # the report lists those not started


def test_stage_all_runs_each_stage_in_a_child_within_one_budget(monkeypatch):
    commands = []

    class Done:
        returncode = 0

    monkeypatch.setattr(gpu_suite.subprocess, "run", lambda cmd, **kw: commands.append(cmd) or Done())
    import time

    args = gpu_suite.parse_args(["--stage", "all", "--budget-s", "500", "--lengths", "1M"])
    assert gpu_suite.run_all_in_children(args, time.monotonic() + 500) == 0
    assert [c[c.index("--stage") + 1] for c in commands] == list(gpu_suite.STAGES)
    assert all(float(c[c.index("--budget-s") + 1]) <= 500 and "1M" in c for c in commands)


def test_kernels_stage_runs_on_cpu_and_writes_its_report(tmp_path):
    args = gpu_suite.parse_args(["--stage", "kernels", "--out", str(tmp_path)])
    report = gpu_suite.run_stage("kernels", args, ["--stage", "kernels"], device="cpu")
    assert report.ok, [r for r in report.results if not r["ok"]]
    checks = {r["check"] for r in report.results if not r["skipped"]}
    assert checks == {"contract", "fused_ce", "offload_streams", "bf16_parity", "compile", "kept_attention"}
    skipped = {r["case"] for r in report.results if r["skipped"]}
    assert {"flash_attn4", "flash_attn3", "flash_attn", "liger"} <= skipped  # no CUDA here: said, not hidden
    varlen = [r for r in report.results if r["check"] == "varlen"]  # packed documents' kernels: none on CPU
    assert [r["case"] for r in varlen] == ["flash_attn4", "flash_attn3", "flash_attn"]
    assert all(r["skipped"] and r["detail"] for r in varlen)
    json_path, md_path = report.write(tmp_path)
    saved = json.loads(json_path.read_text())
    assert saved["ok"] and saved["environment"]["torch"] == torch.__version__
    text = md_path.read_text()
    assert "command: python -m titan_upipe.gpu_suite --stage kernels" in text and "| contract |" in text


def test_kernels_stage_fails_on_a_wrong_attention_gradient(monkeypatch):
    """A backward whose dV is 50 % off fails both the contract and the model-level bf16 parity."""
    from titan_upipe.tools import gpu_kernels

    original = SdpaCpuKernels.backward

    def wrong(self, *args, **kwargs):
        dq, dk, dv = original(self, *args, **kwargs)
        return dq, dk, dv * 1.5

    monkeypatch.setattr(SdpaCpuKernels, "backward", wrong)
    assert not all(r["ok"] for r in gpu_kernels.contract_checks("cpu"))
    assert not gpu_kernels.parity_checks("cpu")[0]["ok"]


def _fake_record(method: str, length: str, step_s: float, seq_len: int, warm: bool = True) -> dict:
    timed = {"warm": True, "steps": 3, "warmup_steps": 1, "step_times_s": [step_s / 16, step_s / 16 * 1.01],
             "compile_s": 6.0, "kernel_compiles_during_timed_steps": 0} if warm else \
        {"warm": False, "steps": 1, "warmup_steps": 1, "step_times_s": [], "compile_s": None,
         "kernel_compiles_during_timed_steps": None}
    return {"oom": False, "seq_len": seq_len, "batch": 1, "cp_degree": 8, "n_layers": 2, **timed,
            "full": {"modeled_step_time_s": step_s, "device_peak_allocated_bytes": 2**30,
                     "device_peak_reserved_bytes": 2**31}}


def test_speed_results_are_checked_against_an_independent_computation(monkeypatch):
    runs = gpu_suite.plan_runs("speed", ("1M",))
    steps = {"ulysses": 300.0, "upipe": 310.0}

    def fake(run, timeout_s=None):
        return {"name": run.name, "method": run.method, "length": run.length, "model": "llama3_8b", "ok": True,
                "oom": False, "measurement": _fake_record(run.method, run.length, steps[run.method], 2**20)}

    monkeypatch.setattr(gpu_runs, "run_emulator", fake)
    results = gpu_suite.run_emulator_stage("speed", runs)
    upipe = next(r for r in results if r["method"] == "upipe")
    assert upipe["tokens_per_s"] == pytest.approx(2**20 / 310.0 / 8)
    assert upipe["ratio"] == pytest.approx(310 / 300)
    assert upipe["paper_ratio"] == pytest.approx(276.39 / 275.06)
    assert upipe["paper_tokens_per_s"] == pytest.approx(472.53)


TIMED_KEYS = ("warm", "steps", "warmup_steps", "step_times_s", "compile_s", "kernel_compiles_during_timed_steps")


@pytest.mark.parametrize("old", [False, True], ids=["warm false", "a report from before issue 41"])
def test_no_tokens_per_s_or_ratio_from_a_single_cold_step(monkeypatch, old):
    """A cold step (no untimed warm-up: first-use compilation inside it) gives no tokens/s and no
    UPipe / Ulysses ratio, in the results and in the Markdown, which says why; the other method's
    warm step keeps its tokens/s."""
    runs = gpu_suite.plan_runs("speed", ("1M",))

    def fake(run, timeout_s=None):
        record = _fake_record(run.method, run.length, 300.0, 2**20, warm=run.method == "ulysses")
        if run.method == "upipe" and old:
            record = {k: v for k, v in record.items() if k not in TIMED_KEYS}
        return {"name": run.name, "method": run.method, "length": run.length, "model": "llama3_8b", "ok": True,
                "oom": False, "measurement": record}

    monkeypatch.setattr(gpu_runs, "run_emulator", fake)
    results = gpu_suite.run_emulator_stage("speed", runs)
    ulysses, upipe = (next(r for r in results if r["method"] == m) for m in ("ulysses", "upipe"))
    assert ulysses["tokens_per_s"] == pytest.approx(2**20 / 300.0 / 8) and "refused" not in ulysses
    assert "tokens_per_s" not in upipe and "ratio" not in upipe and "cold step" in upipe["refused"]
    text = "\n".join(gpu_reports.StageReport("speed", {}, results, lengths=("1M",)).markdown())
    assert "| 1M | upipe | 1 cold | 300.00 | refused |" in text, text
    assert "| 1M | ulysses | 1 + 2, compile 6.0 s | 300.00 | 436.91 |" in text, text
    assert "llama3_8b upipe 1M: a single cold step" in text and "no tokens/s and no ratio" in text


def test_speed_and_tsp_runs_time_warm_steps_and_their_estimates_count_them():
    """The speed and tsp stages run 3 steps, the first an untimed warm-up; their estimates are the
    one-step estimate's step part times the steps and the compile pass, the start-up once."""
    for stage, length in (("speed", "1M"), ("tsp", "1M")):
        run = gpu_suite.plan_runs(stage, (length,))[0]
        argv = list(run.argv)
        assert argv[argv.index("--steps") + 1] == "3" and argv[argv.index("--warmup-steps") + 1] == "1", argv
        one = gpu_suite.run_estimate_s(length)
        assert run.estimate_s == pytest.approx(gpu_suite.STARTUP_S + (one - gpu_suite.STARTUP_S) * 3.5)
    assert all("--steps" not in r.argv for r in gpu_suite.plan_runs("memory"))  # memory: one step, cold


def test_memory_series_stops_at_the_first_oom(monkeypatch):
    runs = [r for r in gpu_suite.plan_runs("memory", ("4M", "5M", "6M")) if r.method == "ulysses"]
    calls = []

    def fake(run, timeout_s=None):
        calls.append(run.length)
        return {"name": run.name, "method": run.method, "length": run.length, "model": "llama3_8b",
                "command": " ".join(run.argv[1:]), "argv": list(run.argv[1:]), "ok": True,
                "oom": run.length == "4M", "measurement": None}

    monkeypatch.setattr(gpu_runs, "run_emulator", fake)
    results = gpu_suite.run_emulator_stage("memory", runs)
    assert calls == ["4M"]
    assert [r.get("skipped", False) for r in results] == [False, True, True]
    assert results[0]["planner_gib"] > 0 and results[0]["paper_gib"] is None  # Table 4: Ulysses OOM at 4M
    report = gpu_suite.StageReport("memory", {}, results, lengths=("4M", "5M", "6M"))
    assert report.label == "memory-4M-5M-6M"
    lines = report.markdown()
    assert any("| llama3_8b | ulysses | 4M |" in line and "OOM" in line for line in lines)


def test_one_real_emulator_run_is_parsed():
    """The subprocess, JSON and planner plumbing of the memory stage, on a CPU debug config."""
    run = gpu_suite.Run("memory", "llama3 debug upipe 1K",
                        gpu_runs.emulator_argv("configs/debug/upipe.toml", 4, "--training.seq_len", "1024"),
                        method="upipe", length="1K")
    result = gpu_runs.run_emulator(run)
    assert result["ok"], result.get("error")
    m = result["measurement"]
    assert m["seq_len"] == 1024 and m["cp_degree"] == 4 and m["n_layers"] == 2 and m["total_peak_bytes"] > 0


# --- the wheels ---------------------------------------------------------------------------------


def test_wheels_split_reassemble_and_verify(tmp_path):
    big = tmp_path / "nvidia_cutlass_dsl_libs_cu13-4.8.1-py3-none-manylinux_2_28_x86_64.whl"
    big.write_bytes(bytes(range(256)) * 100)  # 25,600 bytes
    small = tmp_path / "torchtitan-0.2.2-py3-none-any.whl"
    small.write_bytes(b"titan")
    manifest = gpu_wheels.split(tmp_path, part_bytes=10_000)
    entry = next(e for e in manifest["wheels"] if e["file"] == big.name)
    assert len(entry["parts"]) == 3 and not big.exists()
    assert all((tmp_path / p).stat().st_size <= 10_000 for p in entry["parts"])
    problems, _ = gpu_wheels.check_manifest(tmp_path)
    assert any("flash_attn_4-4.0.0b36" in p and "of the lock is missing" in p for p in problems)  # the lock is checked
    wheels = gpu_wheels.reassemble(tmp_path)
    assert big.read_bytes() == bytes(range(256)) * 100 and set(wheels) == {big, small}
    big.unlink()
    (tmp_path / entry["parts"][1]).write_bytes(b"damaged")
    with pytest.raises(SystemExit, match="sha256 differs"):
        gpu_wheels.reassemble(tmp_path)
    (tmp_path / entry["parts"][1]).unlink()
    problems, _ = gpu_wheels.check_manifest(tmp_path)
    assert any("missing" in p and entry["parts"][1] in p for p in problems)


def test_wheel_names_parse():
    assert gpu_wheels.wheel_name("flash_attn_4-4.0.0b36-py3-none-any.whl") == ("flash_attn_4", "4.0.0b36")
    assert gpu_wheels.wheel_name("apache_tvm_ffi-0.1.15.post2-cp312-abi3-manylinux_2_28_x86_64.whl") == (
        "apache_tvm_ffi", "0.1.15.post2")


def test_no_manifest_is_reported_with_the_fix(tmp_path):
    problems, lines = gpu_wheels.check_manifest(tmp_path / "absent")
    assert problems == [] and "scripts/gpu_wheels.sh" in lines[0]


def test_pythonpath_includes_what_pth_files_add(tmp_path):
    """The CuTe DSL's ``cutlass`` is importable only through its ``.pth`` line, which a
    ``PYTHONPATH`` entry never runs (FlashAttention-4 failed to import on the H100, 2026-11-23)."""
    package = tmp_path / "dsl_meta"
    (package / "dsl_packages").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "dsl_packages" / "hidden_mod.py").write_text("VALUE = 7\n")
    (tmp_path / "dsl_meta.pth").write_text(
        "import sys, os, dsl_meta; sys.path.insert(0, os.path.join(dsl_meta.__path__[0], 'dsl_packages'))\n")
    paths = gpu_wheels.site_paths(tmp_path)
    assert paths[0] == str(tmp_path) and str(package / "dsl_packages") in paths
    probe = [sys.executable, "-c", "import hidden_mod; print(hidden_mod.VALUE)"]
    assert subprocess.run(probe, env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True).returncode != 0
    done = subprocess.run(probe, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)}, capture_output=True,
                          text=True)
    assert done.stdout.strip() == "7"


def test_planner_matches_the_h100_at_the_depth_it_ran(tmp_path):
    """The committed H100 memory reports, replanned by this checkout: at the depth the run built
    (2 blocks, no extrapolation on either side) the planner is within 1 % of
    ``max_memory_allocated`` for every UPipe run (Ulysses 1M: 5.7 % under, docs/planner.md). At the
    full depth the two differ by the emulator's extrapolation bias: the 2-block run's peak (block
    1, the last) holds the output projection's fp32 reduce-scatter input, the full model's block 1
    holds block 2's, 4·(P_o − P_b) bytes less (at 128K the full model's peak moves to block 0, whose
    embedding all-gather takes part of that back). Measurements are left as they were."""
    from titan_upipe.plan import model_dims

    llama = model_dims("llama3_8b")
    bias = 4 * (llama.output_params - llama.block_params) / 2**30
    for name in ("memory-128K-1M.json", "memory-2M.json"):
        original = json.loads((REPO / "docs/benchmarks/gpu" / name).read_text())
        copy = tmp_path / name
        copy.write_text(json.dumps(original))
        report = gpu_suite.replan_report(copy, "test")
        for before, r in zip(original["results"], report.results, strict=True):
            assert r["measurement"] == before["measurement"]
            measured = r["measurement"]["device_peak_allocated_bytes"] / 2**30
            error = r["planner_gib_run_depth"] / measured - 1
            assert -0.01 <= error <= 0 if r["method"] == "upipe" else -0.06 <= error <= 0, (name, r["name"], error)
            full_gap = r["measurement"]["full"]["device_peak_allocated_bytes"] / 2**30 - r["planner_gib"]
            run_gap = measured - r["planner_gib_run_depth"]
            if r["length"] == "128K":
                assert 0.3 < full_gap - run_gap < bias, (r["name"], full_gap, run_gap, bias)
            else:
                assert abs(full_gap - run_gap - bias) < 0.01, (r["name"], full_gap, run_gap, bias)
        assert report.environment["planner columns recomputed"] == "test"
        assert any("planner GiB (same layers)" in line for line in report.markdown())


def test_a_gpu_run_rewrites_the_image_list_from_the_machine(tmp_path, monkeypatch):
    """``pip list --format=freeze`` of the interpreter itself, with ``PYTHONPATH`` (the carried
    wheels, this checkout) off the path, over the committed list and into the report folder."""
    committed = tmp_path / "gpu_image_packages.txt"
    monkeypatch.setattr(gpu_reports, "IMAGE_PACKAGES", committed)
    carried = tmp_path / "carried" / "zz_carried_wheel-1.0.dist-info"
    carried.mkdir(parents=True)
    (carried / "METADATA").write_text("Metadata-Version: 2.1\nName: zz-carried-wheel\nVersion: 1.0\n")
    monkeypatch.setenv("PYTHONPATH", str(carried.parent))
    listed = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True)
    assert "zz-carried-wheel==1.0" in listed.stdout  # on the path, pip would list it
    copy = gpu_reports.refresh_image_packages(tmp_path / "out")
    image = gpu_wheels.read_image(committed)
    assert image["torch"] is not None and "pytest" in image and "zz-carried-wheel" not in image
    assert copy.read_text() == committed.read_text() and copy.parent == tmp_path / "out"
