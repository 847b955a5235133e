"""A one-node Slurm cluster on localhost for testing ``scripts/slurm/train.sbatch``.

Installs Debian's ``slurm-wlm`` and ``munge`` when they are missing (root and apt needed),
starts ``munged`` (if no munge daemon answers), ``slurmctld`` and ``slurmd`` with a
configuration in a temporary directory and free ports, and stops the Slurm daemons
afterwards. ``unavailable_reason()`` says why a cluster cannot be had on this machine.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol")


def _sbin(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}",) if os.access(p, os.X_OK)), None)


def _run(cmd: list[str], timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def install_packages() -> str | None:
    """Install slurm-wlm and munge with apt if missing; None on success, else the reason."""
    if all(_sbin(name) for name in DAEMONS):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"Slurm is not installed and cannot be: installing {' '.join(PACKAGES)} needs root and apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    proc = _run(install, env=env)
    if proc.returncode != 0:
        _run(["apt-get", "update"], env=env)
        proc = _run(install, env=env)
    if proc.returncode != 0:
        return f"apt-get install {' '.join(PACKAGES)} failed: {proc.stderr.strip()[-400:]}"
    missing = [name for name in DAEMONS if not _sbin(name)]
    return f"installed {' '.join(PACKAGES)} but {missing} are still missing" if missing else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _munge_works() -> bool:
    if not shutil.which("munge") or not shutil.which("unmunge"):
        return False
    encoded = _run(["munge", "-n"], timeout=10)
    return encoded.returncode == 0 and _run(["unmunge"], input=encoded.stdout, timeout=10).returncode == 0


def start_munge() -> None:
    if _munge_works():
        return
    run_dir = Path("/run/munge")
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.chown(run_dir, "munge", "munge")
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        _run(["runuser", "-u", "munge", "--", _sbin("mungekey") or "mungekey", "--create"])
    proc = _run(["runuser", "-u", "munge", "--", _sbin("munged")])
    for _ in range(50):
        if _munge_works():
            return
        time.sleep(0.1)
    raise RuntimeError(f"munged did not start: {proc.stderr.strip()}")


@dataclass
class LocalCluster:
    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_config(self) -> None:
        host = socket.gethostname()
        cpus = os.cpu_count() or 1
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text("\n".join([
            "ClusterName=titanupipe-test",
            f"SlurmctldHost={host}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2",
            "MinJobAge=3600",
            f"NodeName={host} CPUs={cpus} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def start(self) -> None:
        self.write_config()
        start_munge()
        for daemon in ("slurmctld", "slurmd"):
            proc = _run([_sbin(daemon), "-f", str(self.conf)], env=self.env, timeout=60)
            if proc.returncode != 0:
                raise RuntimeError(f"{daemon} failed to start: {proc.stderr.strip()}\n{self.logs()}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = _run(["sinfo", "-h", "-o", "%t"], env=self.env, timeout=30).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm node never became idle (state {state!r})\n{self.logs()}")

    def stop(self) -> None:
        for daemon in ("slurmd", "slurmctld"):
            pid_file = self.root / f"{daemon}.pid"
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text().strip()), 15)
                except (ProcessLookupError, ValueError):
                    pass

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((self.root / "log").glob("*.log")))

    def job_info(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as key=value pairs (JobState, ExitCode, StdOut, ...)."""
        text = _run(["scontrol", "show", "job", "-o", job_id], env=self.env, timeout=30).stdout
        return dict(field.split("=", 1) for field in text.split() if "=" in field)
