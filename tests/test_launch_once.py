"""Launches that speak once (issue 42), in-process: the pre-launch check in one process
(``--check-only``), an error after the start printed by one rank and written to torch-elastic's
error file, a rendezvous that says how many ranks joined, Ctrl-C/SIGTERM as one line, and
``titan_upipe.tools.torchrun``'s end. The launches themselves: tests/test_launch.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from trainer_utils import REPO

from titan_upipe.errors import ConfigError
from titan_upipe.tools import torchrun as quiet_torchrun
from titan_upipe.torchtitan_0_2 import interrupts, launch, launch_store, worker_exit
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_0_2.launch_store import LaunchStore

UPIPE = str(REPO / "configs/debug/llama3_upipe.toml")  # CP = 2, data_parallel_shard_degree = -1
PREFIX = "titan_upipe.train: "


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def master(monkeypatch):
    """A launch by hand of 2 ranks: MASTER_ADDR/PORT of a free port, no agent store."""
    port = _free_port()
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(launch_store, "REPORT_EVERY_SECONDS", 0.3)
    return port


@pytest.fixture
def store(master):
    """The launch's store as rank 0 hosts it, and as rank 1 sees it."""
    tcp = torch.distributed.TCPStore("127.0.0.1", master, 2, is_master=True, timeout=timedelta(seconds=10),
                                     wait_for_workers=False)
    return LaunchStore(tcp, 0, 2), LaunchStore(tcp, 1, 2)


@pytest.fixture
def quiet_root_logger():
    """``--check-only`` sets the root logger to errors only (its process ends right after)."""
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)


# ---------------------------------------------------------------------------- the pre-launch check


def test_check_only_is_the_launch_line_in_one_process(tmp_path, monkeypatch, capsys, quiet_root_logger):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--check-only", "--world-size", "3", "--job.config_file", UPIPE, "--job.dump_folder", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{PREFIX}error: 3 ranks are not a multiple of context_parallel_degree 2: launch 2 or 4 ranks (no "
        "context_parallel_degree fits both 3 ranks and this job's heads, [upipe] settings and seq_len)"]
    assert not torch.distributed.is_initialized()

    assert launch.main(["--check-only", "--world-size=2", "--job.config_file", UPIPE,
                        "--job.dump_folder", str(tmp_path)]) is None  # a job that can run: silent, exit 0
    assert capsys.readouterr().err == ""


def test_a_bad_world_size_flag_is_one_line(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--check-only", "--world-size", "two", "--job.config_file", UPIPE])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"{PREFIX}error: --world-size 'two': valid values are 1 or more (the ranks to launch)\n"


# ---------------------------------------------------------------------------- an error after the start


def test_rank_zero_prints_and_torchrun_names_its_line_as_the_root_cause(store, tmp_path, monkeypatch, capsys):
    """The error file replaces what TorchTitan's ``@record`` wrote (the traceback), and torchrun's
    own summary (``ChildFailedError``) reads the line from it."""
    error_file = tmp_path / "error.json"
    error_file.write_text('{"message": {"message": "X", "extraInfo": {"py_callstack": "Traceback ...", '
                          '"timestamp": "1"}}}')
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "0")
    assert worker_exit.exit_after_start("loss is nan", store[0], 3).code == 3
    line = f"{PREFIX}error: loss is nan"
    assert capsys.readouterr().err == line + "\n"
    assert json.loads(error_file.read_text())["message"]["message"] == line
    summary = ChildFailedError("titan_upipe.train", {0: ProcessFailure(0, 1, 3, str(error_file))}).format_msg()
    assert f"traceback : {line}" in summary and f"error_file: {error_file}" in summary, summary
    assert store[1].failure_of(0, 0) == "loss is nan"


def test_another_rank_is_silent_when_rank_zero_reported_the_same(store, tmp_path, monkeypatch, capsys):
    """Every rank fails alike (a decision on reduced values): one line, rank 0's."""
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setenv("RANK", "1")
    store[0].record_failure("loss is nan")
    assert worker_exit.exit_after_start("loss is nan", store[1], 3).code == 3
    assert capsys.readouterr().err == ""
    assert json.loads((tmp_path / "error.json").read_text())["message"]["message"] == f"{PREFIX}error: loss is nan"


def test_a_rank_failing_alone_prints_its_own_line(store, monkeypatch, capsys):
    """Rank 0 did not fail (it waits in a collective for this rank): the failing rank speaks."""
    monkeypatch.setattr(worker_exit, "RANK_ZERO_WAIT_SECONDS", 0.3)
    monkeypatch.setenv("RANK", "1")
    store[0].record_failure("another error")  # not this rank's: it still speaks
    start = time.monotonic()
    assert worker_exit.exit_after_start("a file is missing on this node", store[1]).code == 2
    assert capsys.readouterr().err == f"{PREFIX}error on rank 1: a file is missing on this node\n"
    assert time.monotonic() - start < 5


# ---------------------------------------------------------------------------- the rendezvous


