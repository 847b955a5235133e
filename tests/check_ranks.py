"""``titan_upipe.check`` on a rank of the shared gloo pools (``dist_utils.run_distributed``: no torchrun start),
for the parity tests of both TorchTitan versions (``tests/test_check.py``, ``tests_tt03/test_check.py``)."""

from __future__ import annotations

import contextlib
import io
import os

from trainer_utils import REPO


def check_in_pool(rank, world, mesh, config, *extra):
    """``run_check`` of ``config`` at 64 tokens on this rank; (exit code, rank 0's report)."""
    from titan_upipe.tools.parity import run_check

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run_check(["--job.config_file", str(REPO / config), "--seq-len", "64", *extra])
    return code, out.getvalue()
