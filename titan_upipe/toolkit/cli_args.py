"""What the command-line tools share: an argument parser whose errors are one line, the one
parser of sequence lengths, and the argparse types of counts, sizes and token lengths (``validate``, ``plan``, ``check``,
``emulate``, ``gpu_suite``).

A bad argument is refused where argparse reads it, as ``<tool>: error: argument --flag: <why>``
with exit status 2, printed once (rank 0 under torchrun: ``titan_upipe.errors.exit_once``),
instead of a usage block on every rank or, later, a ``ValueError`` traceback or a nonsense answer
(``fits in -1 GiB``).
"""

from __future__ import annotations

import argparse
import math

from titan_upipe.errors import exit_once
from titan_upipe.spec.units import LENGTH_FORMAT, K, parse_length

__all__ = ["LENGTH_FORMAT", "K", "ToolParser", "non_negative_int", "non_negative_size", "parse_length", "positive_int",
           "positive_size", "token_count"]



class ToolParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose ``error`` is :func:`~titan_upipe.errors.exit_once`: one
    line ``<tool>: error: <message>`` (no usage block), once, exit status 2. The tool is the
    module ``prog`` runs (``python -m titan_upipe.validate`` -> ``titan_upipe.validate``)."""

    @property
    def tool(self) -> str:
        return self.prog.split()[-1]

    def error(self, message: str):  # argparse's hook for every refusal, the types' included
        raise exit_once(self.tool, message)


def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: valid values are {least} or more") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} is invalid: valid values are {least} or more")
    return value


def positive_int(text: str) -> int:
    """A count of 1 or more (ranks, layers, steps, sequences)."""
    return _whole_number(text, 1)


def non_negative_int(text: str) -> int:
    """A count of 0 or more (0 meaning a default or none, as the flag's help says)."""
    return _whole_number(text, 0)


def _number(text: str, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        valid = "a number above 0" if positive else "a number of 0 or more"
        raise argparse.ArgumentTypeError(f"{text} is invalid: valid values are {valid} (e.g. 80)")
    return value


def positive_size(text: str) -> float:
    """A size or rate above 0 (GiB of memory, GB/s, seconds)."""
    return _number(text, positive=True)


def non_negative_size(text: str) -> float:
    """A size of 0 or more (a reserve that may be none)."""
    return _number(text, positive=False)


def token_count(text: str) -> int:
    """A sequence length in tokens: ``4096``, ``128K``, ``1M``, ``2.5M`` (:func:`parse_length`)."""
    try:
        return parse_length(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
