"""The ``step-N`` checkpoint folders TorchTitan writes (the same naming on 0.2.2 and 0.3): which exist,
which are complete (a ``.metadata`` written; a save cut short has none)."""

from __future__ import annotations

import glob
import os
import re


def step_folders(folder: str) -> dict[int, str]:
    """``step-N`` folders in ``folder`` by N (TorchTitan's naming)."""
    found = {}
    for path in glob.glob(os.path.join(folder, "step-*")):
        match = re.fullmatch(r"step-(\d+)", os.path.basename(path))
        if match and os.path.isdir(path):
            found[int(match.group(1))] = path
    return found


def saved_steps(folder: str) -> list[int]:
    """The ``step-N`` DCP checkpoints in ``folder`` (a ``.metadata`` written), oldest first."""
    return sorted(step for step, path in step_folders(folder).items() if os.path.isfile(os.path.join(path, ".metadata")))
