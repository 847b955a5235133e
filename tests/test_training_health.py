"""``training.on_nonfinite``: a NaN or infinite loss or gradient norm stops the job in one line, skips
the step's update, or warns (``titan_upipe.torchtitan_0_2.health``); the decision in-process, then
the real trainer under torchrun on 2 gloo ranks."""

from __future__ import annotations

import math
import os
import re
from types import SimpleNamespace

import pytest
from trainer_utils import rank_exit_codes, read_scalars, torchrun

from titan_upipe.errors import ConfigError, TrainingStopped
from titan_upipe.torchtitan_0_2.checks.health import ACTION_MEANINGS, check_on_nonfinite
from titan_upipe.torchtitan_0_2.config import NONFINITE_ACTIONS
from titan_upipe.torchtitan_0_2.health import (
    NONFINITE_TAG,
    NonFiniteGuard,
    StepValues,
    last_checkpoint_text,
    likely_cause,
    nonfinite_action,
)

NAN, INF = float("nan"), float("inf")


# --- the decision, in-process -----------------------------------------------------------------

@pytest.mark.parametrize("setting", NONFINITE_ACTIONS)
def test_a_finite_step_goes_ahead_and_a_nonfinite_one_takes_the_setting(setting):
    assert nonfinite_action(setting, StepValues(3, 6.8, 1.2, 3e-4)) is None
    for loss, norm in ((NAN, 1.2), (6.8, INF), (NAN, NAN), (-INF, 1.2)):
        assert nonfinite_action(setting, StepValues(3, loss, norm, 3e-4)) == setting


def test_the_values_name_what_went_nonfinite():
    assert StepValues(2, 6.2383, NAN, 1.0).describe() == "the gradient norm is nan (the loss is 6.238)"
    assert StepValues(2, INF, 1.5, 1.0).describe() == "the loss is inf (the gradient norm is 1.5)"
    assert StepValues(2, NAN, NAN, 1.0).describe() == "the loss is nan and the gradient norm is nan"


def test_the_likely_cause_names_the_learning_rate_with_its_value():
    huge = likely_cause(StepValues(2, 6.2, NAN, 6.666e8), optimizer_lr=1e9, first_step=1)
    assert huge.startswith("the learning rate, optimizer.lr = 1e+09 (6.67e+08 at this step), far above") and \
        huge.endswith("lower optimizer.lr")
    assert likely_cause(StepValues(2, NAN, NAN, INF), optimizer_lr=INF, first_step=1).startswith(
        "the learning rate is inf (optimizer.lr = inf): set optimizer.lr to a finite value")
    usual = likely_cause(StepValues(40, NAN, NAN, 2.5e-4), optimizer_lr=3e-4, first_step=1)
    assert "optimizer.lr = 0.0003, 0.00025 at this step" in usual and 'on_nonfinite = "skip_step"' in usual
    # No optimizer step has run yet in this job (a fresh start or a resume): not the learning rate.
    assert likely_cause(StepValues(11, NAN, NAN, 1e9), optimizer_lr=1e9, first_step=11).startswith(
        "not the learning rate, as no optimizer step has run yet in this job")


def test_the_last_complete_checkpoint_is_the_newest_step_with_metadata(tmp_path):
    folder = tmp_path / "checkpoint"
    assert last_checkpoint_text(False, str(folder)) == "last complete checkpoint: none (checkpoint.enable = false)"
    assert last_checkpoint_text(True, str(folder)) == f"last complete checkpoint: none yet in {folder}"
    for step, complete in ((10, True), (20, True), (30, False)):  # step 30: a save cut short
        (folder / f"step-{step}").mkdir(parents=True)
        if complete:
            (folder / f"step-{step}" / ".metadata").write_bytes(b"x")
    assert last_checkpoint_text(True, str(folder)) == (
        f"last complete checkpoint: {folder}/step-20 (resume with --checkpoint.load_step 20)")


