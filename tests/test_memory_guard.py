"""The memory guard (``torchtitan_0_2/memory_guard.py``, issue 42): a job the planner predicts will not fit is
refused before anything is allocated, naming the prediction, what the machine has and the
longest ``training.seq_len`` that fits; the trainer, the emulator and the parity check run it.

Machines are given (``MachineMemory``) except where an entry point reads this one; a length of
``2**40`` tokens does not fit any machine."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import time

import pytest
import torch
from trainer_utils import REPO

from titan_upipe.emulate import cli as emulate_cli
from titan_upipe.emulate.measure import measure_step
from titan_upipe.plan.machine import MachineMemory
from titan_upipe.spec.units import GIB
from titan_upipe.tools import parity
from titan_upipe.torchtitan_0_2 import launch as train
from titan_upipe.torchtitan_0_2 import memory_guard as guard
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_0_2.memory_guard import (
    MemoryDoesNotFit,
    check_memory_fits,
    memory_problem,
    target_machine,
)

HUGE = 2**40
UPIPE = str(REPO / "configs/debug/llama3_upipe.toml")  # CP = 2, U = C = 2, local batch 2
CPU_8_GIB = MachineMemory(4 * GIB, 8 * GIB, 2, "cpu")
H100 = MachineMemory(80 * GIB, 1900 * GIB, 8, "cuda")


def job(config: str, *overrides: str):
    return parse_config(["--job.config_file", str(REPO / config) if not config.startswith("/") else config,
                         *overrides], quiet=True)


def with_seq_len(job_config, seq_len: int):
    job_config = copy.deepcopy(job_config)
    job_config.training.seq_len = seq_len
    return job_config


def test_a_huge_length_on_a_cpu_machine_is_refused_with_the_longest_that_fits():
    problem = memory_problem(job(UPIPE, "--training.seq_len", str(HUGE)), 2, CPU_8_GIB)
    match = re.fullmatch(
        r"training.seq_len = 1,099,511,627,776 does not fit: the memory planner predicts [\d,]+\.\d GiB per rank "
        r"\(2 blocks, 1,099,511,627,776 tokens per rank; on the CPU activations, state and offloaded inputs share "
        r"the host memory\), and 8.0 GiB of host memory is free, 4.0 GiB for each of its 2 ranks; set "
        r"training.seq_len to ([\d,]+) or less \(the longest that fits, a multiple of 2\)", problem or "")
    assert match, problem
    longest = int(match.group(1).replace(",", ""))
    assert longest % 2 == 0 and 1024 < longest < HUGE
    base = job(UPIPE)
    assert memory_problem(with_seq_len(base, longest), 2, CPU_8_GIB) is None  # the fix fits ...
    assert memory_problem(with_seq_len(base, longest + 2), 2, CPU_8_GIB)  # ... and is the longest


def test_a_gpu_job_is_judged_against_the_gpu_less_the_runtime_reserve():
    assert memory_problem(job("configs/llama3_8b/upipe_1m.toml"), 8, H100) is None
    problem = memory_problem(job("configs/llama3_8b/ring_4m.toml"), 8, H100)  # the paper's Table 4: OOM
    assert re.fullmatch(r"training.seq_len = 4,194,304 does not fit: the memory planner predicts 8\d.\d GiB per rank "
                        r"at the step's peak \(32 blocks, 524,288 tokens per rank\), and the GPU has 80.0 GiB, 78.0 "
                        r"GiB after the planner's 2.0 GiB runtime reserve; set training.seq_len to [\d,]+ or less "
                        r"\(the longest that fits, a multiple of 16\)", problem or ""), problem


def test_the_emulator_is_judged_by_the_blocks_it_builds():
    """Llama3-8B UPipe at 7M on a 40 GiB GPU: 32 blocks do not fit; 2 blocks fit a longer length."""
    gpu_40 = MachineMemory(40 * GIB, 1900 * GIB, 1, "cuda")
    recipe = job("configs/llama3_8b/upipe_7m.toml")
    full, two = memory_problem(recipe, 8, gpu_40), memory_problem(recipe, 8, gpu_40, n_layers=2)
    assert "(32 blocks, " in full and "(2 blocks, " in two

    def longest(problem: str) -> int:
        return int(re.search(r"set training.seq_len to ([\d,]+)", problem).group(1).replace(",", ""))

    assert longest(two) > longest(full)


def test_no_length_fits_when_the_state_alone_does_not():
    problem = memory_problem(job("configs/llama3_8b/upipe_1m.toml"), 8, MachineMemory(GIB, 8 * GIB, 8, "cpu"))
    assert problem.endswith("no training.seq_len fits (the model's state alone does not, even at 8 tokens): use "
                            "more ranks (FSDP shards the state) or a machine with more memory"), problem


def test_selective_checkpointing_is_planned_as_full_a_lower_bound():
    """The planner models no selective layer AC; planned as full AC (which keeps less) the guard still
    refuses what cannot fit instead of skipping the job."""
    fsdp = job("configs/debug/llama3_fsdp.toml", "--activation_checkpoint.mode", "selective")
    assert memory_problem(fsdp, 2, CPU_8_GIB) is None
    assert memory_problem(with_seq_len(fsdp, HUGE), 2, CPU_8_GIB)


def test_a_job_the_planner_cannot_plan_is_not_guarded(monkeypatch):
    def cannot_plan(*args, **kwargs):
        raise ValueError("a setting the planner does not model")

    monkeypatch.setattr(guard, "plan_input_from_job_config", cannot_plan)
    check_memory_fits(job(UPIPE, "--training.seq_len", str(HUGE)), 2, CPU_8_GIB)  # no refusal


def test_validate_judges_a_gpu_job_for_a_gpu_and_a_float32_job_for_this_cpu():
    assert target_machine(job("configs/llama3_8b/upipe_1m.toml"), 8, host_bytes=1900 * GIB).device == "cuda"
    cpu = target_machine(job(UPIPE), 2, host_bytes=8 * GIB)
    assert (cpu.device, cpu.gpu_bytes, cpu.ranks_per_node) == ("cpu", 4 * GIB, 2)
    here = guard.free_machine_memory(2, "cpu")
    assert 0 < here.host_bytes and here.gpu_bytes == here.host_bytes / 2


def test_the_trainer_refuses_it_in_one_line_before_any_process_group(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--job.config_file", UPIPE, "--training.seq_len", str(HUGE)], prepare=guard.prepare_launch)
    assert exit_info.value.code == 2 and not torch.distributed.is_initialized()
    err = capsys.readouterr().err
    assert err.count("titan_upipe.train: error: training.seq_len = 1,099,511,627,776 does not fit: the memory "
                     "planner predicts") == 1 and "Traceback" not in err, err


def test_the_parity_check_refuses_it_before_any_process_group(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        parity.main(["--job.config_file", UPIPE, "--seq-len", str(HUGE)])
    assert exit_info.value.code == 2 and not torch.distributed.is_initialized()
    err = capsys.readouterr().err
    assert err.startswith("titan_upipe.check: error: training.seq_len = 1,099,511,627,776 does not fit") and \
        "(2 blocks, 549,755,813,888 tokens per rank;" in err, err  # --batch 1 (not the config's 2) over CP 2


def test_measure_step_refuses_it_before_the_fake_process_group():
    upipe = job("configs/debug/upipe.toml", "--training.seq_len", str(HUGE))
    with pytest.raises(MemoryDoesNotFit, match=r"^training.seq_len = 1,099,511,627,776 does not fit: .*\(1 blocks, "):
        measure_step(upipe, 4, fake=True, n_layers=1)
    assert not torch.distributed.is_initialized()


def test_the_emulator_json_records_the_refusal_as_an_oom(capsys):
    """The GPU suite's series that grow "until OOM" (tools/gpu_runs.py) stop at a refused length too."""
    with pytest.raises(SystemExit) as exit_info:
        emulate_cli.main(["--job.config_file", str(REPO / "configs/debug/upipe.toml"), "--cp-world", "4",
                          "--seq-len", str(HUGE), "--json"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    record = json.loads(captured.out.strip().splitlines()[-1])
    assert record["oom"] and record["predicted"] and record["error"].startswith("training.seq_len = 1,099,511,")


def test_the_emulator_command_refuses_it_quickly_in_one_line():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "titan_upipe.emulate", "--job.config_file", "configs/debug/upipe.toml",
                           "--cp-world", "4", "--seq-len", str(HUGE)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and lines[0].startswith("titan_upipe.emulate: error: training.seq_len = 1,099,511,627,776 "
                                                   "does not fit: the memory planner predicts"), proc.stderr
    assert "Traceback" not in proc.stderr and time.monotonic() - start < 60
