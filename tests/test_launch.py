"""``scripts/run_train.sh``: single-node torchrun launch with NGPU, CONFIG and overrides."""

from __future__ import annotations

import os
import subprocess

from trainer_utils import REPO, losses

SCRIPT = REPO / "scripts" / "run_train.sh"


def _launch(tmp_path, config: str, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NGPU": "2", "CONFIG": config, "TITAN_UPIPE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(SCRIPT), "--job.dump_folder", str(tmp_path), *overrides],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_run_train_launches_the_config_with_overrides(tmp_path):
    proc = _launch(tmp_path, "configs/debug/llama3_upipe.toml", "--training.steps", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Converted attention to upipe over a CP mesh of 2 ranks" in proc.stdout + proc.stderr
    assert len(losses(tmp_path)) == 2  # the override reached the trainer


def test_run_train_fails_with_the_trainer(tmp_path):
    proc = _launch(tmp_path, "configs/debug/llama3_upipe.toml", "--parallelism.context_parallel_degree", "3")
    assert proc.returncode != 0
    assert "context_parallel_degree" in proc.stdout + proc.stderr
