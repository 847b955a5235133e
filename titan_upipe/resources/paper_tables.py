"""The UPipe paper's measured tables, as data inside the repository (tools layer, stdlib only).

``titan_upipe/resources/paper_tables.csv`` (its source and units: ``titan_upipe/resources/README.md``) holds one row
per (table, model, GPUs, method, metric) with one column per context length (128K ... 5M);
an empty cell was not measured, ``OOM`` ran out of memory. The planner's plot, the emulator's
summary and the GPU suite's reports read it through here.
"""

from __future__ import annotations

import csv
import functools
from pathlib import Path

from titan_upipe.resources import resource

PAPER_TABLES_CSV = resource("paper_tables.csv")
LENGTH_COLUMNS = ("128K", "256K", "512K", "1M", "2M", "3M", "4M", "5M")
OOM = "OOM"
"""A cell whose run went out of memory."""


@functools.cache
def paper_rows(path: Path = PAPER_TABLES_CSV) -> tuple[dict[str, str], ...]:
    """Every row of the CSV as a dict keyed by its header."""
    with open(path, newline="") as f:
        return tuple(csv.DictReader(f))


def cell_value(cell: str) -> float | None:
    """A non-empty cell's number, None for ``OOM``; ValueError for anything else."""
    return None if cell == OOM else float(cell)


def paper_value(table: str, model: str, method: str, metric: str, length: str,
                path: Path = PAPER_TABLES_CSV) -> float | None:
    """One cell (None where empty, OOM or not a number)."""
    for row in paper_rows(path):
        if (row["table"], row["model"], row["method"], row["metric"]) == (table, model, method, metric):
            try:
                return cell_value(row.get(length) or "")
            except ValueError:
                return None
    return None
