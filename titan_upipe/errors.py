"""The one error type of a setting that cannot run exactly, and the one way a command reports it
(core: no torch, no TorchTitan)."""

from __future__ import annotations

import difflib
import os
import sys
import time
from collections.abc import Iterable


class ConfigError(ValueError):
    """A setting that cannot run exactly; the message names it and the valid choices."""


class TrainingStopped(Exception):
    """Training cannot go on (a non-finite loss or gradient norm, ``training.on_nonfinite =
    "stop"``); the message is one line: the step, the value, the last complete checkpoint and the
    likely cause. Every rank raises it at the same step (the values are reduced over all ranks)."""


def closest(word: object, choices: Iterable[object]) -> str | None:
    """The choice closest to ``word`` (difflib's ratio), or None when none is close enough to be a
    likely typo of it."""
    close = difflib.get_close_matches(str(word), [str(choice) for choice in choices], n=1)
    return close[0] if close else None


def did_you_mean(word: object, choices: Iterable[object]) -> str:
    """``'did you mean "x"?'`` for the choice closest to ``word``, or ``''``."""
    match = closest(word, choices)
    return f'did you mean "{match}"?' if match else ""


def with_suggestion(message: str, word: object, choices: Iterable[object]) -> str:
    """``message`` followed by ``; did you mean "x"?`` when one of ``choices`` is close to ``word``."""
    hint = did_you_mean(word, choices)
    return f"{message}; {hint}" if hint else message


RANK_ZERO_GRACE_SECONDS = 30.0
"""How long a rank other than 0 that failed a check before any process group stays alive, so that
rank 0 prints the one line before torchrun stops the launch."""


def is_rank_zero() -> bool:
    """This process is rank 0 of its launch (``RANK`` unset: not launched by torchrun)."""
    return os.environ.get("RANK", "0") == "0"


def exit_once(tool: str, message: str, status: int = 2) -> SystemExit:
    """The exit of a command that cannot run: ``tool: error: message`` printed once, no traceback.

    Outside torchrun and on rank 0 the line is printed at once. Under torchrun
    (``TORCHELASTIC_RUN_ID``) every rank checks the same command line and config, so the others
    fail alike; torchrun stops the launch as soon as one rank exits non-zero, which could kill
    rank 0 before it printed. So a rank other than 0 first waits :data:`RANK_ZERO_GRACE_SECONDS`
    for torchrun to stop it after rank 0's exit. Still alive after that (another node, whose agent
    is slower to stop it; or rank 0 did not fail: its files differ, say), each node's local rank 0
    prints the line with its rank, so that a node's own error is never lost and a node prints
    it at most once. Returns the ``SystemExit`` to raise (``raise exit_once(...) from None``)."""
    if is_rank_zero() or "TORCHELASTIC_RUN_ID" not in os.environ:
        write_line(f"{tool}: error: {message}")
        return SystemExit(status)
    time.sleep(RANK_ZERO_GRACE_SECONDS)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        write_line(f"{tool}: error on rank {os.environ['RANK']}: {message}")
    return SystemExit(status)


def write_line(text: str) -> None:
    """``text`` and its newline to stderr in one ``write`` (atomic on a pipe up to ``PIPE_BUF`` bytes):
    torchrun merges every process's stream into one, and a line written in two parts can have another
    process's output land between them (seen once: the line glued to a worker's log fragment). A
    stderr without a file descriptor (a test's capture) gets it through ``print``."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        print(text, file=sys.stderr, flush=True)
        return
    data = (text + "\n").encode("utf-8", "backslashreplace")
    while data:  # a line over PIPE_BUF may take several writes; the rest follows at once
        data = data[os.write(fd, data):]