def test_the_guard_counts_skips_warns_and_stops_in_one_line(tmp_path):
    checkpointer = SimpleNamespace(enable=True, folder=str(tmp_path))
    skip = NonFiniteGuard("skip_step", 3e-4, checkpointer)
    assert skip.action(StepValues(5, 6.1, 1.0, 3e-4)) is None
    assert [skip.action(StepValues(s, NAN, NAN, 3e-4)) for s in (6, 7)] == ["skip_step", "skip_step"]
    assert skip.nonfinite_steps == 2
    stop = NonFiniteGuard("stop", 1e9, checkpointer)
    stop.action(StepValues(1, 6.8, 1.6, 1e9))
    assert stop.action(StepValues(2, 6.2, NAN, 6.7e8)) == "stop"
    err = stop.stopped(StepValues(2, 6.2, NAN, 6.7e8))
    assert isinstance(err, TrainingStopped) and "\n" not in str(err)
    assert str(err).startswith(f"training stopped at step 2: the gradient norm is nan (the loss is 6.2); last complete "
                               f"checkpoint: none yet in {tmp_path}; likely cause: the learning rate, optimizer.lr = "
                               "1e+09")


def test_on_nonfinite_is_checked_before_launch_with_the_choices():
    assert set(ACTION_MEANINGS) == set(NONFINITE_ACTIONS)
    for value in NONFINITE_ACTIONS:
        check_on_nonfinite(SimpleNamespace(training=SimpleNamespace(on_nonfinite=value)), 1)
    check_on_nonfinite(SimpleNamespace(training=SimpleNamespace(steps=3)), 1)  # parsed without the plugin: "stop"
    with pytest.raises(ConfigError) as err:
        check_on_nonfinite(SimpleNamespace(training=SimpleNamespace(on_nonfinite="skip")), 1)
    assert str(err.value) == (
        "invalid training.on_nonfinite = 'skip': valid values are \"stop\" (end the job at that step), \"skip_step\" "
        "(skip that step's update and go on), \"warn\" (log a warning and apply the update); did you mean "
        "\"skip_step\"?")


def test_on_nonfinite_parses_into_the_training_section_with_stop_by_default():
    from titan_upipe.torchtitan_0_2.checks import check_job
    from titan_upipe.torchtitan_0_2.config_parse import parse_config

    args = ["--job.config_file", "configs/debug/llama3_fsdp.toml"]
    assert parse_config(args).training.on_nonfinite == "stop"
    config = parse_config([*args, "--training.on_nonfinite", "skip-step"])
    with pytest.raises(ConfigError, match='did you mean "skip_step"'):
        check_job(config, 2)


# --- the real trainer -------------------------------------------------------------------------

SHORT_RUN = ("--training.steps", "3", "--training.seq_len", "128", "--training.local_batch_size", "2")

NAN_AT_STEP = """
import os

from titan_upipe.torchtitan_0_2.trainer import ContextParallelTrainer

_forward_backward = ContextParallelTrainer.forward_backward_step


def _nan_loss_on_rank_1(self, **kwargs):
    # rank 1's loss (and so, through FSDP, every gradient) is NaN at one step; rank 0's stays finite
    if self.step != int(os.environ["TITAN_UPIPE_TEST_NAN_STEP"]) or os.environ.get("RANK") != "1":
        return _forward_backward(self, **kwargs)
    loss_fn = self.loss_fn
    self.loss_fn = lambda *args, **kw: loss_fn(*args, **kw) * float("nan")
    try:
        return _forward_backward(self, **kwargs)
    finally:
        self.loss_fn = loss_fn


ContextParallelTrainer.forward_backward_step = _nan_loss_on_rank_1
"""


