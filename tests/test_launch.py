"""``scripts/run_train.sh``: single-node torchrun launch with NGPU, CONFIG and overrides."""

from __future__ import annotations

import os
import re
import subprocess

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
    line = ("titan_upipe.train: error: 2 ranks are not a multiple of context_parallel_degree 3: launch 3 ranks, "
            "or set context_parallel_degree to one of 1, 2")
    assert output.count("titan_upipe.train: error") == 1 and line in output.splitlines(), output[-4000:]
    assert not re.search(r'File "[^"]*titan_upipe[^"]*"', output), output[-4000:]  # no frame of ours
    assert "ConfigError" not in output and "error_file: <N/A>" in output
