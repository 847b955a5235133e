"""Progress through a long step (``titan_upipe.torchtitan_common.progress``): the estimates and line
formats, when lines are printed and the device synchronized, and the hooks on a real model's
blocks (in process, CPU). The lines of a real launch: ``test_metrics.test_progress_lines_of_a_upipe_run``."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

from titan_upipe.errors import ConfigError
from titan_upipe.torchtitan_0_2.checks.training import check_metrics as check_progress
from titan_upipe.torchtitan_common.progress import (
    BACKWARD_PER_FORWARD,
    LINES_PER_PHASE,
    StepProgress,
    format_duration,
    is_report_point,
    progress_line,
    run_eta,
    step_end_line,
    step_estimate,
    watch_blocks,
)

# ---------------------------------------------------------------- pure functions


@pytest.mark.parametrize(("seconds", "text"), [(0.04, "0.0s"), (12.34, "12.3s"), (59.9, "59.9s"), (60, "1m00s"),
                                               (245, "4m05s"), (3599, "59m59s"), (3600, "1h00m"), (7626, "2h07m")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("units", [1, 2, 6, 10, 11, 32, 64, 80, 126, 1000])
def test_at_most_ten_block_lines_per_phase_and_always_the_last(units):
    points = [done for done in range(1, units + 1) if is_report_point(done, units)]
    assert points[-1] == units
    assert len(points) <= LINES_PER_PHASE
    assert len(points) >= min(units, LINES_PER_PHASE // 2)  # not too few either
    if units <= LINES_PER_PHASE:
        assert points == list(range(1, units + 1))  # a small model: every block


def test_estimate_from_the_previous_steps_phases():
    previous = {"forward": 100.0, "backward": 200.0, "optimizer": 10.0}
    # Half the forward done after 60 s: the rest of the forward, all of backward and optimizer as last time.
    est = step_estimate(60.0, {"forward": 60.0}, {"forward": 0.5, "backward": 0.0, "optimizer": 0.0}, previous)
    assert est == pytest.approx(60 + 50 + 200 + 10)
    # A quarter of backward left, optimizer not started.
    est = step_estimate(280.0, {"forward": 110.0, "backward": 170.0},
                        {"forward": 1.0, "backward": 0.75, "optimizer": 0.0}, previous)
    assert est == pytest.approx(280 + 50 + 10)
    # In the optimizer: its previous time is the rest.
    assert step_estimate(320.0, {}, {"forward": 1.0, "backward": 1.0, "optimizer": 0.0}, previous) == pytest.approx(330)


def test_estimate_from_this_steps_blocks_alone():
    fractions = {"forward": 0.25, "backward": 0.0, "optimizer": 0.0}
    # 1 of 4 forward blocks in 10 s: 30 s of forward left, backward = 2 forwards of 40 s.
    est = step_estimate(12.0, {"forward": 10.0}, fractions, None)
    assert est == pytest.approx(12 + 30 + BACKWARD_PER_FORWARD * 40)
    # Backward started: its own blocks extrapolate (3 of 4 done in 90 s: 30 s left).
    est = step_estimate(140.0, {"forward": 40.0, "backward": 90.0}, {"forward": 1.0, "backward": 0.75}, None)
    assert est == pytest.approx(170.0)
    assert step_estimate(1.0, {"forward": 1.0}, {"forward": 0.0}, None) is None  # nothing to go by yet


def test_run_eta_is_the_mean_of_recent_steps_times_the_steps_left():
    assert run_eta([10.0, 20.0, 30.0], step=3, total_steps=10) == pytest.approx(20.0 * 7)
    assert run_eta([5.0], step=10, total_steps=10) == 0
    assert run_eta([], step=1, total_steps=10) is None


def test_line_formats():
    line = progress_line(3, 10, "backward", 724.0, 1540.0, "from step 2", (16, 32))
    assert line == "step 3/10  backward   block 16/32  elapsed 12m04s  step ~25m40s, 13m36s left (from step 2)"
    assert progress_line(1, 10, "forward", 1.0, None, "x", (0, 4)).endswith("step estimate after the first block")
    assert progress_line(3, 10, "optimizer", 1530.0, 1540.0, "from step 2") == (
        "step 3/10  optimizer  elapsed 25m30s  step ~25m40s, 10.0s left (from step 2)")
    end = step_end_line(3, 10, 1540.0, {"forward": 482.0, "backward": 1046.0, "optimizer": 12.0}, [1544.0, 1544.0])
    assert end == ("step 3/10  25m40s (forward 8m02s, backward 17m26s, optimizer 12.0s)  "
                   "run ETA 3h00m at 25m44s/step (last 2)")
    assert step_end_line(1, 2, 0.5, None, [0.5]) == "step 1/2  0.5s  run ETA 0.5s at 0.5s/step (last 1)"


def _job(value):
    return SimpleNamespace(metrics=SimpleNamespace(progress_after_seconds=value))


@pytest.mark.parametrize("value", [0, 0.5, 60, 3600.0])
def test_progress_after_seconds_accepts_seconds(value):
    check_progress(_job(value), 1)


@pytest.mark.parametrize("value", [-1, "60", True, math.nan, math.inf, None])
def test_progress_after_seconds_refuses_anything_else(value):
    with pytest.raises(ConfigError) as err:
        check_progress(_job(value), 1)
    message = str(err.value)
    assert message.startswith(f"invalid metrics.progress_after_seconds = {value!r}: valid values are 0 (every step)")
    assert "\n" not in message


def test_the_default_is_stated_once_and_parsed_from_the_cli():
    from titan_upipe.torchtitan_0_2.config import MetricsConsole
    from titan_upipe.torchtitan_0_2.config_parse import parse_config

    config = parse_config(["--job.config_file", "configs/debug/llama3_upipe.toml"])
    assert config.metrics.progress_after_seconds == MetricsConsole.progress_after_seconds == 60.0
    config = parse_config(["--job.config_file", "configs/debug/llama3_upipe.toml", "--metrics.progress_after_seconds", "5"])
    assert config.metrics.progress_after_seconds == 5


# ---------------------------------------------------------------- one step, driven by hand


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _tracker(n_blocks: int, after: float):
    clock, lines, syncs = FakeClock(), [], []
    progress = StepProgress(n_blocks, after, total_steps=5, emit=lines.append, sync=lambda: syncs.append(clock.now),
                            clock=clock)
    return progress, clock, lines, syncs


def _run_step(progress: StepProgress, clock: FakeClock, step: int, block_seconds: float) -> dict[str, float]:
    """Forward: ``block_seconds`` per block; backward twice that; optimizer 1 s."""
    progress.begin_step(step)
    progress.begin_microbatch()
    for _ in range(progress.n_blocks):
        clock.now += block_seconds
        progress.block_forward_done()
    progress.forward_done()
    for _ in range(progress.n_blocks):
        clock.now += 2 * block_seconds
        progress.block_backward_done()
    progress.begin_optimizer()
    clock.now += 1.0
    return progress.end_step()


def test_a_short_step_prints_no_block_line_and_never_synchronizes():
    progress, clock, lines, syncs = _tracker(n_blocks=4, after=60.0)
    assert _run_step(progress, clock, 1, block_seconds=1.0) == {}  # 13 s: short
    progress.report_step_end()
    assert lines == ["step 1/5  13.0s  run ETA 52.0s at 13.0s/step (last 1)"]
    assert syncs == []


def test_a_step_turns_long_midway_and_the_next_is_long_from_its_start():
    progress, clock, lines, syncs = _tracker(n_blocks=4, after=60.0)
    scalars = _run_step(progress, clock, 1, block_seconds=10.0)  # 40 s forward, 80 s backward, 1 s optimizer
    assert scalars == {"progress/forward_seconds": 40.0, "progress/backward_seconds": 80.0,
                       "progress/optimizer_seconds": 1.0}
    # Long from 60 s on: backward block 1 (at 60 s) is the first line; every block of 4 gets one.
    assert lines[0] == "step 1/5  backward   block 1/4  elapsed 1m00s  step ~2m00s, 1m00s left (from this step's blocks)"
    assert [line.split()[2] for line in lines] == ["backward"] * 4 + ["optimizer"]
    assert syncs, "the device is synchronized once the step is known long"
    lines.clear()
    syncs.clear()
    _run_step(progress, clock, 2, block_seconds=10.0)
    assert len(lines) == 4 + 4 + 1
    assert lines[0] == "step 2/5  forward    block 1/4  elapsed 10.0s  step ~2m01s, 1m51s left (from step 1)"
    assert lines[-1] == "step 2/5  optimizer  elapsed 2m00s  step ~2m01s, 1.0s left (from step 1)"
    assert syncs[0] == 121.0  # the step's start, after the device caught up


def test_threshold_zero_reports_every_step():
    progress, clock, lines, _ = _tracker(n_blocks=2, after=0)
    assert _run_step(progress, clock, 1, block_seconds=0.001)
    assert len(lines) == 2 + 2 + 1


def test_events_outside_a_step_or_out_of_phase_are_ignored():
    """Validation forwards between steps, and a block recomputed in backward (activation
    checkpointing), count no block."""
    progress, clock, lines, _ = _tracker(n_blocks=2, after=0)
    progress.block_forward_done()  # before any step
    progress.forward_done()
    progress.begin_step(1)
    progress.begin_microbatch()
    progress.block_forward_done()
    progress.block_backward_done()  # not in backward yet
    progress.block_forward_done()
    progress.forward_done()
    progress.block_forward_done()  # a recomputation
    assert progress.blocks_done == {"forward": 2, "backward": 0}
    progress.end_step()
    progress.block_forward_done()  # validation after the step
    assert progress.blocks_done == {"forward": 2, "backward": 0}


# ---------------------------------------------------------------- hooks on a real model


def _llama3(n_layers: int = 3):
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    args = TransformerModelArgs(dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                                max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def _train_step(model, progress: StepProgress, step: int, microbatches: int = 1) -> dict[str, float]:
    progress.begin_step(step, microbatches)
    for _ in range(microbatches):
        progress.begin_microbatch()
        model(torch.randint(0, 64, (2, 16))).float().sum().backward()
    progress.begin_optimizer()
    return progress.end_step()


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "activation-checkpointed"])
def test_hooks_on_a_models_blocks_report_each_block_once(checkpointed):
    """Every block's forward and backward, in order, once per microbatch (TorchTitan's AC wrapper
    recomputes inside its wrapper: no second forward line); nothing for a validation forward."""
    from torchtitan.distributed.activation_checkpoint import ptd_checkpoint_wrapper

    model = _llama3()
    if checkpointed:
        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, ptd_checkpoint_wrapper(block, preserve_rng_state=False))
    lines: list[str] = []
    progress = StepProgress(3, 0, total_steps=2, emit=lines.append)
    watch_blocks(model, progress)
    scalars = _train_step(model, progress, step=1, microbatches=2)
    blocks = [match.group() for line in lines if (match := re.search(r"block \d+/\d+", line))]
    phases = [line.split()[2] for line in lines]
    assert phases == ["forward"] * 3 + ["backward"] * 3 + ["forward"] * 3 + ["backward"] * 3 + ["optimizer"]
    assert blocks[:3] == ["block 1/6", "block 2/6", "block 3/6"] and blocks[-1] == "block 6/6"
    assert set(scalars) == {"progress/forward_seconds", "progress/backward_seconds", "progress/optimizer_seconds"}
    assert all(seconds >= 0 for seconds in scalars.values()) and scalars["progress/backward_seconds"] > 0
    lines.clear()
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 16)))  # validation between steps
    assert lines == []


def test_built_for_a_job_watches_every_block_and_waits_only_for_an_accelerator():
    from torchtitan.tools.logging import logger

    from titan_upipe.torchtitan_common.progress import build_step_progress, device_sync

    progress = build_step_progress(30, 7, [_llama3(n_layers=4)], torch.device("cpu"))
    assert (progress.n_blocks, progress.after_seconds, progress.total_steps) == (4, 30, 7)
    assert progress.emit == logger.info and progress.sync is None  # rank 0 (no process group) on CPU
    assert device_sync(torch.device("cpu")) is None
    assert callable(device_sync(torch.device("cuda", 0)))  # built, not called: no GPU needed
    from titan_upipe.torchtitan_0_2.checks import JOB_CHECKS

    assert check_progress in JOB_CHECKS  # a bad value is refused before any process group
