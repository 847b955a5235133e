"""Every tool fails with one line and a non-zero exit, printed once (issue 33): ``validate``, ``plan``,
``check``, ``emulate``, ``gpu_suite`` and the refusal under TorchTitan's own entry point; counts,
sizes and lengths are refused where the command line is read, by the types every tool shares.

In-process: each tool's ``main`` (or, for the torchrun tools, the function that validates their
arguments before any process group), with ``RANK``/``WORLD_SIZE`` set where it matters.
"""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch
from trainer_utils import REPO

import titan_upipe.errors as errors
from titan_upipe.emulate import cli as emulate
from titan_upipe.errors import ConfigError
from titan_upipe.plan.machine import MachineMemory
from titan_upipe.toolkit.cli_args import parse_length
from titan_upipe.tools import gpu_suite, parity
from titan_upipe.tools import plan_cli as plan
from titan_upipe.tools import preflight as validate
from titan_upipe.torchtitan_0_2 import torchtitan_launch
from titan_upipe.torchtitan_0_2.config_parse import parse_config

UPIPE = str(REPO / "configs/debug/llama3_upipe.toml")  # llama3 debug: 8 query / 2 KV heads, 2 blocks, CP = 2
RECIPE_1M = str(REPO / "configs/llama3_8b/upipe_1m.toml")  # Llama3-8B, UPipe CP = 8, seq_len 1M


def _one_error_line(capsys, tool: str) -> str:
    """The one stderr line ``<tool>: error: ...`` (its message), nothing else on stderr or stdout but
    TorchTitan's log lines."""
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip() and "HF assets path" not in line]
    assert len(lines) == 1 and lines[0].startswith(f"{tool}: error: "), captured.err
    assert "usage:" not in captured.err and "Traceback" not in captured.err
    return lines[0].removeprefix(f"{tool}: error: ")


def _exits_with_one_line(capsys, tool: str, call, *args) -> str:
    with pytest.raises(SystemExit) as exit_info:
        call(*args)
    assert exit_info.value.code == 2
    return _one_error_line(capsys, tool)


# --- the one error line -----------------------------------------------------------------------------


def test_exit_once_prints_on_rank_zero_and_lets_it_report_first(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    assert errors.exit_once("tool", "bad").code == 2
    assert capsys.readouterr().err == "tool: error: bad\n"
    slept = []
    monkeypatch.setattr(errors.time, "sleep", slept.append)
    # not under torchrun (a SLURM step's RANK, say): nothing to wait for
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert errors.exit_once("tool", "bad").code == 2
    assert slept == [] and capsys.readouterr().err == "tool: error: bad\n"
    # under torchrun another rank waits for torchrun to stop it after rank 0's exit; alive after
    # that, a node's local rank 0 speaks for the node, the others stay silent
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert errors.exit_once("tool", "bad").code == 2
    assert slept == [errors.RANK_ZERO_GRACE_SECONDS] and capsys.readouterr().err == ""
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert errors.exit_once("tool", "bad").code == 2
    assert capsys.readouterr().err == "tool: error on rank 3: bad\n"


# --- validate ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "-8"], "argument --world-size: -8 is invalid: valid values are 1 or more"),
    (["--world-size", "0"], "argument --world-size: 0 is invalid: valid values are 1 or more"),
    (["--world-size", "two"], "argument --world-size: 'two' is not a whole number: valid values are 1 or more"),
    (["--world-size", "2", "--host-mem", "-5"], "argument --host-mem: -5 is invalid: valid values are a number above 0"),
])
def test_validate_refuses_counts_and_sizes_below_one(argv, message, capsys):
    assert message in _exits_with_one_line(capsys, "titan_upipe.validate", validate.main, [UPIPE, *argv])


def test_validate_without_a_world_size_for_a_derived_shard_degree_is_one_line(capsys):
    line = _exits_with_one_line(capsys, "titan_upipe.validate", validate.main, [UPIPE, "--no-assets"])
    assert line.endswith("data_parallel_shard_degree = -1 (derived from the launch): pass --world-size N")


def test_validate_a_directory_names_its_toml_files(capsys):
    assert validate.main([str(REPO / "configs/debug"), "--world-size", "2"]) == 1
    out = capsys.readouterr().out
    assert "configs/debug is a directory: name one TOML file in it, one of " in out
    assert "configs/debug/llama3_upipe.toml" in out and "not found" not in out


