"""Measured attention-kernel speed (``titan_upipe/resources/kernel_speed.csv``) and the ``auto`` order it gives.

The GPU suite's ``attention`` stage times every usable backend's forward and backward at one rank's
shapes of the recipes (``titan_upipe.tools.gpu_attention``) and writes one row per (device, backend,
shape, length, kind). ``auto`` then tries the backends in the order measured on the GPU the job
runs on:

    score(backend) = geometric mean over its dense rows of (fwd + bwd TFLOP/s)
    order          = backends with a passing contract by descending score,
                     then the unmeasured ones in ``default`` order

A backend whose contract check failed on that device is left out of the order (never chosen by
``auto`` there). Where the device has no rows (a CPU, another GPU, or before any measurement)
the order is ``default`` (``backends.AUTO_ORDER``, documented there).

Columns: ``device`` (``torch.cuda.get_device_name()``), ``date``, ``torch``, ``backend``, ``shape``
(``llama3_8b`` / ``qwen3_32b``: one rank's heads), ``q_heads``, ``kv_heads``, ``head_dim``,
``length`` (``128K``...), ``tokens``, ``kind`` (``dense`` causal, or ``varlen`` packed documents),
``contract`` (``ok`` or why not), ``fwd_ms``, ``bwd_ms``, ``fwd_tflops``, ``bwd_tflops``.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from titan_upipe.resources import resource

KERNEL_SPEED_CSV = resource("kernel_speed.csv")
COLUMNS = ("device", "date", "torch", "backend", "shape", "q_heads", "kv_heads", "head_dim", "length", "tokens",
           "kind", "contract", "fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops")


def read_rows(path: Path = KERNEL_SPEED_CSV) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _key(row: dict) -> tuple:
    return tuple(str(row.get(c, "")) for c in ("device", "backend", "shape", "length", "kind"))


def merge_rows(old: list[dict], new: list[dict], device: str, passed: set[str] = frozenset()) -> list[dict]:
    """``old`` with ``new`` (one stage's rows on ``device``) in: a backend whose contract failed now
    keeps only its failure row; one that passed now (``passed``, or a timed row) loses an earlier
    failure row; a measured case replaces the same case's row; everything else stays (other
    lengths, backends, devices)."""
    checked = {r["backend"] for r in new} | set(passed)
    failed_now = {r["backend"] for r in new if r["contract"] != "ok"}
    new_keys = {_key(r) for r in new}

    def keep(row: dict) -> bool:
        if row["device"] != device or row["backend"] not in checked:
            return True
        if row["backend"] in failed_now or row["contract"] != "ok":
            return False
        return _key(row) not in new_keys

    return [r for r in old if keep(r)] + [{c: str(r.get(c, "")) for c in COLUMNS} for r in new]


def write_rows(rows: list[dict], device: str, path: Path = KERNEL_SPEED_CSV, passed: set[str] = frozenset()) -> None:
    """Merge one stage's ``rows`` on ``device`` into the file (``merge_rows``)."""
    merged = merge_rows(read_rows(path), rows, device, passed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(merged)


def scores(rows: list[dict[str, str]], device: str) -> dict[str, float]:
    """Per backend measured on ``device`` with a passing contract: the geometric mean of its dense
    rows' fwd + bwd TFLOP/s (a rate, so lengths and shapes weigh alike)."""
    logs: dict[str, list[float]] = {}
    for r in rows:
        if r["device"] != device or r["kind"] != "dense" or r["contract"] != "ok" or not r["fwd_tflops"]:
            continue
        logs.setdefault(r["backend"], []).append(math.log(float(r["fwd_tflops"]) + float(r["bwd_tflops"])))
    return {b: math.exp(sum(v) / len(v)) for b, v in logs.items()}


def failed_contract(rows: list[dict[str, str]], device: str) -> dict[str, str]:
    """Backends whose contract check failed on ``device``, and how."""
    return {r["backend"]: r["contract"] for r in rows
            if r["device"] == device and r["contract"] not in ("ok", "") and not r["contract"].startswith("skipped")}


def measured_order(device: str | None, default: tuple[str, ...],
                   rows: list[dict[str, str]] | None = None) -> tuple[str, ...]:
    """``auto``'s candidates for ``device`` (module docstring): measured fastest first, failed
    contracts dropped, the rest of ``default`` after, in its order."""
    if device is None:
        return default
    rows = read_rows() if rows is None else rows
    measured = scores(rows, device)
    failed = failed_contract(rows, device)
    ranked = sorted((b for b in measured if b in default and b not in failed), key=lambda b: -measured[b])
    return tuple(ranked) + tuple(b for b in default if b not in measured and b not in failed)


def latest_device(rows: list[dict[str, str]] | None = None) -> str | None:
    """The device of the most recent rows (what a CPU machine plans GPU runs with)."""
    rows = read_rows() if rows is None else rows
    dated = [r for r in rows if r["date"]]
    return max(dated, key=lambda r: r["date"])["device"] if dated else None


def dense_seconds(rows: list[dict[str, str]], device: str, backend: str, shape: str,
                  length_tokens: int) -> float | None:
    """fwd + bwd seconds of ``backend`` on ``device`` at ``shape`` and ``length_tokens``: the measured
    row of that length, else the longest shorter one scaled quadratically (causal attention)."""
    known = [r for r in rows if r["device"] == device and r["backend"] == backend and r["shape"] == shape
             and r["kind"] == "dense" and r["contract"] == "ok" and r["fwd_ms"]]
    shorter = [r for r in known if int(r["tokens"]) <= length_tokens]
    if not shorter:
        return None
    row = max(shorter, key=lambda r: int(r["tokens"]))
    return (float(row["fwd_ms"]) + float(row["bwd_ms"])) / 1e3 * (length_tokens / int(row["tokens"])) ** 2
