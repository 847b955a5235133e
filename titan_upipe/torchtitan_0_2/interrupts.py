"""Ctrl-C and SIGTERM during a run: one line from rank 0 (the step, the newest complete checkpoint,
how to resume), no traceback from any rank, exit status 128 + the signal (130, 143).

Ctrl-C sends SIGINT to torchrun and every worker at once (and torchrun sends it again); ``kill``,
``scancel`` or a torchrun ending the job send SIGTERM. Python's default turns SIGINT into a
``KeyboardInterrupt`` traceback through TorchTitan's loop on every rank, and its handler runs only
when the main thread returns to Python: a rank blocked in a collective whose peer already left
stays there until the collective's timeout. So the first signal does two things:

- the main thread raises :class:`Interrupted` (a ``BaseException``: neither TorchTitan's
  ``except Exception`` nor torch-elastic's ``@record`` takes it for an error), which unwinds the
  run through its ``finally`` blocks (metrics flushed, process group destroyed);
- a watcher thread, woken through ``signal.set_wakeup_fd`` whatever the main thread is doing,
  prints the line on rank 0 at once and ends the process after :data:`UNWIND_SECONDS` if the
  main thread has not (blocked in a collective).

A SIGTERM that torchrun sends because a peer failed is not an interruption to report: the peer
printed the error, and rank 0 stays silent when the launch's store holds a failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from titan_upipe.errors import write_line

UNWIND_SECONDS = 10.0
"""How long the main thread may take to unwind after the first signal before the process exits."""
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The run was interrupted by ``signum``; the process exits with :attr:`status`."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def status(self) -> int:
        return 128 + self.signum


def interrupted_line(signum: int, step: int, steps: int, checkpoint_enabled: bool, checkpoint_folder: str,
                     saved_steps: list[int], interval: int) -> str:
    """``titan_upipe.train: interrupted by SIGINT during step 27 of 200; …`` with the newest complete
    checkpoint and what the same command does when run again (``step`` 0: before the first step)."""
    where = f"during step {step} of {steps}" if step > 0 else "before the first step"
    if saved_steps:
        newest = os.path.join(checkpoint_folder, f"step-{saved_steps[-1]}")
        resume = (f"newest complete checkpoint: {newest}; run the same command again to resume from it "
                  f"(at step {saved_steps[-1] + 1})")
    elif checkpoint_enabled:
        resume = (f"no checkpoint is complete yet in {checkpoint_folder} (checkpoint.interval = {interval}): the "
                  "same command starts again from step 1")
    else:
        resume = "checkpoint.enable = false, so nothing was saved: the same command starts again from step 1"
    return f"titan_upipe.train: interrupted by {signal.Signals(signum).name} {where}; {resume}"


Describe = Callable[[int], "str | None"]
"""``describe(signum)``: the line to print for that signal on this rank, or None to stay silent."""


class InterruptWatch:
    """The first SIGINT/SIGTERM: :class:`Interrupted` in the main thread, the line from the watcher
    thread, the exit after :data:`UNWIND_SECONDS` (module docstring). Later signals are ignored."""

    def __init__(self, describe: Describe, exit_process: Callable[[int], object] = os._exit) -> None:
        self.describe = describe
        self.exit_process = exit_process
        self.signum: int | None = None
        self.reported = threading.Event()
        self._unwound = threading.Event()
        self._read_fd = self._write_fd = -1
        self._thread = threading.Thread(target=self._watch, name="titan_upipe-interrupts", daemon=True)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
            raise Interrupted(signum)

    def _next_signal(self) -> int | None:
        """The next SIGINT or SIGTERM written to the wakeup pipe, or None once the pipe is closed."""
        try:
            while data := os.read(self._read_fd, 1):
                if data[0] in SIGNALS:
                    return data[0]
            return None
        finally:
            os.close(self._read_fd)

    def _watch(self) -> None:
        signum = self._next_signal()
        if signum is None:  # the run is over
            return
        try:
            if (line := self.describe(signum)) is not None:
                write_line(line)
        finally:
            self.reported.set()
        # The backstop for a main thread blocked in a collective (it never unwinds), or for an exit
        # that waits on a thread that never ends (the main thread unwound: the exit gets as long).
        if self._unwound.wait(UNWIND_SECONDS):
            time.sleep(UNWIND_SECONDS)
        sys.stderr.flush()
        self.exit_process(128 + signum)

    def wait_reported(self, timeout_s: float = UNWIND_SECONDS) -> None:
        """Wait until the watcher printed the line (the main thread exits after it, not before)."""
        self.reported.wait(timeout_s)

    @contextlib.contextmanager
    def installed(self) -> Iterator[InterruptWatch]:
        """The handlers, the wakeup descriptor and the watcher for the ``with`` block; the previous
        ones are restored after it. Outside the main thread (where Python allows no handler) nothing."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        previous = {signum: signal.signal(signum, self._handle) for signum in SIGNALS}
        previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._thread.start()
        try:
            yield self
        finally:
            signal.set_wakeup_fd(previous_fd)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            os.close(self._write_fd)  # ends the watcher unless a signal already woke it
            self._unwound.set()
            if self.signum is None:
                self._thread.join(UNWIND_SECONDS)