def _with_nan_at_step(tmp_path, step: int) -> tuple[tuple[str, ...], dict[str, str]]:
    """Overrides and environment that make rank 1's loss NaN at ``step`` (TorchTitan imports the
    test's own module as ``experimental.custom_import``: nothing in the package is instrumented)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "nan_at_step.py").write_text(NAN_AT_STEP)
    path = os.environ.get("PYTHONPATH")
    env = {"PYTHONPATH": str(site) + (os.pathsep + path if path else ""), "TITAN_UPIPE_TEST_NAN_STEP": str(step)}
    return ("--experimental.custom_import", "nan_at_step"), env


def test_a_diverging_learning_rate_stops_the_job_in_one_line(tmp_path):
    """The issue's case: lr = 1e9 trained on with NaN to the end and exit 0. Step 1 is finite and
    checkpointed; its update leaves the gradient norm NaN at step 2, where the job stops."""
    out = tmp_path / "run"
    proc = torchrun(2, "titan_upipe.train", "configs/debug/llama3_fsdp.toml", out, *SHORT_RUN,
                    "--optimizer.lr", "1e9", "--checkpoint.enable", "--checkpoint.interval", "1", check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and 3 in rank_exit_codes(proc), output[-4000:]
    line = re.escape(f"training stopped at step 2: the gradient norm is nan (the loss is LOSS); last complete "
                     f"checkpoint: {out}/checkpoint/step-1 (resume with --checkpoint.load_step 1); likely cause: the "
                     "learning rate, optimizer.lr = 1e+09 (6.67e+08 at this step), far above the 1e-5 to 1e-3 that "
                     "LLM training uses: lower optimizer.lr").replace("LOSS", r"\d+\.\d+")
    # (printed by rank 0, or by each rank as "error on rank N": which ranks print is the launcher's)
    lines = [x for x in output.splitlines() if x.startswith("titan_upipe.train: error")]
    assert lines and all(re.fullmatch(rf"titan_upipe.train: error( on rank \d)?: {line}", x) for x in lines), \
        output[-4000:]
    assert not re.search(r'File "[^"]*titan_upipe[^"]*"', output), output[-4000:]  # no frame of ours
    assert not (out / "checkpoint" / "step-2").exists()  # the step that went non-finite is not saved
    assert read_scalars(out)[NONFINITE_TAG] == [(1, 0.0), (2, 1.0)]


def _nan_at_step_2(tmp_path, action: str) -> tuple[str, dict]:
    """A 2-rank run whose loss is NaN at step 2 under ``training.on_nonfinite = action``: its console
    output and TensorBoard scalars."""
    overrides, env = _with_nan_at_step(tmp_path, 2)
    out = tmp_path / "run"
    proc = torchrun(2, "titan_upipe.train", "configs/debug/llama3_fsdp.toml", out, *SHORT_RUN, *overrides,
                    "--training.on_nonfinite", action, env=env)
    return proc.stdout + proc.stderr, read_scalars(out)


def test_skip_step_drops_the_nonfinite_update_and_trains_on(tmp_path):
    output, scalars = _nan_at_step_2(tmp_path, "skip_step")
    assert ('step 2: the loss is nan and the gradient norm is nan: its update is skipped (training.on_nonfinite = '
            '"skip_step"; 1 non-finite step(s) so far)') in output
    loss = dict(scalars["loss_metrics/global_avg_loss"])
    assert math.isnan(loss[2]) and math.isfinite(loss[1]) and math.isfinite(loss[3]), loss
    assert scalars[NONFINITE_TAG] == [(1, 0.0), (2, 1.0), (3, 1.0)]
    lr = dict(scalars["lr"])
    assert lr[1] < lr[2] == lr[3], lr  # warmup: the skipped step's LR step was skipped too


def test_warn_applies_the_update_as_torchtitan_does(tmp_path):
    output, scalars = _nan_at_step_2(tmp_path, "warn")
    assert ('step 2: the loss is nan and the gradient norm is nan: its update is applied (training.on_nonfinite = '
            '"warn")') in output
    loss = dict(scalars["loss_metrics/global_avg_loss"])
    assert math.isfinite(loss[1]) and math.isnan(loss[2]) and math.isnan(loss[3]), loss  # NaN weights from step 2
    assert scalars[NONFINITE_TAG] == [(1, 0.0), (2, 1.0), (3, 2.0)]
