"""Launch the trainer's ranks as forks of pre-imported processes: torchrun's worker, less its imports.

A torchrun launch of the debug configs on 2 CPU ranks takes ~20 s, of which ~3 s train: each rank
spends ~11 s importing torch, TorchTitan, datasets and inductor, and torchrun's agent ~3 s more.
The end-to-end tests launch some sixty jobs, so the imports were a third of ``make test``.

Here one *parent* per rank index (rank 0, rank 1, ...) imports the trainer once per pytest session
and then forks that rank of every launch. A forked rank is what torchrun's worker is, less the
imports:

    test ──request──> parent of rank r ──fork──> rank r: torchrun's environment, stdout/stderr to
                                                  files, ``python -m module args`` (runpy), exit code

- One parent per rank index, not one for all: each parent draws its own hash seed, as torchrun's
  workers do, so a set iterated in a different order on two ranks still diverges here.
- The environment is torchrun's (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT,
  TORCHELASTIC_RUN_ID, TORCHELASTIC_ERROR_FILE, ...), the launch's variables replacing the parent's.
- When a rank fails, the others get SIGTERM and 30 s, then SIGKILL (torchrun's agent); the launch's
  exit code is 1 as torchrun's is, and ``rank_returncodes`` holds each rank's.
- What Python reads at its start is applied as its start would: the launch's PYTHONPATH entries go on
  ``sys.path`` after the working directory. A ``sitecustomize`` among them runs before anything is
  imported in a fresh process but after the parent's imports here, so it forks only if it says it
  patches objects (a class's method), not names that modules bound when imported: its first line is
  ``SITE_AFTER_IMPORTS``. A variable read when torch is imported (OMP_NUM_THREADS, ...) cannot reach
  a process that has imported it, nor a module that reads its arguments when imported (TorchTitan's
  own trainer): ``forkable`` says no, and the caller runs torchrun.

``run_python`` runs ``python -c code`` programs the same way, several at once (the rank emulator's
measurements, ``plan_jobs.run_split``): each in a fresh process's state, less its imports.

What stays on real torchrun: the launch tests (test_launch, test_launch_once, test_slurm, test_check),
whose subject is torchrun, its agent and its output.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

PRELOADED = ("titan_upipe.train", "titan_upipe.torchtitan_0_2.launch", "torchtitan.train",
             "torch.utils.tensorboard", "titan_upipe.emulate")
"""What each parent imports once: the trainer, TorchTitan's, TensorBoard's writer, the rank emulator."""
PRELOADED_0_3 = ("titan_upipe.train", "titan_upipe.torchtitan_0_3.launch", "torch.utils.tensorboard")
"""The same where TorchTitan 0.3 is installed (the ``tests_tt03`` pass): its adapter's trainer."""


def preloaded() -> tuple[str, ...]:
    from titan_upipe.adapter import adapter_package

    return PRELOADED_0_3 if adapter_package().endswith("0_3") else PRELOADED

FORKABLE_MODULES = ("titan_upipe.train",)
"""Modules a fork runs as its fresh start would. Not ``torchtitan.train``: its ``ConfigManager.parse_args``
takes ``sys.argv[1:]`` as a default argument, read when the parent imported it."""

