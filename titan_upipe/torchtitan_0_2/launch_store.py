"""The launch's key-value store (torchrun's ``TCPStore``) beside TorchTitan's process group: which
ranks joined the rendezvous, and which failed.

TorchTitan's ``init_distributed`` calls ``init_process_group`` (``env://``), which waits up to
``comm.init_timeout_seconds`` (300 s) for every rank and says nothing meanwhile: a rank that never
comes (two processes started by hand with ``WORLD_SIZE=4``, a node whose workers did not start)
ends in a traceback five minutes later. :func:`join` counts the ranks on the very store that
``init_process_group`` then uses (torchrun's agent store, or under a launch by hand the store
rank 0 hosts, shared with the process group's through the TCPStore's multi-tenancy) and says every :data:`REPORT_EVERY_SECONDS` how many joined out
of how many; when the time is up the job stops with one line naming the missing ranks.

After the start the same store carries the failures (:meth:`LaunchStore.record_failure`), so that
a rank learns whether rank 0 already reported the error it is about to print
(``worker_exit``), or whether a SIGTERM it got is torchrun ending the job after a peer failed
(``interrupts``). Only non-blocking calls are made once connected (``add``, ``check``, ``get``
of a key known to exist): a blocking ``wait`` that times out makes c10d print warnings.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch

from titan_upipe.errors import ConfigError

REPORT_EVERY_SECONDS = 30.0
"""How often a rendezvous that is missing ranks says how many joined."""
POLL_SECONDS = 0.2
PREFIX = "titan_upipe"
MISSING_SHOWN = 8
"""Missing ranks named in a line, at most."""

Say = Callable[[str], None]


def say_on_stderr(line: str) -> None:
    print(f"titan_upipe.train: {line}", file=sys.stderr, flush=True)


@dataclass
class LaunchStore:
    """The launch's store as one rank sees it; keys are scoped to torchrun's restart attempt."""

    store: torch.distributed.Store
    rank: int
    world_size: int

    def key(self, *parts: object) -> str:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return "/".join((PREFIX, f"attempt_{attempt}", *map(str, parts)))

    def joined(self) -> int:
        return self.store.add(self.key("joined"), 0)

    def missing_ranks(self) -> list[int]:
        return [rank for rank in range(self.world_size) if not self.store.check([self.key("rank", rank)])]

    def record_failure(self, message: str) -> None:
        """This rank failed with ``message`` (a peer may read it); never raises: the store may be gone
        (rank 0 hosted it and has exited)."""
        try:
            self.store.set(self.key("failed", self.rank), message)
            self.store.add(self.key("failures"), 1)
        except (torch.distributed.DistError, RuntimeError):
            pass

    def failures(self) -> int:
        """Ranks that recorded a failure; 0 when the store cannot be reached."""
        try:
            return self.store.add(self.key("failures"), 0)
        except (torch.distributed.DistError, RuntimeError):
            return 0

    def failure_of(self, rank: int, wait_s: float) -> str | None:
        """The failure ``rank`` recorded, waiting up to ``wait_s`` for it; None when none came (or
        the store is gone)."""
        deadline = time.monotonic() + wait_s
        key = self.key("failed", rank)
        try:
            while not self.store.check([key]):
                if time.monotonic() >= deadline:
                    return None
                time.sleep(POLL_SECONDS)
            return self.store.get(key).decode()
        except (torch.distributed.DistError, RuntimeError):
            return None


def _ranks_text(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 2, 3``, ``ranks 0, 1, … and 12 more``."""
    shown = ", ".join(map(str, ranks[:MISSING_SHOWN]))
    more = f" and {len(ranks) - MISSING_SHOWN} more" if len(ranks) > MISSING_SHOWN else ""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {shown}{more}"


def _master() -> tuple[str, int]:
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ConfigError(f"WORLD_SIZE = {os.environ.get('WORLD_SIZE')} but {' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not set: launch with torchrun, which sets RANK, "
                          "WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every rank")
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def _wait_for_server(address: tuple[str, int], rank: int, timeout_s: float, say: Say) -> None:
    """Wait until something listens at ``address`` (a plain socket probe: a ``TCPStore`` client that
    cannot connect prints c10d's warnings at every retry), saying so every report interval."""
    start = last_report = time.monotonic()
    while True:
        try:
            socket.create_connection(address, timeout=POLL_SECONDS * 5).close()
            return
        except OSError:
            pass
        now = time.monotonic()
        if now - start >= timeout_s:
            raise ConfigError(f"rank {rank}: nothing answers at MASTER_ADDR:MASTER_PORT = {address[0]}:{address[1]} "
                              f"after {timeout_s:.0f} s (comm.init_timeout_seconds): start rank 0 (it hosts the "
                              "rendezvous), or launch every rank with torchrun")
        if now - last_report >= REPORT_EVERY_SECONDS:
            last_report = now
            say(f"rank {rank}: waiting for rank 0's rendezvous at {address[0]}:{address[1]} ({now - start:.0f} s of "
                f"{timeout_s:.0f} s, comm.init_timeout_seconds)")
        time.sleep(POLL_SECONDS)


def connect(rank: int, world_size: int, timeout_s: float, say: Say = say_on_stderr) -> LaunchStore:
    """The launch's store, where ``init_process_group`` (``env://``) will find it: torchrun's agent
    store (every rank a client), or by hand rank 0's (``TORCHELASTIC_USE_AGENT_STORE`` unset; the
    process group's own store shares its server: ``multi_tenant``). No constructor waits for the
    other ranks (``wait_for_workers``): :func:`join` does, saying how many came."""
    address = _master()
    hosts_it = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)
    if not hosts_it:
        _wait_for_server(address, rank, timeout_s, say)
    store = torch.distributed.TCPStore(address[0], address[1], world_size, is_master=hosts_it,
                                       timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                                       multi_tenant=hosts_it)
    return LaunchStore(store, rank, world_size)


def join(launch: LaunchStore, timeout_s: float, say: Say = say_on_stderr) -> None:
    """Mark this rank joined and wait for all ``world_size``; rank 0 says every report interval how
    many joined. Raises ConfigError naming the missing ranks once ``timeout_s`` has passed."""
    launch.store.set(launch.key("rank", launch.rank), "1")
    launch.store.add(launch.key("joined"), 1)
    start = last_report = time.monotonic()
    while (joined := launch.joined()) < launch.world_size:
        now = time.monotonic()
        if now - start >= timeout_s:
            missing = _ranks_text(launch.missing_ranks())
            raise ConfigError(f"only {joined} of {launch.world_size} ranks joined the rendezvous in {timeout_s:.0f} s "
                              f"(comm.init_timeout_seconds; missing: {missing}): launch all WORLD_SIZE = "
                              f"{launch.world_size} ranks (torchrun's --nnodes x --nproc_per_node), or check that "
                              "every node started")
        if now - last_report >= REPORT_EVERY_SECONDS and launch.rank == 0:
            last_report = now
            say(f"{joined} of {launch.world_size} ranks joined the rendezvous after {now - start:.0f} s (missing: "
                f"{_ranks_text(launch.missing_ranks())}); waiting up to {timeout_s:.0f} s "
                "(comm.init_timeout_seconds)")
        time.sleep(POLL_SECONDS)