def test_a_true_false_flag_with_a_value_says_how_to_pass_it(capsys):
    assert validate.main([UPIPE, "--world-size", "2", "--activation_checkpoint.cpu_offload", "maybe"]) == 1
    assert ("--activation_checkpoint.cpu_offload is a true/false flag and takes no value ('maybe'): pass "
            "--activation_checkpoint.cpu_offload alone for true, --activation_checkpoint.no-cpu_offload for false"
            in capsys.readouterr().out)
    for flag in (["--activation_checkpoint.cpu_offload=true"], ["--compile.no-enable", "false"]):
        with pytest.raises(ConfigError, match="is a true/false flag and takes no value"):
            parse_config(["--job.config_file", UPIPE, *flag])
    # what TorchTitan 0.2.2's parser accepts: the flag alone, or its no- form
    on = parse_config(["--job.config_file", UPIPE, "--activation_checkpoint.cpu_offload", "--training.steps", "2"])
    off = parse_config(["--job.config_file", UPIPE, "--activation_checkpoint.no-pin_memory"])
    assert on.activation_checkpoint.cpu_offload and on.training.steps == 2
    assert not off.activation_checkpoint.pin_memory


def test_validate_prints_the_warnings_of_settings_without_effect(capsys):
    assert validate.main([UPIPE, "--world-size", "2", "--no-assets", "--transforms.mlp_tile_tokens", "64"]) == 0
    assert "warning: transforms.mlp_tile_tokens = 64 has no effect" in capsys.readouterr().out


# --- lengths: one parser ----------------------------------------------------------------------------


def test_one_length_parser_says_what_it_accepts():
    assert [parse_length(x) for x in ("4096", "128K", "1M", "2.5M", "1.5k")] == [4096, 131072, 2**20, 5 * 2**19, 1536]
    for text in ("5X", "0", "-1K", "0.3K", "K", "inf", "nan", ""):
        with pytest.raises(ValueError, match=re.escape(f"{text}: expected a token count like 4096, 128K, 1M or 2.5M")):
            parse_length(text)


# --- plan -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--gpu-mem", "-1"], "argument --gpu-mem: -1 is invalid: valid values are a number above 0"),
    (["--host-mem", "-5"], "argument --host-mem: -5 is invalid"),
    (["--cp", "0"], "argument --cp: 0 is invalid: valid values are 1 or more"),
    (["--batch", "0"], "argument --batch: 0 is invalid"),
    (["--world-size", "-8"], "argument --world-size: -8 is invalid"),
    (["--seq-len", "5X"], "argument --seq-len: 5X: expected a token count like 4096, 128K, 1M or 2.5M"),
    # a degree that splits no heads is named with the degrees that do ("valid values are []" before)
    (["--cp", "3"], "context-parallel degree 3 cannot split n_heads=32, n_kv_heads=8 exactly: valid CP degrees are "
                    "[2, 4, 8, 16, 32]"),
])
def test_plan_refuses_nonsense_in_one_line(argv, message, capsys):
    line = _exits_with_one_line(capsys, "titan_upipe.plan", plan.main, ["--model", "llama3_8b", *argv])
    assert message in line, line


# --- check ------------------------------------------------------------------------------------------


def _check_options(*argv: str):
    return parity._parse(["--job.config_file", *argv])


