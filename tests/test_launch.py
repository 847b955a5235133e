"""``scripts/run_train.sh``: single-node torchrun launch with NGPU, CONFIG and overrides."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

from trainer_utils import REPO, losses

SCRIPT = REPO / "scripts" / "run_train.sh"
QUICKSTART = REPO / "docs" / "quickstart.md"


def _launch(tmp_path, config: str, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NGPU": "2", "CONFIG": config, "TITAN_UPIPE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(SCRIPT), "--job.dump_folder", str(tmp_path), *overrides],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def _documented_warnings() -> list[list[str]]:
    """The expected-warnings list of docs/quickstart.md: each item's first code span, split at
    its ``…`` wildcards."""
    text = QUICKSTART.read_text()
    section = text[text.index("These warnings are expected on CPU"):]
    items = re.findall(r"^- `([^`]+)`", section.split("\n\n", 2)[1], re.M)
    items += re.findall(r"^- `[^`]+` and `([^`]+)`", section.split("\n\n", 2)[1], re.M)
    return [item.split("…") for item in items]


def _warnings(output: str) -> list[str]:
    """TorchTitan's logged warnings and Python's UserWarnings in a run's output, message only."""
    found = re.findall(r" - WARNING - (.+)$", output, re.M)
    found += re.findall(r"^\S+:\d+: \w*Warning: (.+)$", output, re.M)
    return found


def _is_documented(warning: str, documented: list[list[str]]) -> bool:
    return any(all(part.strip(" ,") in warning for part in parts) for parts in documented)


def test_run_train_launches_the_config_with_overrides(tmp_path):
    proc = _launch(tmp_path, "configs/debug/llama3_upipe.toml", "--training.steps", "2")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Converted attention to upipe over a CP mesh of 2 ranks" in output
    assert len(losses(tmp_path)) == 2  # the override reached the trainer
    # each line once: rank 1 logs errors only (metrics.log_all_ranks = false)
    assert [len(re.findall(rf" - INFO - step:\s+{step}\s", output)) for step in (1, 2)] == [1, 1], output[-4000:]
    assert output.count("Building upipe_llama3 debug") == 1 and output.count("Warmup steps (5) exceed") == 1
    # rank 0 names the TensorBoard folder of the dump folder actually used
    assert re.findall(r"TensorBoard: \S*tensorboard --logdir (\S+)$", output, re.M) == [str(tmp_path / "tb")]
    documented = _documented_warnings()
    assert len(documented) >= 9, documented
    undocumented = sorted({w for w in _warnings(output) if not _is_documented(w, documented)})
    assert not undocumented, f"warnings missing from docs/quickstart.md's expected list: {undocumented}"


def test_run_train_stops_a_job_that_cannot_run_before_torchrun(tmp_path):
    """A config mistake: the script's pre-launch check (one process) prints the trainer's one line and
    exits 2; torchrun never starts (no worker, no failure summary)."""
    proc = _launch(tmp_path, "configs/debug/llama3_upipe.toml", "--parallelism.context_parallel_degree", "3")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2
    assert output.splitlines() == ["titan_upipe.train: error: 2 ranks are not a multiple of context_parallel_degree 3: "
                                   "set context_parallel_degree to 2"], output[-4000:]


SLOW_RANK_ZERO = """
import os, time
if os.environ.get("RANK") == "0" and "LOCAL_RANK" in os.environ:
    time.sleep(float(os.environ["TITAN_UPIPE_TEST_RANK_ZERO_DELAY"]))
"""