PARENT_ENV = {"TITAN_UPIPE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
"""The parents' environment beyond the session's: what torch reads when it is imported."""

READ_AT_IMPORT = ("PYTHONHASHSEED", "PYTHONSTARTUP", "PYTHONHOME", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                  "LD_PRELOAD", "LD_LIBRARY_PATH")
"""Variables a launch may not change here: the parents started and imported with theirs."""

SITE_AFTER_IMPORTS = "# forked_ranks: the same after the imports (patches objects, not imported names)"
"""The first line of a ``sitecustomize`` that may run after the parent's imports (``forkable``)."""

STOP_GRACE_S = 30.0
"""torchrun's agent: a failed rank's peers get SIGTERM, then SIGKILL after this long."""


def forkable(module: str | None, env: dict[str, str]) -> bool:
    """Whether a launch of ``module`` (None: ``python -c`` code) with ``env`` (the full environment)
    runs in a fork as it would in a fresh process."""
    base = {**os.environ, **PARENT_ENV}
    paths = _added_paths(env)
    return (module is None or module in FORKABLE_MODULES) and all(env.get(name) == base.get(name) for name in READ_AT_IMPORT) and \
        paths is not None and all(_site_forks(entry) for entry in paths)


def _site_forks(entry: str) -> bool:
    site = Path(entry, "sitecustomize.py")
    return not site.exists() or site.read_text().startswith(SITE_AFTER_IMPORTS)


def _added_paths(env: dict[str, str]) -> list[str] | None:
    """The launch's PYTHONPATH entries before the parents' (None: it drops or reorders theirs)."""
    mine, theirs = env.get("PYTHONPATH", ""), os.environ.get("PYTHONPATH", "")
    if theirs and not mine.endswith(theirs):
        return None
    added = mine[: len(mine) - len(theirs)] if theirs else mine
    return [entry for entry in added.split(os.pathsep) if entry]


class ForkedLaunch(subprocess.CompletedProcess):
    """A launch's result as ``subprocess.run`` gives torchrun's, with each rank's exit code."""

    def __init__(self, args: list[str], returncode: int, stdout: str, stderr: str, rank_returncodes: list[int]):
        super().__init__(args, returncode, stdout, stderr)
        self.rank_returncodes = rank_returncodes


# ---- the parent (a process per rank index) -------------------------------------------------------


def _serve() -> None:
    """Import the trainer, then fork a rank per request until stdin closes."""
    import importlib

    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints of imports go to stderr, not into the replies
    for name in preloaded():
        importlib.import_module(name)
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _rank(request, keep=(replies.fileno(), requests.fileno()))
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")


def _rank(request: dict, keep: tuple[int, ...]) -> None:
    """In the fork: become the rank ``python -m module args`` would be under torchrun; never returns."""
    import atexit as exits
    import importlib
    import runpy
    import threading
    import traceback

    code = 1
    try:
        for fd in keep:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = request["cwd"]  # ``python -m``: the working directory first (``-c``: below)
        sys.path[1:1] = request["paths"]  # then PYTHONPATH's entries, as at a start
        if any(Path(entry, "sitecustomize.py").exists() for entry in request["paths"]):
            sys.modules.pop("sitecustomize", None)
            importlib.import_module("sitecustomize")  # site's hook: before the module runs
        if "code" in request:  # ``python -c code args``: the working directory first, as ''
            sys.path[0] = ""
            sys.argv = ["-c", *request["args"]]
            code = 0
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = [request["module"], *request["args"]]
            # ``python -m`` executes the module once, as __main__: the parent's import of it (for its
            # dependencies) is dropped, or runpy warns that it runs a module already imported
            sys.modules.pop(request["module"], None)
            code = 0
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - the interpreter's own end: the traceback, exit 1
        traceback.print_exc()
        code = 1
    finally:
        # the interpreter's shutdown: non-daemon threads joined, then the exit handlers
        try:
            threading._shutdown()  # noqa: SLF001
            exits._run_exitfuncs()  # noqa: SLF001
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


# ---- the test side -------------------------------------------------------------------------------


class _Parent:
    def __init__(self) -> None:
        env = {**os.environ, **PARENT_ENV}
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve"], cwd=REPO, env=env, text=True, bufsize=1,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.ready = False

    def reply(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], max(timeout, 0.0))
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the rank parent {self.proc.pid} exited ({self.proc.poll()})")
        return json.loads(line)

    def wait_ready(self, timeout: float = 600.0) -> None:
        if not self.ready:
            assert "ready" in self.reply(timeout)
            self.ready = True

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_PARENTS: list[_Parent] = []


def _parents(nproc: int) -> list[_Parent]:
    while len(_PARENTS) < nproc:
        _PARENTS.append(_Parent())  # started together: they import side by side
    for parent in _PARENTS[:nproc]:
        parent.wait_ready()
    return _PARENTS[:nproc]


@atexit.register
def _close_parents() -> None:
    while _PARENTS:
        _PARENTS.pop().close()


def _drop(parents: list[_Parent]) -> None:
    """Parents whose rank did not report cleanly are replaced at the next launch."""
    for parent in parents:
        parent.close()
        if parent in _PARENTS:
            _PARENTS[_PARENTS.index(parent)] = _Parent()


