"""Measured attention-kernel speed (``titan_upipe/resources/kernel_speed.csv``): ``auto``'s order and
the rates a plan divides FLOPs by, per GPU architecture.

The GPU suite's ``attention`` stage times every usable backend's forward and backward at one rank's
shapes of the recipes (``titan_upipe.tools.gpu_attention``) and writes one row per (device, backend,
shape, length, kind). A row applies to every GPU of its architecture (``arch``: the compute
capability as ``smXY``, 9.0 -> ``sm90`` for the H100 SXM, H100 PCIe and H200 alike; 8.0 -> ``sm80``,
A100): kernels compile per architecture, and GPUs of one architecture rank them alike.

Which rows a job is judged by: the architecture's dense rows with a passing contract, of the job's
``head_dim`` and ``dtype`` where the architecture has any such row, else all of its dense rows
(the best evidence there is; a backend's rank rarely changes with the head size). Over those rows

    score(b)  = geometric mean of (fwd + bwd TFLOP/s) over b's rows   (a rate: lengths weigh alike)
    fwd(b)    = geometric mean of fwd TFLOP/s,  bwd(b) likewise       (``attention_rate``)

``auto``'s order on an architecture (``measured_order``) merges the scores with that architecture's
default order (``default_order``):

* a backend whose contract failed on the architecture is left out (never chosen there);
* the measured backends come in descending score;
* an unmeasured backend goes where it contradicts the fewest of the default order's claims about
  it and the measured ones (the default says which of them it is faster than), the lowest such
  place on a tie (an unmeasured kernel is not promised more than the default claims); several in
  one place keep the default's order. Where the measurements agree with the default, every
  unmeasured backend keeps its default place: on an H200 with FA4, cuDNN and SDPA measured, FA3
  comes between FA4 and cuDNN, FA2 between cuDNN and SDPA, never behind every measured kernel.

Default orders (the fastest first, for backends no GPU of that architecture has measured):

=============== =============================================================================
architecture    default order
=============== =============================================================================
sm90 and newer  ``HOPPER_ORDER``: flash_attn4 > flash_attn3 > cudnn > flash_attn > sdpa. FA4 and FA3
                are Hopper kernels; cuDNN's fused attention measured 564 fwd / 539 bwd TFLOP/s on an
                H200 against SDPA's flash kernel's 332 / 315 (2026-11-27, head_dim 128, bf16);
                flash_attn (FA2) is the kernel SDPA's flash path derives from
older, unknown ``DEFAULT_ORDER`` (``backends.AUTO_ORDER``): flash_attn4 > flash_attn3 > flash_attn > sdpa
                > cudnn. Nothing was measured before Hopper: cuDNN stays behind torch's own kernel
                until a GPU of that architecture ranks it (FA4/FA3 do not run there and are passed
                over)
=============== =============================================================================

A machine without a GPU that plans a GPU job takes the architecture of the newest rows
(``latest_arch``).

The rate of a backend (``attention_rate``, what a planner divides a layer's FLOPs by): its own
fwd/bwd geometric means where measured; an unmeasured one gets the rates of the nearest measured
backend after it in the merged order (ranked above that one, it is taken as at least as fast), else
(nothing measured ranks below it) ``ASSUMED_TFLOPS``; on an architecture with no rows, ``ASSUMED_TFLOPS``.

FLOPs of causal attention over a sequence of ``L`` tokens, ``H`` query heads of dim ``D`` (the half of
``QK^T`` and ``PV`` a causal mask keeps, two flops per multiply-add), summed over the documents of a
varlen call:

    fwd = 2 * H * D * L^2          bwd = 2.5 * fwd   (five matmuls against two)

Columns: ``device`` (``torch.cuda.get_device_name()``), ``arch``, ``date``, ``torch``, ``backend``,
``shape`` (``llama3_8b`` / ``qwen3_32b``: one rank's heads), ``q_heads``, ``kv_heads``, ``head_dim``,
``dtype`` (``bf16``...), ``length`` (``128K``...), ``tokens``, ``kind`` (``dense`` causal, or ``varlen``
packed documents), ``contract`` (``ok`` or why not), ``fwd_ms``, ``bwd_ms``, ``fwd_tflops``, ``bwd_tflops``.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from pathlib import Path

from titan_upipe.resources import resource

KERNEL_SPEED_CSV = resource("kernel_speed.csv")
COLUMNS = ("device", "arch", "date", "torch", "backend", "shape", "q_heads", "kv_heads", "head_dim", "dtype",
           "length", "tokens", "kind", "contract", "fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops")

DEFAULT_ORDER = ("flash_attn4", "flash_attn3", "flash_attn", "sdpa", "cudnn")
"""``auto``'s candidates, in their order where the architecture is older than Hopper or unknown."""
HOPPER_ORDER = ("flash_attn4", "flash_attn3", "cudnn", "flash_attn", "sdpa")
"""The default order on sm90 and newer (module docstring)."""
HOPPER = "sm90"

