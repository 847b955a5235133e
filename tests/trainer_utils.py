"""Run the real trainer under torchrun and read what it wrote to TensorBoard."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from pathlib import Path

import forked_ranks

REPO = Path(__file__).resolve().parents[1]

E2E_STEPS = "4"
"""Steps of the end-to-end trainer runs compared with the shared 1-rank reference (conftest)."""

E2E_SEQ = 512
"""``training.seq_len`` of the debug configs."""

def e2e_validation(data_parallel: int = 1, dataset: str = "synthetic_copy") -> tuple[str, ...]:
    return ("--validation.enable", "--validation.dataset", dataset, "--validation.seq_len", str(E2E_SEQ),
            "--validation.local_batch_size", str(2 // data_parallel), "--validation.steps", "1",
            "--validation.freq", "2")


"""Held-out synthetic validation after steps 1, 2 and 4 of the end-to-end runs: one global batch
of 2 sequences, whatever the data-parallel degree."""


def torchrun(nproc: int, module: str, config: str, dump_folder: Path, *overrides: str,
             timeout: int = 600, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Launch ``module`` on ``nproc`` gloo ranks (``env`` added to the environment); raise with
    the log tail if it fails (``check``; else return the failed launch as well).

    The ranks are forks of pre-imported processes (``forked_ranks``: torchrun's workers less their
    imports) unless ``env`` or ``module`` needs a fresh start (``forked_ranks.forkable``); then
    torchrun itself runs."""
    args = ["--job.config_file", str(REPO / config), "--job.dump_folder", str(dump_folder), *overrides]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", module, *args]
    env = {**os.environ, "TITAN_UPIPE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", **(env or {})}
    if forked_ranks.forkable(module, env):
        proc = forked_ranks.launch(nproc, module, args, env, REPO, timeout)
    else:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def rank_exit_codes(proc: subprocess.CompletedProcess) -> list[int]:
    """The exit code of each failed rank of a launch: forked ranks report theirs, torchrun's agent
    prints ``exitcode : N`` per failed rank."""
    if isinstance(proc, forked_ranks.ForkedLaunch):
        return [code for code in proc.rank_returncodes if code]
    return [int(code) for code in re.findall(r"exitcode\s*: (-?\d+)", proc.stdout + proc.stderr)]


def create_seed_checkpoint(config: str, dump_folder: Path, *overrides: str) -> Path:
    """One-process initial weights, loaded by every run so all layouts start identical."""
    torchrun(1, "titan_upipe.train", config, dump_folder, "--checkpoint.enable",
             "--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree", "1",
             *overrides)
    return dump_folder / "checkpoint" / "step-0"


def load_seed(seed: Path) -> tuple[str, ...]:
    return ("--checkpoint.enable", "--checkpoint.initial_load_path", str(seed), "--checkpoint.load_only")


def read_scalars(dump_folder: Path) -> dict[str, list[tuple[int, float]]]:
    """All scalars of the newest TensorBoard run under ``dump_folder/tb``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted(glob.glob(str(dump_folder / "tb" / "*")))
    assert runs, f"no TensorBoard run under {dump_folder / 'tb'}"
    acc = EventAccumulator(runs[-1], size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def losses(dump_folder: Path, tag: str = "loss_metrics/global_avg_loss") -> list[float]:
    return [v for _, v in read_scalars(dump_folder)[tag]]


def assert_losses_close(actual: list[float], expected: list[float], rtol: float) -> None:
    assert len(actual) == len(expected) and expected, (actual, expected)
    for step, (a, e) in enumerate(zip(actual, expected, strict=True), start=1):
        assert abs(a - e) <= rtol * abs(e), f"step {step}: loss {a} vs reference {e} (rtol {rtol})"


COUNT_LAYOUTS = forked_ranks.SITE_AFTER_IMPORTS + """
import atexit, os, sys
from titan_upipe.spec import cp_layout as _module

_built = [0]
_post_init = _module.CPLayout.__post_init__
_PLANNER = os.sep + os.path.join("titan_upipe", "plan") + os.sep


def _counted(self):
    # the memory planner's own layouts (the launch's memory guard: arithmetic on the settings) are not
    # the job's; frame 2 is the caller of the dataclass __init__
    if _PLANNER not in sys._getframe(2).f_code.co_filename:
        _built[0] += 1
    _post_init(self)


_module.CPLayout.__post_init__ = _counted
# a rank's count under its rank; a launcher's own process (torchrun's agent) under its pid
atexit.register(lambda: open(os.path.join(os.environ["TITAN_UPIPE_LAYOUT_COUNTS"],
                                          f"rank{os.environ['RANK']}" if "RANK" in os.environ else f"pid{os.getpid()}"),
                             "w").write(str(_built[0])))
"""


def counting_layouts(folder: Path) -> dict[str, str]:
    """Environment that makes every process of a launch count the ``CPLayout`` objects it builds
    (not the memory planner's: ``titan_upipe.plan`` plans from the settings),
    into a file per process under ``folder`` (a ``sitecustomize`` of the test's own: nothing in
    the package is instrumented)."""
    site, counts = folder / "site", folder / "counts"
    site.mkdir(parents=True)
    counts.mkdir()
    (site / "sitecustomize.py").write_text(COUNT_LAYOUTS)
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(site) + (os.pathsep + path if path else ""), "TITAN_UPIPE_LAYOUT_COUNTS": str(counts)}


def layout_counts(folder: Path) -> list[int]:
    """The ``CPLayout`` objects each rank of the launch built, rank order (a launcher's own
    process, which builds none, is not a rank)."""
    ranks = sorted(folder.glob("counts/rank*"), key=lambda p: int(p.name.removeprefix("rank")))
    assert not [p for p in folder.glob("counts/pid*") if p.read_text() != "0"], "the launcher built a layout"
    return [int(p.read_text()) for p in ranks]


def assert_progress_lines(console: str, steps: int) -> list[str]:
    """Each step's progress lines of a 2-block model in ``console``, once (``torchtitan_common.progress``,
    ``metrics.progress_after_seconds = 0``): the blocks of the forward and the backward, the optimizer, and the
    step's end with the run's ETA. Returns the lines."""
    lines = re.findall(rf"- INFO - (step \d+/{steps}  .*)", console)
    for step in range(1, steps + 1):
        mine = [line for line in lines if line.startswith(f"step {step}/{steps}  ")]
        where = [line.split("elapsed")[0].split(None, 2)[-1].strip() for line in mine[:-1]]
        assert where == ["forward    block 1/2", "forward    block 2/2", "backward   block 1/2",
                         "backward   block 2/2", "optimizer"], mine
        assert re.fullmatch(rf"step {step}/{steps}  \S+ \(forward \S+, backward \S+, optimizer \S+\)  "
                            rf"run ETA \S+ at \S+/step \(last {step}\)", mine[-1]), mine[-1]
    return lines
