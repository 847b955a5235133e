"""A checkpoint save that fails names its path and its cause, in one line.

TorchTitan's ``CheckpointManager.save`` raises what ``torch.distributed.checkpoint`` raises: on a
full disk torch's zip writer's ``enforce fail at inline_container.cc:672 unexpected pos 704 vs
598``, an ``OSError`` (``[Errno 28] No space left on device``), or a ``CheckpointException``
wrapping either for each rank, and none names the cause. :class:`SaveErrorReporter` wraps the
trainer's manager and turns such a failure into a :class:`CheckpointSaveError` (a ConfigError,
which the launcher prints as one line without a traceback): no space left (the error code, or the
writer's error with less free space than a checkpoint takes, measured after the failure),
permission denied, or another I/O error, each with the path. A failure that is not I/O is
re-raised as it is, with the path added as a note.
"""

from __future__ import annotations

import errno
import os
import shutil

from torch.distributed.checkpoint.api import CheckpointException

from titan_upipe.errors import ConfigError
from titan_upipe.plan.machine import CHECKPOINT_BYTES_PER_PARAMETER
from titan_upipe.torchtitan_0_2.job_assets.output import byte_size, existing_ancestor

NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
NO_PERMISSION = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
WRITER_FAILURES = ("inline_container", "PytorchStreamWriter", "unexpected pos")
"""What torch's checkpoint file writer says when a write comes up short."""


class CheckpointSaveError(ConfigError):
    """A checkpoint could not be written: the message names the path, the cause and the fix."""


def causes(err: BaseException) -> list[BaseException]:
    """``err``, the exceptions DCP collected from each rank, and their causes and contexts."""
    found: list[BaseException] = []
    pending: list[BaseException | None] = [err]
    while pending:
        current = pending.pop(0)
        if current is None or any(current is seen for seen in found):
            continue
        found.append(current)
        if isinstance(current, CheckpointException):
            pending += [failure[0] if isinstance(failure, tuple) else failure for failure in current.failures.values()]
        pending += [current.__cause__, current.__context__]
    return found


def free_bytes(path: str) -> int | None:
    """Free bytes on the disk of ``path`` (or of its nearest existing ancestor)."""
    try:
        return shutil.disk_usage(existing_ancestor(path)).free
    except OSError:
        return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[-1] if text else ''}".rstrip(": ")


def save_failure(err: BaseException, path: str, checkpoint_bytes: int) -> CheckpointSaveError | None:
    """The one-line error for a save of about ``checkpoint_bytes`` to ``path`` that raised ``err``,
    or None when ``err`` is no I/O failure."""
    found = causes(err)
    oserrors = [e for e in found if isinstance(e, OSError)]
    codes = {e.errno for e in oserrors}
    writer = [e for e in found if any(marker in str(e) for marker in WRITER_FAILURES)
              and not isinstance(e, CheckpointException)]
    free = free_bytes(path)
    if codes & NO_SPACE or ((writer or oserrors) and free is not None and free < checkpoint_bytes):
        space = "" if free is None else f" ({byte_size(free)} free; a checkpoint takes about {byte_size(checkpoint_bytes)})"
        return CheckpointSaveError(
            f"saving the checkpoint failed: no space left on device at {path}{space}: free space there or set "
            "job.dump_folder on a larger disk, then relaunch (the job resumes from its last complete checkpoint)")
    if codes & NO_PERMISSION:
        denied = next(e for e in oserrors if e.errno in NO_PERMISSION)
        return CheckpointSaveError(
            f"saving the checkpoint failed: permission denied at {denied.filename or path} ({denied.strerror}): make "
            "it writable or set job.dump_folder to a folder this job may write, then relaunch")
    if oserrors or writer:
        return CheckpointSaveError(
            f"saving the checkpoint to {path} failed ({_first_line((oserrors or writer)[0])}): check that disk, then "
            "relaunch (the job resumes from its last complete checkpoint)")
    return None


class SaveErrorReporter:
    """The trainer's ``CheckpointManager`` whose ``save`` names its failures (``save_failure``);
    every other attribute is the manager's."""

    def __init__(self, manager, model_parts) -> None:
        self._manager = manager
        self._model_parts = model_parts

    def __getattr__(self, name: str):
        return getattr(self._manager, name)

    def checkpoint_bytes(self) -> int:
        """A full checkpoint of the model's parameters (global sizes: DTensors count whole)."""
        return CHECKPOINT_BYTES_PER_PARAMETER * sum(p.numel() for part in self._model_parts
                                                    for p in part.parameters())

    def save(self, curr_step: int, last_step: bool = False) -> None:
        try:
            self._manager.save(curr_step, last_step=last_step)
        except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
            path = os.path.join(self._manager.folder, f"step-{curr_step}")
            failure = save_failure(err, path, self.checkpoint_bytes())
            if failure is None:
                err.add_note(f"while saving the checkpoint to {path}")
                raise
            raise failure from err