def _torchrun_env(env: dict[str, str], rank: int, nproc: int, port: int, run_id: str, error_file: str) -> dict[str, str]:
    """What torchrun's agent sets for a worker of a single-node launch (its own store aside:
    rank 0 hosts the rendezvous store, as without the agent's)."""
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_ERROR_FILE": error_file, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def launch(nproc: int, module: str, args: list[str], env: dict[str, str], cwd: Path, timeout: float) -> ForkedLaunch:
    """``torchrun --standalone --nproc_per_node nproc -m module args`` with ``env`` (full), as forks.
    Raises ``subprocess.TimeoutExpired`` (every rank killed) past ``timeout`` seconds."""
    port, run_id = free_port(), f"forked-{os.getpid()}-{time.monotonic_ns()}"
    with tempfile.TemporaryDirectory(prefix="forked_ranks_") as folder:
        requests = [{"module": module, "args": list(args), "cwd": str(cwd), "paths": _added_paths(env),
                     "env": _torchrun_env(env, rank, nproc, port, run_id, str(Path(folder, f"{rank}.error.json")))}
                    for rank in range(nproc)]
        codes, stdout, stderr = _run(requests, Path(folder), timeout, stop_on_failure=True)
    return ForkedLaunch([module, *args], 0 if not any(codes) else 1, "".join(stdout), "".join(stderr), codes)


def run_python(code: str, argvs: list[list[str]], env: dict[str, str], cwd: Path,
               timeout: float) -> list[subprocess.CompletedProcess]:
    """``python -c code *argv`` for each of ``argvs``, at once, with ``env`` (full); one result per run,
    as ``subprocess.run(..., capture_output=True, text=True)`` gives. Each in a fork of its own parent
    where ``forkable(None, env)``, else in fresh processes."""
    if not forkable(None, env):
        procs = [subprocess.Popen([sys.executable, "-c", code, *argv], cwd=cwd, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for argv in argvs]
        runs = []
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            runs.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        return runs
    with tempfile.TemporaryDirectory(prefix="forked_python_") as folder:
        requests = [{"code": code, "args": list(argv), "cwd": str(cwd), "paths": _added_paths(env), "env": dict(env)}
                    for argv in argvs]
        codes, stdout, stderr = _run(requests, Path(folder), timeout, stop_on_failure=False)
    return [subprocess.CompletedProcess(["-c", code, *argv], rc, out, err)
            for argv, rc, out, err in zip(argvs, codes, stdout, stderr, strict=True)]


def python(code: str, *argv: str, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``python -c code *argv``: one ``run_python``."""
    return run_python(code, [list(argv)], env, cwd, timeout)[0]


def _run(requests: list[dict], folder: Path, timeout: float, stop_on_failure: bool) -> tuple[list[int], list[str], list[str]]:
    """Request ``i`` forked by parent ``i``; each fork's exit code, stdout and stderr. ``stop_on_failure``:
    torchrun's agent (a failed rank's peers get SIGTERM, then SIGKILL after ``STOP_GRACE_S``)."""
    n = len(requests)
    parents = _parents(n)
    files = [(folder / f"{i}.out", folder / f"{i}.err") for i in range(n)]
    for parent, request, (out, err) in zip(parents, requests, files, strict=True):
        parent.proc.stdin.write(json.dumps({**request, "stdout": str(out), "stderr": str(err)}) + "\n")
        parent.proc.stdin.flush()
    pids = [parent.reply(60.0)["pid"] for parent in parents]
    codes: dict[int, int] = {}
    deadline, stop_at = time.monotonic() + timeout, None
    try:
        while len(codes) < n:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([r.get("module") or "-c" for r in requests], timeout)
            waiting = {parent.proc.stdout: i for i, parent in enumerate(parents) if i not in codes}
            ready, _, _ = select.select(list(waiting), [], [], 1.0)
            for stream in ready:
                i = waiting[stream]
                codes[i] = parents[i].reply(1.0)["rc"]
                if stop_on_failure and codes[i] != 0 and stop_at is None:
                    stop_at = time.monotonic() + STOP_GRACE_S
                    _signal([pid for j, pid in enumerate(pids) if j not in codes], signal.SIGTERM)
            if stop_at is not None and time.monotonic() > stop_at:
                _signal([pid for j, pid in enumerate(pids) if j not in codes], signal.SIGKILL)
    except BaseException:
        _signal([pid for j, pid in enumerate(pids) if j not in codes], signal.SIGKILL)
        _drop([parents[j] for j in range(n) if j not in codes])
        raise
    return ([codes[i] for i in range(n)], [out.read_text(errors="replace") for out, _ in files],
            [err.read_text(errors="replace") for _, err in files])


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
