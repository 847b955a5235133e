"""``scripts/run_train.sh``: single-node torchrun launch with NGPU, CONFIG and overrides."""

from __future__ import annotations

import os
import re
import subprocess
import sys

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


def test_run_train_fails_with_the_trainer(tmp_path):
    """A config mistake under torchrun: one line from rank 0, no traceback from any rank (torchrun's
    own failure summary aside: it names no error file, as no rank reached TorchTitan's @record)."""
    proc = _launch(tmp_path, "configs/debug/llama3_upipe.toml", "--parallelism.context_parallel_degree", "3")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    line = ("titan_upipe.train: error: 2 ranks are not a multiple of context_parallel_degree 3: "
            "set context_parallel_degree to 2")
    assert output.count("titan_upipe.train: error") == 1 and line in output.splitlines(), output[-4000:]
    assert not re.search(r'File "[^"]*titan_upipe[^"]*"', output), output[-4000:]  # no frame of ours
    assert "ConfigError" not in output and "error_file: <N/A>" in output


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
    lines = [line for line in output.splitlines() if "titan_upipe.train: error" in line]
    assert lines == ["titan_upipe.train: error: training.steps = 0 is invalid (optimizer steps to run): "
                     "valid values are 1 or more"], output[-4000:]