ASSUMED_TFLOPS = 150.0
"""fwd and bwd rate where nothing measures a backend: an assumption, deliberately low (below what
FA2-class kernels reach on an H100), so that unmeasured work is not planned into a call it does not fit."""

DTypeLike = object
"""A ``torch.dtype`` or its name (``"bfloat16"``, ``"bf16"``): read by its name, so this module needs no torch."""

DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
"""Training dtypes by ``torch``'s name, as the table writes them (this module imports no torch)."""

# GPUs by the model word of their name, for rows written before the ``arch`` column and for device
# names alone; a GPU in use is asked for its compute capability instead (``attention.backends.current_arch``)
DEVICE_ARCHS = {"A100": "sm80", "A800": "sm80", "A30": "sm80", "A10": "sm86", "A40": "sm86", "L4": "sm89",
                "L40": "sm89", "L40S": "sm89", "H100": "sm90", "H800": "sm90", "H200": "sm90", "H20": "sm90",
                "GH200": "sm90", "B200": "sm100", "GB200": "sm100", "B300": "sm103", "GB300": "sm103"}


# --- architectures ------------------------------------------------------------------------------


def arch_of_capability(capability: tuple[int, int]) -> str:
    """(9, 0) -> ``"sm90"``, (10, 0) -> ``"sm100"``."""
    return f"sm{capability[0]}{capability[1]}"


def capability_of_arch(arch: str) -> tuple[int, int]:
    """``"sm90"`` -> (9, 0): the last digit is the minor version."""
    if not re.fullmatch(r"sm\d{2,3}", arch):
        raise ValueError(f"{arch!r} is not a GPU architecture: smXY, the compute capability X.Y (sm90 for 9.0)")
    return int(arch[2:-1]), int(arch[-1])


def arch_of_device(name: str) -> str | None:
    """The architecture of a GPU by its name's model word (``"NVIDIA H100 80GB HBM3"`` -> ``"sm90"``);
    None where the name is not known."""
    for word in re.split(r"[^A-Za-z0-9]+", name):
        if word.upper() in DEVICE_ARCHS:
            return DEVICE_ARCHS[word.upper()]
    return None


def dtype_name(dtype: DTypeLike | None) -> str | None:
    """``torch.bfloat16`` (or ``"bfloat16"``, ``"bf16"``) -> ``"bf16"``, as the table writes it; ValueError
    for a name that is neither (it would match no row and leave the job judged by every row)."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name in DTYPE_NAMES.values():
        return name
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype!r}: the kernel table measures {', '.join(sorted(set(DTYPE_NAMES.values())))} "
                         f"({', '.join(DTYPE_NAMES)})")
    return DTYPE_NAMES[name]


def default_order(arch: str | None, candidates: tuple[str, ...] = DEFAULT_ORDER) -> tuple[str, ...]:
    """``candidates`` in the default order of ``arch`` (module docstring): on sm90 and newer,
    ``HOPPER_ORDER``'s ranking of them (candidates it does not rank after, in their order); else
    ``candidates`` as given."""
    if not arch or capability_of_arch(arch) < capability_of_arch(HOPPER):
        return candidates
    return tuple(b for b in HOPPER_ORDER if b in candidates) + tuple(b for b in candidates if b not in HOPPER_ORDER)


# --- the table ----------------------------------------------------------------------------------


def read_rows(path: Path = KERNEL_SPEED_CSV) -> list[dict[str, str]]:
    """The table's rows; a row written before the ``arch``/``dtype`` columns gets its device's
    architecture and ``bf16`` (the only dtype the stage timed then)."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["arch"] = r.get("arch") or arch_of_device(r.get("device", "")) or ""
        r["dtype"] = r.get("dtype") or "bf16"
    return rows