def test_a_rendezvous_missing_ranks_says_how_many_joined_then_stops(master, tmp_path, monkeypatch, capsys):
    """Rank 0 of 2 started alone (a launch by hand): a line per report interval, then one error line
    naming the missing rank, no process group, no traceback (TorchTitan: 300 s of silence)."""
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--job.config_file", UPIPE, "--job.dump_folder", str(tmp_path), "--comm.init_timeout_seconds", "1"])
    assert exit_info.value.code == 2
    assert not torch.distributed.is_initialized()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(PREFIX)]
    assert lines[0].startswith(f"{PREFIX}1 of 2 ranks joined the rendezvous after ") and lines[0].endswith(
        " s (missing: rank 1); waiting up to 1 s (comm.init_timeout_seconds)"), lines
    assert lines[-1] == (f"{PREFIX}error: only 1 of 2 ranks joined the rendezvous in 1 s (comm.init_timeout_seconds; "
                         "missing: rank 1): launch all WORLD_SIZE = 2 ranks (torchrun's --nnodes x --nproc_per_node), "
                         "or check that every node started"), lines


def test_the_rendezvous_goes_on_once_every_rank_joined(master):
    said: list[str] = []
    late = threading.Thread(target=lambda: (time.sleep(0.7),
                                            launch_store.join(launch_store.connect(1, 2, 5, said.append), 5)))
    late.start()
    launch_store.join(launch_store.connect(0, 2, 5, said.append), 5, said.append)
    late.join()
    assert said and said[0].startswith("1 of 2 ranks joined the rendezvous after "), said


def test_a_rank_without_rank_zero_says_what_it_waits_for(master):
    said: list[str] = []
    with pytest.raises(ConfigError, match=rf"^rank 1: nothing answers at MASTER_ADDR:MASTER_PORT = 127.0.0.1:{master} "
                                          r"after 1 s \(comm.init_timeout_seconds\): start rank 0"):
        launch_store.connect(1, 2, 1, said.append)
    assert said and said[0].startswith(f"rank 1: waiting for rank 0's rendezvous at 127.0.0.1:{master}"), said


def test_a_launch_without_a_master_address_names_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ConfigError, match=r"^WORLD_SIZE = 2 but MASTER_ADDR and MASTER_PORT are not set: launch with "
                                          r"torchrun, which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"):
        launch_store.connect(0, 2, 1)


# ---------------------------------------------------------------------------- Ctrl-C and SIGTERM


def test_the_first_signal_is_one_line_and_one_exception(monkeypatch, capsys):
    monkeypatch.setattr(interrupts, "UNWIND_SECONDS", 0.1)
    exits: list[int] = []
    watch = interrupts.InterruptWatch(lambda signum: f"line for {signal.Signals(signum).name}", exits.append)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(interrupts.Interrupted) as info, watch.installed():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises in here
    assert info.value.status == 143 and signal.getsignal(signal.SIGTERM) is before
    watch.wait_reported()
    assert capsys.readouterr().err == "line for SIGTERM\n"
    deadline = time.monotonic() + 5
    while not exits and time.monotonic() < deadline:  # the backstop exit, here recorded only
        time.sleep(0.05)
    assert exits == [143]


def test_the_interrupted_line_names_the_step_the_checkpoint_and_the_resume(tmp_path):
    line = interrupts.interrupted_line(signal.SIGINT, 27, 200, True, "/d/checkpoint", [20, 25], 5)
    assert line == ("titan_upipe.train: interrupted by SIGINT during step 27 of 200; newest complete checkpoint: "
                    "/d/checkpoint/step-25; run the same command again to resume from it (at step 26)")
    assert interrupts.interrupted_line(signal.SIGTERM, 3, 200, True, "/d/checkpoint", [], 50) == (
        "titan_upipe.train: interrupted by SIGTERM during step 3 of 200; no checkpoint is complete yet in "
        "/d/checkpoint (checkpoint.interval = 50): the same command starts again from step 1")
    assert interrupts.interrupted_line(signal.SIGINT, 0, 30, False, "/d/checkpoint", [], 500) == (
        "titan_upipe.train: interrupted by SIGINT before the first step; checkpoint.enable = false, so nothing was "
        "saved: the same command starts again from step 1")


def test_only_rank_zero_speaks_and_not_for_a_peer_failure(store, monkeypatch):
    config = parse_config(["--job.config_file", UPIPE])
    state = launch.RunState(config, launch=store[0])
    monkeypatch.setenv("RANK", "1")
    assert state.interrupted_line(signal.SIGINT) is None
    monkeypatch.setenv("RANK", "0")
    assert state.interrupted_line(signal.SIGTERM).startswith(f"{PREFIX}interrupted by SIGTERM before the first step")
    store[1].record_failure("a file is missing")  # torchrun's SIGTERM after a peer failed: the peer spoke
    assert state.interrupted_line(signal.SIGTERM) is None
    assert state.interrupted_line(signal.SIGINT) is not None  # Ctrl-C is still the user's


# ---------------------------------------------------------------------------- torchrun's end


def test_torchrun_adds_nothing_to_our_line_and_one_line_to_a_crash(tmp_path):
    ours = tmp_path / "ours.json"
    worker_line = f"{PREFIX}error: loss is nan"
    ours.write_text(json.dumps({"message": {"message": worker_line, "extraInfo": {"timestamp": "1"}}}))
    failed = ChildFailedError("titan_upipe.train", {0: ProcessFailure(0, 1, 3, str(ours))})
    assert quiet_torchrun.failure_line(failed) is None
    killed = ChildFailedError("titan_upipe.train", {1: ProcessFailure(1, 1, -9, str(tmp_path / "none.json"))})
    assert quiet_torchrun.failure_line(killed) == ("torchrun: titan_upipe.train failed: rank 1 was killed by SIGKILL "
                                                   "(error file: <N/A>); its output is above")
    assert [quiet_torchrun._exit_status(code) for code in (3, -9, -15, 0)] == [3, 137, 143, 1]
