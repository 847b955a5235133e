"""The console both adapters write to.

* One copy of each log line under torchrun: rank 0 alone logs INFO and WARNING lines
  (``metrics.log_all_ranks`` restores every rank's). TorchTitan (0.2.2 and 0.3 alike) logs the model
  arguments, its start-up warnings and every step line from each rank: N copies of the same lines. The
  other ranks keep their errors, which may be theirs alone.
* Colours only on a terminal: TorchTitan colours its step lines whatever the stream, which leaves escape
  codes in a redirected log (a SLURM output file).
"""

from __future__ import annotations

import logging
from typing import TextIO

from torchtitan.tools.utils import Color, NoColor

from titan_upipe.errors import is_rank_zero


def log_on_rank_zero_only(every_rank: bool = False) -> None:
    """Set the root logger of a rank other than 0 to ERROR (INFO with ``every_rank``); rank 0 keeps its level."""
    if is_rank_zero():
        return
    logging.getLogger().setLevel(logging.INFO if every_rank else logging.ERROR)


def colours_off(disabled: bool, stream: TextIO) -> bool:
    """No colour codes on ``stream``: ``metrics.disable_color_printing``, or the stream is not a terminal
    (escape codes would land in the file)."""
    isatty = getattr(stream, "isatty", None)
    return disabled or isatty is None or not isatty()


def console_colors(disabled: bool, stream: TextIO) -> Color | NoColor:
    """TorchTitan's colour codes for ``stream`` (none where :func:`colours_off`)."""
    return NoColor() if colours_off(disabled, stream) else Color()
