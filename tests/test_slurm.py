"""``scripts/slurm/train.sbatch`` submitted to a real (one-node, localhost) Slurm cluster.

The job runs the CPU UPipe debug config on 2 gloo ranks through the script's srun +
torchrun c10d rendezvous; the test checks the job's state and exit code as Slurm
reports them, Slurm's job log, the per-rank torchrun logs and the TensorBoard events.
Skipped (with the reason) only where Slurm cannot be installed.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from slurm_cluster import LocalCluster, install_packages
from trainer_utils import REPO, losses

SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
STEPS = 3
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                   "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = install_packages()
    if reason:
        print(f"SKIP test_slurm: {reason}")
        pytest.skip(reason)
    cluster = LocalCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _submit(cluster: LocalCluster, workdir, config: str, *overrides: str) -> tuple[subprocess.CompletedProcess, str]:
    env = {
        **cluster.env,
        "CONFIG": config,
        "GPUS_PER_NODE": "2",
        "TITAN_UPIPE_DEVICE": "cpu",
        "TITAN_UPIPE_DIR": str(REPO),
        "LOG_DIR": str(workdir / "ranks"),
    }
    # The script asks for 8 GPUs per node and 2 nodes; this CPU cluster has one node, no GPUs.
    cmd = ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--exclusive",
           f"--output={workdir}/%x-%j.out", str(SBATCH), *overrides]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    job_id = proc.stdout.strip().split(";")[0]
    if proc.returncode == 0:
        # What `sbatch --wait` does, polled every half second (its own poll backs off to tens of
        # seconds): the exit status is the job's, as Slurm accounts it.
        info = _wait_for(cluster, job_id)
        proc.returncode = 0 if info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0" else 1
    return proc, job_id


def _wait_for(cluster: LocalCluster, job_id: str, timeout_s: float = 600) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = cluster.job_info(job_id)
        if info.get("JobState") in TERMINAL_STATES:
            return info
        time.sleep(0.5)
    raise AssertionError(f"Slurm job {job_id} did not finish in {timeout_s:.0f} s: {cluster.job_info(job_id)}")


def test_sbatch_trains_on_local_slurm(cluster, tmp_path):
    dump = tmp_path / "dump"
    proc, job_id = _submit(cluster, tmp_path, "configs/debug/llama3_upipe.toml",
                           "--training.steps", str(STEPS), "--job.dump_folder", str(dump))
    slurm_log = tmp_path / f"titan_upipe-{job_id}.out"
    log_text = slurm_log.read_text() if slurm_log.exists() else "(no Slurm log)"
    assert proc.returncode == 0, f"sbatch --wait exited {proc.returncode}: {proc.stderr}\n{log_text}\n{cluster.logs()}"
    info = cluster.job_info(job_id)
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", info
    assert f"titan_upipe: job {job_id} on 1 node(s) x 2 ranks" in log_text
    assert f"titan_upipe: job {job_id} finished" in log_text
    rank_logs = [p for p in (tmp_path / "ranks").rglob("*") if p.is_file() and p.name.startswith("std")]
    assert len({p.parent.name for p in rank_logs}) == 2, rank_logs  # one folder per rank
    assert "step:  3" in log_text or "step: 3" in log_text, log_text[-3000:]
    assert len(losses(dump)) == STEPS


def test_sbatch_failure_is_the_job_exit_code(cluster, tmp_path):
    """A job that cannot run fails the job (not swallowed by srun or the script), stopped by the
    script's pre-launch check: its one line in the Slurm log, no torchrun started on any node."""
    proc, job_id = _submit(cluster, tmp_path, "configs/debug/llama3_upipe.toml",
                           "--parallelism.context_parallel_degree", "3")
    assert proc.returncode != 0
    info = cluster.job_info(job_id)
    assert info.get("JobState") == "FAILED" and info.get("ExitCode") == "2:0", info
    log = (tmp_path / f"titan_upipe-{job_id}.out").read_text()
    assert [line for line in log.splitlines() if not line.startswith("titan_upipe: job ")] == [
        "titan_upipe.train: error: 2 ranks are not a multiple of context_parallel_degree 3: set context_parallel_degree "
        "to 2"], log
    assert not [p for p in (tmp_path / "ranks").rglob("*") if p.is_file()]  # no worker's log: torchrun never ran


def test_sbatch_requires_a_config(cluster, tmp_path):
    env = {k: v for k, v in cluster.env.items() if k != "CONFIG"}
    env["TITAN_UPIPE_DIR"] = str(REPO)
    proc = subprocess.run(["sbatch", "--wait", "--parsable", "--nodes=1", "--gpus-per-node=0",
                           f"--output={tmp_path}/%x-%j.out", str(SBATCH)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    job_id = proc.stdout.strip().split(";")[0]
    assert "set CONFIG" in (tmp_path / f"titan_upipe-{job_id}.out").read_text()
    assert os.path.exists(SBATCH)