def test_the_error_line_survives_a_rank_that_fails_first(tmp_path):
    """torchrun stops every rank once one exits non-zero: had rank 1 exited before rank 0 printed,
    the launch would end in torchrun's summary alone (issue 33: 1 launch in 8 under load). Here
    rank 0 starts 4 s late (a ``sitecustomize`` of the test's own), so on a launcher that lets
    rank 1 leave first the line is always lost; rank 1 must outwait rank 0 instead."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_RANK_ZERO)
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "TITAN_UPIPE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "TITAN_UPIPE_TEST_RANK_ZERO_DELAY": "4",
           "PYTHONPATH": str(site) + (os.pathsep + path if path else "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "titan_upipe.train", "--job.config_file", str(REPO / "configs/debug/llama3_upipe.toml"),
           "--training.steps", "0", "--job.dump_folder", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in output.splitlines() if line.startswith("titan_upipe.train: error")]
    assert lines == ["titan_upipe.train: error: training.steps = 0 is invalid (optimizer steps to run): "
                     "valid values are 1 or more"], output[-4000:]
    # torchrun's summary names the line as the root cause (the worker's torch-elastic error file)
    root_cause = output[output.index("Root Cause (first observed failure):"):]
    assert "error_file: <N/A>" not in root_cause and f"traceback : {lines[0]}" in root_cause, root_cause
    assert not re.search(r'File "[^"]*titan_upipe[^"]*"', output), output[-4000:]  # no frame of ours


STOP_AFTER_THE_START = """
import os
if "LOCAL_RANK" in os.environ:  # the workers, not torchrun
    import torch
    from titan_upipe.errors import ConfigError
    from titan_upipe.torchtitan_0_2 import trainer

    def _stopped(self, job_config):
        torch.distributed.init_process_group("gloo")
        raise ConfigError("a decision every rank takes alike (injected by the test)")

    trainer.ContextParallelTrainer.__init__ = _stopped
"""


def _quiet_torchrun(tmp_path, *overrides: str, site: str | None = None, **popen) -> subprocess.Popen:
    """``titan_upipe.tools.torchrun`` of the make-run config on 2 ranks in its own session (a
    ``sitecustomize`` of the test's own, ``site``, in every process)."""
    env = {**os.environ, "TITAN_UPIPE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    if site is not None:
        (tmp_path / "site").mkdir()
        (tmp_path / "site" / "sitecustomize.py").write_text(site)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "titan_upipe.tools.torchrun", "--standalone", "--nproc_per_node=2", "-m",
           "titan_upipe.train", "--job.config_file", str(REPO / "configs/debug/llama3_upipe.toml"),
           "--job.dump_folder", str(tmp_path / "run"), *overrides]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **popen)


def test_an_error_on_every_rank_after_the_start_is_one_line(tmp_path):
    """Every rank stops alike after the process group started (a broadcast decision, such as training
    health's stop on a NaN loss; here a ConfigError): rank 0 prints the line, the others see it on the launch's store and stay silent; no traceback from a worker or
    from torchrun, whose exit is the workers' status."""
    proc = _quiet_torchrun(tmp_path, site=STOP_AFTER_THE_START)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, output[-4000:]
    lines = [line for line in output.splitlines() if line.startswith("titan_upipe.train: ")]
    assert lines == ["titan_upipe.train: error: a decision every rank takes alike (injected by the test)"], output
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-4000:]


def test_ctrl_c_is_one_line_with_the_step_and_the_checkpoint(tmp_path):
    """Ctrl-C (SIGINT to the launch's process group: torchrun and every worker) during training: one
    line from rank 0 naming the step, the newest complete checkpoint and the resume; no traceback
    from any process; exit status 130."""
    proc = _quiet_torchrun(tmp_path, "--training.steps", "200", "--checkpoint.enable", "--checkpoint.interval", "2")
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not any(re.search(r" - INFO - step:\s+3\s", line) for line in list(seen)) and time.monotonic() < deadline:
        assert proc.poll() is None, "".join(seen)[-4000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 130, "".join(seen)[-4000:]
    reader.join(timeout=10)
    output = "".join(seen)
    lines = [line for line in output.splitlines() if line.startswith("titan_upipe.train: ")]
    match = re.fullmatch(r"titan_upipe.train: interrupted by SIGINT during step (\d+) of 200; newest complete "
                         r"checkpoint: (\S+)/step-(\d+); run the same command again to resume from it \(at step (\d+)\)",
                         lines[0] if len(lines) == 1 else "")
    assert match, output[-4000:]
    step, folder, saved, resume = int(match[1]), match[2], int(match[3]), int(match[4])
    assert folder == str(tmp_path / "run" / "checkpoint") and saved < step and resume == saved + 1
    assert (tmp_path / "run" / "checkpoint" / f"step-{saved}" / ".metadata").is_file()
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-4000:]
