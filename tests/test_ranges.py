"""Every numeric setting of TorchTitan's sections is range-checked before launch, and the message
names the key, its value, the valid range and the fix (``checks/ranges.py``, issue 42).

The table test runs the job checks only (``check_job``: nothing trains, on any commit); the
launch test runs the trainer's entry point in-process for the issue's worst cases (a negative
``max_norm`` flipped the gradients, a NaN learning rate died after the model build with a
traceback from every rank) and ``validate`` on the same command line."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from trainer_utils import REPO

from titan_upipe.tools import preflight as validate
from titan_upipe.torchtitan_0_2 import launch as train
from titan_upipe.torchtitan_0_2.checks import check_job
from titan_upipe.torchtitan_0_2.config import ConfigError
from titan_upipe.torchtitan_0_2.config_parse import parse_config

UPIPE = str(REPO / "configs/debug/llama3_upipe.toml")  # CP = 2 on 2 ranks
PREFIX = "titan_upipe.train: error: "

# (key, bad value, the message's start)
CASES = [
    ("optimizer.lr", float("nan"),
     r"optimizer.lr = nan is invalid \(the peak learning rate; .*\): valid values are finite numbers > 0; "
     r"set e.g. 3e-4$"),
    ("optimizer.lr", float("inf"), r"optimizer.lr = inf is invalid .*valid values are finite numbers > 0"),
    ("optimizer.lr", -0.001, r"optimizer.lr = -0.001 is invalid .*valid values are finite numbers > 0"),
    ("optimizer.lr", 0.0, r"optimizer.lr = 0.0 is invalid"),
    ("optimizer.beta1", 1.0, r"optimizer.beta1 = 1.0 is invalid .*valid values are 0 or more and below 1"),
    ("optimizer.beta2", -0.5, r"optimizer.beta2 = -0.5 is invalid"),
    ("optimizer.eps", 0.0, r"optimizer.eps = 0.0 is invalid .*valid values are finite numbers > 0; set e.g. 1e-8$"),
    ("optimizer.weight_decay", -0.1, r"optimizer.weight_decay = -0.1 is invalid .*valid values are finite numbers >= 0"),
    ("lr_scheduler.warmup_steps", -5,
     r"lr_scheduler.warmup_steps = -5 is invalid \(steps of linear warm-up to optimizer.lr\): valid values are 0 "
     r"\(no warm-up\) or more; set e.g. 200, or 0$"),
    ("lr_scheduler.total_steps", 0, r"lr_scheduler.total_steps = 0 is invalid .*unset \(training.steps\) or 1"),
    ("lr_scheduler.decay_ratio", 1.5,
     r"lr_scheduler.decay_ratio = 1.5 is invalid .*valid values are unset \(decay right after warm-up\) or 0 to 1"),
    ("lr_scheduler.min_lr_factor", 2.0, r"lr_scheduler.min_lr_factor = 2.0 is invalid .*valid values are 0 to 1"),
    ("training.max_norm", -1.0,
     r"training.max_norm = -1.0 is invalid \(the gradient-norm clip: .*a negative value flips them, 0 zeroes them\): "
     r"valid values are numbers > 0 \(inf: no clipping\); set e.g. 1.0$"),
    ("training.max_norm", 0.0, r"training.max_norm = 0.0 is invalid"),
    ("training.max_norm", float("nan"), r"training.max_norm = nan is invalid"),
    ("training.gc_freq", 0, r"training.gc_freq = 0 is invalid .*valid values are 1 or more"),
    ("training.dataloader.num_workers", -1, r"training.dataloader.num_workers = -1 is invalid"),
    ("comm.init_timeout_seconds", 0,
     r"comm.init_timeout_seconds = 0 is invalid .*collective timeout\): valid values are 1 or more seconds; "
     r"set e.g. 300$"),
    ("comm.train_timeout_seconds", 0,
     r"comm.train_timeout_seconds = 0 is invalid \(how long a collective may wait after the first step; below the "
     r"slowest step, checkpoint save or validation pass the job fails with a collective timeout\): valid values are "
     r"1 or more seconds"),
    ("comm.trace_buf_size", -1, r"comm.trace_buf_size = -1 is invalid"),
    ("checkpoint.interval", 0, r"checkpoint.interval = 0 is invalid .*valid values are 1 or more"),
    ("checkpoint.interval", 2.5, r"checkpoint.interval = 2.5 is invalid"),
    ("checkpoint.keep_latest_k", 1,
     r"checkpoint.keep_latest_k = 1 is invalid .*valid values are 0 \(keep all\) or 2 or more"),
    ("checkpoint.keep_latest_k", -3, r"checkpoint.keep_latest_k = -3 is invalid"),
    ("checkpoint.load_step", -2, r"checkpoint.load_step = -2 is invalid .*-1 \(the newest\) or 0 or more"),
    ("metrics.log_freq", 0,
     r"metrics.log_freq = 0 is invalid \(steps between logged metrics\): valid values are 1 or more; set e.g. 10$"),
    ("validation.freq", 0, r"validation.freq = 0 is invalid"),
    ("profiling.profile_freq", 0, r"profiling.profile_freq = 0 is invalid"),
    ("profiling.profiler_warmup", -1, r"profiling.profiler_warmup = -1 is invalid"),
    ("activation_checkpoint.memory_budget", 1.5, r"activation_checkpoint.memory_budget = 1.5 is invalid"),
]


def _with(job_config, key: str, value):
    """A copy of ``job_config`` with ``key`` (``section.field``) set to ``value``."""
    job_config = copy.deepcopy(job_config)
    *path, name = key.split(".")
    node = job_config
    for part in path:
        node = getattr(node, part)
    setattr(node, name, value)
    return job_config


@pytest.fixture(scope="module")
def upipe_job():
    return parse_config(["--job.config_file", UPIPE], quiet=True)


@pytest.mark.parametrize("key, value, message", CASES, ids=[f"{c[0]}={c[1]}" for c in CASES])
def test_a_value_out_of_range_is_refused_naming_key_range_and_fix(key, value, message, upipe_job):
    with pytest.raises(ConfigError) as refused:
        check_job(_with(upipe_job, key, value), 2)
    assert re.match(message, str(refused.value)), str(refused.value)


@pytest.mark.parametrize("key, value", [("training.max_norm", float("inf")), ("lr_scheduler.warmup_steps", 0),
                                        ("checkpoint.keep_latest_k", 0), ("lr_scheduler.decay_ratio", 1.0),
                                        ("lr_scheduler.decay_ratio", None), ("checkpoint.load_step", -1),
                                        ("validation.steps", -1), ("optimizer.weight_decay", 0.0)])
def test_the_edges_of_each_range_pass(key, value, upipe_job):
    check_job(_with(upipe_job, key, value), 2)


@pytest.mark.parametrize("flag, value, message", [
    ("--training.max_norm", "-1", r"^training.max_norm = -1.0 is invalid"),
    ("--optimizer.lr", "nan", r"^optimizer.lr = nan is invalid"),
    ("--lr_scheduler.warmup_steps", "-5", r"^lr_scheduler.warmup_steps = -5 is invalid"),
    ("--comm.train_timeout_seconds", "0", r"^comm.train_timeout_seconds = 0 is invalid"),
], ids=["max_norm", "lr", "warmup", "timeout"])
def test_the_launch_says_it_once_before_any_process_group_and_validate_agrees(flag, value, message, monkeypatch,
                                                                              capsys):
    args = ["--job.config_file", UPIPE, flag, value]
    with pytest.raises(ConfigError):  # first: on a commit without the check nothing below launches a run
        check_job(parse_config(args, quiet=True), 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        train.main(args)
    assert exit_info.value.code == 2 and not torch.distributed.is_initialized()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(PREFIX)]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.search(message, lines[0][len(PREFIX):]), lines[0]
    assert validate.main([UPIPE, "--world-size", "2", "--no-assets", flag, value]) == 1
    assert re.search(message[1:], capsys.readouterr().out)


def test_every_range_names_a_torchtitan_setting_whose_default_is_valid():
    """The table's keys resolve on TorchTitan's defaults (a typo in a key would fail here, not
    silently check nothing), and no default is refused."""
    from titan_upipe.torchtitan_0_2.checks.ranges import RANGES, range_problems

    defaults = parse_config([], quiet=True)
    for rule in RANGES:
        rule.value(defaults)
    assert range_problems(defaults) == []
