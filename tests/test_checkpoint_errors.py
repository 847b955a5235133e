"""A checkpoint save that fails names its path and its cause in one line (``checkpoint_errors``).

The saves here are real ``torch.distributed.checkpoint`` saves (the call TorchTitan's
``CheckpointManager.dcp_save`` makes) through a stand-in manager; a full disk is a shard file that
is a link to ``/dev/full`` (every write: ENOSPC)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch

from titan_upipe.torchtitan_0_2.checkpoint_errors import CheckpointSaveError, SaveErrorReporter, save_failure


class DCPManager:
    """The part of TorchTitan's CheckpointManager the reporter sees: ``folder`` and ``save``."""

    def __init__(self, folder: Path, error: BaseException | None = None) -> None:
        self.folder = str(folder)
        self.error = error
        self.loaded = False

    def save(self, curr_step: int, last_step: bool = False) -> None:
        import torch.distributed.checkpoint as dcp

        if self.error is not None:
            raise self.error
        dcp.save({"w": torch.zeros(1000), "train_state": {"step": curr_step}},
                 checkpoint_id=os.path.join(self.folder, f"step-{curr_step}"), no_dist=True)

    def load(self, step: int = -1) -> bool:
        self.loaded = True
        return True


def reporter(folder: Path, error: BaseException | None = None) -> SaveErrorReporter:
    return SaveErrorReporter(DCPManager(folder, error), [torch.nn.Linear(10, 10)])  # 110 parameters: 1320 bytes


def failure(save: SaveErrorReporter, step: int = 1) -> str:
    with pytest.raises(CheckpointSaveError) as err:
        save.save(step)
    message = str(err.value)
    assert "\n" not in message, message
    return message


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_names_the_path_and_no_space(tmp_path):
    step = tmp_path / "checkpoint" / "step-1"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").symlink_to("/dev/full")
    message = failure(reporter(tmp_path / "checkpoint"))
    assert message.startswith(f"saving the checkpoint failed: no space left on device at {step} (")
    assert "a checkpoint takes about 1.3 kB" in message and "set job.dump_folder on a larger disk" in message


def test_torchs_zip_writer_error_is_no_space_when_the_disk_is_fuller_than_a_checkpoint(tmp_path, monkeypatch):
    """``enforce fail at inline_container.cc:672 unexpected pos`` says nothing of space: the free
    space measured after the failure does."""
    zip_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    assert "no space left on device at" in failure(reporter(tmp_path, zip_error))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=10**9))
    message = failure(reporter(tmp_path, zip_error))
    assert message.startswith(f"saving the checkpoint to {tmp_path}/step-1 failed (RuntimeError: [enforce fail at "
                              "inline_container.cc:672] . unexpected pos 704 vs 598): check that disk")


def test_permission_and_other_io_errors_name_the_path(tmp_path):
    denied = OSError(errno.EACCES, "Permission denied", str(tmp_path / "step-1"))
    assert failure(reporter(tmp_path, denied)).startswith(
        f"saving the checkpoint failed: permission denied at {tmp_path}/step-1 (Permission denied): make it writable")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    message = failure(reporter(blocker))  # DCP's CheckpointException around a NotADirectoryError
    assert message.startswith(f"saving the checkpoint to {blocker}/step-1 failed (NotADirectoryError: [Errno 20] "
                              "Not a directory")


def test_a_failure_that_is_no_io_error_is_raised_as_it_is_with_the_path(tmp_path):
    bug = ValueError("a bug")
    with pytest.raises(ValueError) as err:
        reporter(tmp_path, bug).save(3)
    assert err.value is bug and err.value.__notes__ == [f"while saving the checkpoint to {tmp_path}/step-3"]
    assert save_failure(KeyError("x"), str(tmp_path), 10) is None


def test_a_good_save_and_everything_else_pass_through(tmp_path):
    save = reporter(tmp_path)
    save.save(2)
    assert (tmp_path / "step-2" / ".metadata").is_file()
    assert save.folder == str(tmp_path) and save.load(2) and save.loaded
