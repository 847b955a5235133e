"""``python -m titan_upipe.tools.torchrun [torchrun options] -m titan_upipe.train …``: torchrun, whose
own end is at most one line instead of a traceback. The launch scripts (``make run``,
``scripts/run_train.sh``, ``scripts/slurm/train.sbatch``) launch through it.

torchrun (``torch.distributed.run.main``) ends a launch that did not succeed by raising: Ctrl-C or
SIGTERM as a ``SignalException`` traceback (25 lines), a failed worker as a ``ChildFailedError``
traceback around its failure summary (40 lines). The workers of ``titan_upipe.train`` have already
said why in one line (an error, or where an interruption left the run:
``titan_upipe.torchtitan_0_2.worker_exit``, ``…interrupts``). So here:

- a signal ends the launch with nothing more and exit status 128 + the signal (130, 143);
- a failed worker whose error file holds one of our lines adds nothing, any other failure (a
  crash, a kill) gets one line naming the rank, its exit and its error file; the exit status is
  the worker's (a signal's: 128 + it).
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

OUR_LINES = ("titan_upipe.",)
"""How the lines of the package's commands begin (``titan_upipe.train: error: …``)."""


def _exit_status(exitcode: int) -> int:
    """A worker's exit as a shell status: a signal's death (negative) is 128 + the signal."""
    return 128 - exitcode if exitcode < 0 else (exitcode if 0 < exitcode < 256 else 1)


def failure_line(err: ChildFailedError) -> str | None:
    """One line for torchrun's root cause, or None when the worker's own line said it already."""
    rank, failure = err.get_first_failure()
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if isinstance(message, str) and message.startswith(OUR_LINES):
        return None
    if failure.exitcode < 0:
        how = f"was killed by {signal.Signals(-failure.exitcode).name}"
    else:
        how = f"exited with status {failure.exitcode}"
    return f"torchrun: {err.name} failed: rank {rank} {how} (error file: {failure.error_file}); its output is above"


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun_main(argv)
    except SignalException as err:
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        if (line := failure_line(err)) is not None:
            print(line, file=sys.stderr, flush=True)
        return _exit_status(err.get_first_failure()[1].exitcode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