def _key(row: dict) -> tuple:
    return tuple(str(row.get(c, "")) for c in ("device", "backend", "shape", "dtype", "length", "kind"))


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


def job_rows(rows: list[dict[str, str]], arch: str, head_dim: int | None = None,
             dtype: DTypeLike | None = None) -> list[dict[str, str]]:
    """The timed dense rows of ``arch`` with a passing contract that a job of ``head_dim`` and
    ``dtype`` is judged by: those of its head_dim and dtype where ``arch`` has any, else all."""
    timed = [r for r in rows if r["arch"] == arch and r["kind"] == "dense" and r["contract"] == "ok"
             and r["fwd_tflops"]]
    wanted = dtype_name(dtype)
    own = [r for r in timed if (head_dim is None or r["head_dim"] == str(head_dim))
           and (wanted is None or r["dtype"] == wanted)]
    return own or timed


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def scores(rows: list[dict[str, str]], arch: str, head_dim: int | None = None,
           dtype: DTypeLike | None = None) -> dict[str, float]:
    """Per backend measured on ``arch`` with a passing contract: the geometric mean of its rows'
    fwd + bwd TFLOP/s (``job_rows``: the job's head_dim and dtype where measured)."""
    by_backend: dict[str, list[float]] = {}
    for r in job_rows(rows, arch, head_dim, dtype):
        by_backend.setdefault(r["backend"], []).append(float(r["fwd_tflops"]) + float(r["bwd_tflops"]))
    return {b: _geomean(v) for b, v in by_backend.items()}


def failed_contract(rows: list[dict[str, str]], arch: str) -> dict[str, str]:
    """Backends whose contract check failed on a GPU of ``arch``, and how."""
    return {r["backend"]: r["contract"] for r in rows
            if r["arch"] == arch and r["contract"] not in ("ok", "") and not r["contract"].startswith("skipped")}


def merge_order(default: tuple[str, ...], measured: dict[str, float]) -> tuple[str, ...]:
    """``default``'s backends: the measured ones ranked by score, each unmeasured one where it
    contradicts the fewest of ``default``'s claims against the measured ones (the lowest such place
    on a tie); module docstring."""
    ranked = sorted((b for b in default if b in measured), key=lambda b: -measured[b])
    places: list[list[str]] = [[] for _ in range(len(ranked) + 1)]  # places[p]: just above ranked[p]
    for backend in (b for b in default if b not in measured):
        faster_by_default = {m for m in ranked if default.index(m) < default.index(backend)}
        # at place p, ranked[:p] are above the backend and ranked[p:] below it
        contradictions = [sum(m not in faster_by_default for m in ranked[:p])
                          + sum(m in faster_by_default for m in ranked[p:]) for p in range(len(ranked) + 1)]
        places[min(range(len(ranked) + 1), key=lambda p: (contradictions[p], -p))].append(backend)
    return tuple(b for p, above in enumerate(places) for b in (*above, *ranked[p:p + 1]))


def measured_order(arch: str | None, candidates: tuple[str, ...] = DEFAULT_ORDER,
                   rows: list[dict[str, str]] | None = None, head_dim: int | None = None,
                   dtype: DTypeLike | None = None) -> tuple[str, ...]:
    """``auto``'s order of ``candidates`` on ``arch`` for a job of ``head_dim`` and ``dtype``
    (module docstring): the measured ranking merged into the architecture's default order, failed
    contracts dropped. ``arch`` None (no GPU known): ``candidates`` as given."""
    if arch is None:
        return candidates
    rows = read_rows() if rows is None else rows
    failed = failed_contract(rows, arch)
    default = tuple(b for b in default_order(arch, candidates) if b not in failed)
    return merge_order(default, scores(rows, arch, head_dim, dtype))