def test_check_refuses_a_length_the_layout_cannot_shard_in_one_line(monkeypatch, capsys):
    """``check --seq-len 63`` on 2 ranks: one line from rank 0, before any process group (a
    traceback on every rank before)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    line = _exits_with_one_line(capsys, "titan_upipe.check", parity.main,
                                ["--job.config_file", UPIPE, "--seq-len", "63"])
    assert line == ("training.seq_len = 63 is not divisible by the context-parallel degree 2 "
                    "(parallelism.context_parallel_degree): use a multiple of 2 (e.g. 62)")
    assert not torch.distributed.is_initialized()


def test_check_refuses_a_wrong_rank_count_in_one_line(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    line = _exits_with_one_line(capsys, "titan_upipe.check", parity.main, ["--job.config_file", UPIPE, "--seq-len", "64"])
    assert "launch it with --nproc_per_node 2 (parallelism.context_parallel_degree), not 1" in line


def test_check_on_the_cpu_needs_a_length_for_a_gpu_recipe(monkeypatch):
    """A GPU recipe (1M tokens) on the CPU without --seq-len is refused with a length to pass; with
    --seq-len it is the job the check runs (on a machine whose memory holds it: the memory guard's
    own refusals are tests/test_memory_guard.py's)."""
    cpu = torch.device("cpu")
    options, titan_args = _check_options(RECIPE_1M)
    with pytest.raises(ConfigError, match=r"^training.seq_len = 1048576 \(.*upipe_1m.toml\) is a GPU-scale length: "
                                          r".*pass --seq-len 64 \(a multiple of 8, this layout's sequence divisor"):
        parity.checked_job(options, titan_args, 8, cpu)
    from titan_upipe.torchtitan_0_2 import parity_job

    monkeypatch.setattr(parity_job, "free_machine_memory",
                        lambda ranks, device: MachineMemory(2**50, 2**50, ranks, device))
    options, titan_args = _check_options(RECIPE_1M, "--seq-len", "64")
    assert parity.checked_job(options, titan_args, 8, cpu).spec.seq_len == 64
    options, titan_args = _check_options(RECIPE_1M)
    assert parity.checked_job(options, titan_args, 8, torch.device("cuda", 0)).spec.seq_len == 2**20


@pytest.mark.parametrize("argv, message", [
    (["--seq-len", "5X"], "argument --seq-len: 5X: expected a token count"),
    (["--batch", "0"], "argument --batch: 0 is invalid"),
    (["--tolerance", "-1"], "argument --tolerance: -1 is invalid"),
])
def test_check_arguments_are_one_line(argv, message, capsys):
    assert message in _exits_with_one_line(capsys, "titan_upipe.check", _check_options, UPIPE, *argv)


# --- emulate ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--cp-world", "0"], "argument --cp-world: 0 is invalid: valid values are 1 or more"),
    ([], "--cp-world N is required"),
    (["--cp-world", "2", "--rank", "2"], "--rank 2 is not one of the 2 ranks: valid values are 0 to 1"),
    (["--cp-world", "2", "--seq-len", "1M5"], "argument --seq-len: 1M5: expected a token count"),
    (["--cp-world", "2", "--a2a-gbps", "0"], "argument --a2a-gbps: 0 is invalid"),
    # the job checks at --cp-world ranks, before any process group (a traceback on every rank before)
    (["--cp-world", "3"], "3 ranks are not a multiple of context_parallel_degree 2: launch 2 or 4 ranks"),
    (["--cp-world", "2", "--seq-len", "63"], "training.seq_len = 63 is not divisible"),
])
def test_emulate_refuses_in_one_line_before_any_process_group(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    line = _exits_with_one_line(capsys, "titan_upipe.emulate", emulate.main, ["--job.config_file", UPIPE, *argv])
    assert message in line, line
    assert not torch.distributed.is_initialized()


def test_emulate_under_torchrun_with_another_rank_count_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    line = _exits_with_one_line(capsys, "titan_upipe.emulate", emulate.main,
                                ["--job.config_file", UPIPE, "--cp-world", "2"])
    assert line.startswith("launched with 4 ranks but --cp-world 2: launch --nproc_per_node 2")


# --- gpu_suite --------------------------------------------------------------------------------------


def test_gpu_suite_reads_lengths_with_the_one_parser(capsys):
    assert gpu_suite.parse_args(["--stage", "speed", "--lengths", "1048576,128k"]).lengths == ("1M", "128K")
    line = _exits_with_one_line(capsys, "titan_upipe.gpu_suite", gpu_suite.parse_args, ["--lengths", "5X"])
    assert line == "--lengths: 5X: expected a token count like 4096, 128K, 1M or 2.5M (K = 1024 tokens, M = 1024^2)"
    assert "valid lengths are 128K" in _exits_with_one_line(capsys, "titan_upipe.gpu_suite", gpu_suite.parse_args,
                                                            ["--lengths", "9M"])


# --- TorchTitan's own entry point -------------------------------------------------------------------


def _launched_as(monkeypatch, module: str, argv: list[str]) -> None:
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name=module)
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])


def test_torchtitan_train_refuses_a_cp_job_in_one_line(monkeypatch, capsys):
    """What importing ``titan_upipe.plugin`` does under ``-m torchtitan.train``, before its process
    group: a CP job stops with one line naming ``-m titan_upipe.train``; a plain job goes on."""
    monkeypatch.setenv("RANK", "0")
    _launched_as(monkeypatch, "torchtitan.train", ["--job.config_file", UPIPE])
    line = _exits_with_one_line(capsys, "torchtitan.train", torchtitan_launch.refuse_unsupported_launch)
    assert line == ("model.converters has 'upipe': TorchTitan's trainer would shard its context-parallel inputs "
                    "head-tail, not in titan_upipe's sequence layout; launch the same command with "
                    "`-m titan_upipe.train` instead of `-m torchtitan.train`")
    _launched_as(monkeypatch, "torchtitan.train", ["--job.config_file", str(REPO / "configs/debug/llama3_fsdp.toml")])
    torchtitan_launch.refuse_unsupported_launch()
    _launched_as(monkeypatch, "titan_upipe.train", ["--job.config_file", UPIPE])
    torchtitan_launch.refuse_unsupported_launch()  # our trainer runs CP jobs


def test_validate_prints_its_findings_only(capsys, caplog):
    """TorchTitan's parser warns "HF assets path ... does not exist!" for every job whose assets are
    elsewhere (synthetic data too); ``validate`` reports the assets itself, once, and leaves the
    root logger's level as it found it."""
    import logging

    with caplog.at_level(logging.WARNING):
        assert validate.main([RECIPE_1M, "--world-size", "8", "--no-assets", "--device", "cuda"]) == 0
        assert logging.getLogger().level == logging.WARNING  # restored after the parse
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{RECIPE_1M}: OK")
    logged = [record.getMessage() for record in caplog.records]
    assert not any("HF assets path" in message for message in logged), logged
