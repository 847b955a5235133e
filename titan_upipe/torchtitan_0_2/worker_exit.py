"""How a worker of ``titan_upipe.train`` ends with an error: one line from one rank, the error in
torch-elastic's error file, the exit status.

torchrun's failure summary ("Root Cause (first observed failure)") prints what the failing worker
wrote to ``TORCHELASTIC_ERROR_FILE``: with no file, ``error_file: <N/A>`` and a link; with the
file TorchTitan's ``@record`` writes (``Trainer.__init__`` and ``train`` are wrapped), the whole
traceback. :func:`write_error_file` writes our one line there instead, in the format torch's
``ErrorHandler.record_exception`` uses without its ``py_callstack``, so that the summary's
``traceback :`` field is the line itself.

Who prints: after the process group started, a failure is either every rank's (a decision taken on
reduced values, such as a non-finite loss: every rank raises the same error at the same step) or
one rank's own (a file missing on one node). Rank 0 prints at once. Another failing rank first
waits up to :data:`RANK_ZERO_WAIT_SECONDS` for rank 0's failure on the launch's store
(``launch_store``): the same line there, and it stays silent; none (rank 0 is still working, or
waits in a collective for this rank) or another line, and it prints its own with its rank.
"""

from __future__ import annotations

import json
import os
import time

from titan_upipe.errors import exit_once, write_line
from titan_upipe.torchtitan_0_2.launch_store import LaunchStore

TOOL = "titan_upipe.train"
RANK_ZERO_WAIT_SECONDS = 10.0
"""How long a failing rank other than 0 waits for rank 0's report of the same failure."""


def error_line(message: str, rank: int | None = None) -> str:
    """``titan_upipe.train: error: …``, or ``… error on rank N: …`` for a line of one rank's own."""
    return f"{TOOL}: error: {message}" if rank is None else f"{TOOL}: error on rank {rank}: {message}"


def write_error_file(line: str) -> None:
    """``line`` as this worker's error for torchrun's failure summary (``TORCHELASTIC_ERROR_FILE``,
    set by torchrun for each worker; nothing outside torchrun). Replaces what ``@record`` wrote."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        pass  # the summary then says <N/A>, as without the file; the line itself is printed anyway


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def exit_before_start(message: str, status: int = 2) -> SystemExit:
    """A failure before any process group (every rank checks the same job and fails alike): the
    error file, then :func:`titan_upipe.errors.exit_once` (rank 0 prints, the others outwait it)."""
    write_error_file(error_line(message))
    return exit_once(TOOL, message, status)


def exit_after_start(message: str, launch: LaunchStore | None, status: int = 2) -> SystemExit:
    """A failure after the ranks met: printed by rank 0, or by another failing rank whose failure rank
    0 did not report (module docstring); every failing rank writes its error file and exits ``status``."""
    rank = _rank()
    if launch is None:  # a single process, or a failure before the store was reached
        return exit_before_start(message, status)
    launch.record_failure(message)
    if rank == 0:
        write_error_file(error_line(message))
        write_line(error_line(message))
        return SystemExit(status)
    if launch.failure_of(0, RANK_ZERO_WAIT_SECONDS) == message:
        write_error_file(error_line(message))  # rank 0's line, printed there
        return SystemExit(status)
    write_error_file(error_line(message, rank))
    write_line(error_line(message, rank))
    return SystemExit(status)