def latest_arch(rows: list[dict[str, str]] | None = None) -> str | None:
    """The architecture of the most recent rows (what a machine without a GPU plans GPU runs with)."""
    rows = read_rows() if rows is None else rows
    dated = [r for r in rows if r["date"] and r["arch"]]
    return max(dated, key=lambda r: r["date"])["arch"] if dated else None


# --- rates for a plan ---------------------------------------------------------------------------


def causal_flops(lengths: list[int], q_heads: int, head_dim: int) -> tuple[float, float]:
    """(fwd, bwd) FLOPs of causal attention over documents of ``lengths`` (module docstring)."""
    fwd = 2.0 * q_heads * head_dim * sum(n * n for n in lengths)
    return fwd, 2.5 * fwd


@dataclass(frozen=True)
class KernelRate:
    """Forward and backward TFLOP/s of one backend on one architecture, and where they come from."""

    backend: str
    arch: str | None
    fwd_tflops: float
    bwd_tflops: float
    basis: str
    """``measured`` (its own rows), ``ranked below <b>`` (an unmeasured backend at the rates of the
    measured one after it in the order) or ``assumed`` (``ASSUMED_TFLOPS``)."""

    def seconds(self, fwd_flops: float, bwd_flops: float, forwards: int = 1) -> float:
        """Seconds of ``forwards`` forward passes of ``fwd_flops`` and one backward of ``bwd_flops``
        (``forwards = 2`` under full activation checkpointing: the forward runs again in backward)."""
        return forwards * fwd_flops / (self.fwd_tflops * 1e12) + bwd_flops / (self.bwd_tflops * 1e12)


def attention_rate(backend: str, arch: str | None = None, head_dim: int = 128, dtype: DTypeLike | None = "bf16",
                   rows: list[dict[str, str]] | None = None,
                   candidates: tuple[str, ...] = DEFAULT_ORDER) -> KernelRate:
    """The fwd and bwd TFLOP/s of ``backend`` on ``arch`` (None: the newest measured architecture)
    for heads of ``head_dim`` in ``dtype``: measured, else from its place in ``auto``'s order of
    ``candidates``, else assumed (module docstring). Pure: reads the shipped table unless given
    ``rows``. A layer's time is ``rate.seconds(*causal_flops([L], H, D))``."""
    rows = read_rows() if rows is None else rows
    arch = latest_arch(rows) if arch is None else arch
    assumed = KernelRate(backend, arch, ASSUMED_TFLOPS, ASSUMED_TFLOPS, "assumed")
    if arch is None:
        return assumed
    by_backend: dict[str, list[dict[str, str]]] = {}
    for r in job_rows(rows, arch, head_dim, dtype):
        by_backend.setdefault(r["backend"], []).append(r)
    if backend in by_backend:
        own = by_backend[backend]
        return KernelRate(backend, arch, _geomean([float(r["fwd_tflops"]) for r in own]),
                          _geomean([float(r["bwd_tflops"]) for r in own]), "measured")
    order = measured_order(arch, tuple(dict.fromkeys((*candidates, backend))), rows, head_dim, dtype)
    below = [b for b in order[order.index(backend) + 1:] if b in by_backend] if backend in order else []
    if not below:
        return assumed
    rate = attention_rate(below[0], arch, head_dim, dtype, rows)
    return KernelRate(backend, arch, rate.fwd_tflops, rate.bwd_tflops, f"ranked below {below[0]}")


def dense_seconds(rows: list[dict[str, str]], arch: str, backend: str, shape: str,
                  length_tokens: int) -> float | None:
    """fwd + bwd seconds of ``backend`` on ``arch`` at ``shape`` and ``length_tokens``: the measured
    row of that length, else the longest shorter one scaled quadratically (causal attention); the
    newest such row where several GPUs of the architecture measured it."""
    known = [r for r in rows if r["arch"] == arch and r["backend"] == backend and r["shape"] == shape
             and r["kind"] == "dense" and r["contract"] == "ok" and r["fwd_ms"]]
    shorter = [r for r in known if int(r["tokens"]) <= length_tokens]
    if not shorter:
        return None
    row = max(shorter, key=lambda r: (int(r["tokens"]), r["date"]))
    return (float(row["fwd_ms"]) + float(row["bwd_ms"])) / 1e3 * (length_tokens / int(row["tokens"])) ** 2
