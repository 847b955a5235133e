"""The GPU suite's reports: the environment a call ran in, one stage's report (JSON and Markdown,
rewritten after every run) and each stage's Markdown table."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from titan_upipe.attention.backends import choose_backend
from titan_upipe.tools.gpu_attention import ranking
from titan_upipe.tools.gpu_wheels import IMAGE_PACKAGES, write_image


def environment(argv: list[str]) -> dict[str, str]:
    env = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
           "command": "python -m titan_upipe.gpu_suite " + " ".join(argv), "torch": torch.__version__,
           "python": platform.python_version(), "host": platform.node()}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["cuda"] = str(torch.version.cuda)
        env["cudnn"] = str(torch.backends.cudnn.version())
        # what the recipes' attention_backend = "auto" runs here (the measured order, kernel_speed.csv)
        env["attention_backend"] = choose_backend("auto", torch.bfloat16, head_dim=128).name
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = "unknown (no nvidia-smi)"
    else:
        env["device"] = f"CPU ({platform.processor() or platform.machine()})"
    return env


@dataclass
class StageReport:
    stage: str
    environment: dict[str, str]
    results: list[dict] = field(default_factory=list)
    not_run: list[dict] = field(default_factory=list)
    lengths: tuple[str, ...] | None = None
    """The ``--lengths`` of this call: part of the file name, so the calls of a stage split over
    several lengths keep their own reports."""
    select: str | None = None
    """The ``--select`` of this call (a run-name prefix), part of the file name likewise."""

    @property
    def label(self) -> str:
        selected = "" if not self.select else "-" + "_".join(self.select.split())
        return self.stage + selected + ("" if not self.lengths else "-" + "-".join(self.lengths))

    @property
    def ok(self) -> bool:
        return all(r.get("ok", True) for r in self.results)

    def paths(self, out_dir: Path) -> tuple[Path, Path]:
        return out_dir / f"{self.label}.json", out_dir / f"{self.label}.md"

    def write(self, out_dir: Path) -> tuple[Path, Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path, md_path = self.paths(out_dir)
        json_path.write_text(json.dumps({**asdict(self), "ok": self.ok}, indent=1, default=str) + "\n")
        md_path.write_text("\n".join(self.markdown()) + "\n")
        return json_path, md_path

    def markdown(self) -> list[str]:
        lines = [f"# GPU suite: {self.label}", ""]
        lines += [f"- {key}: {value}" for key, value in self.environment.items()]
        lines += ["", f"Verdict: {'all passed' if self.ok else 'FAILURES'}", ""]
        lines += TABLES[self.stage](self.results)
        if self.not_run:
            lines += ["", "Not run in this call (over the time budget; estimates, not measurements):", ""]
            lines += [f"- {r['name']} (~{r['estimate_s']:.0f} s): `{r['command']}`" for r in self.not_run]
        return lines


def _kernel_table(results: list[dict]) -> list[str]:
    lines = ["| check | case | verdict | detail |", "|---|---|---|---|"]
    for r in results:
        verdict = "skipped" if r.get("skipped") else ("ok" if r["ok"] else "FAIL")
        lines.append(f"| {r['check']} | {r.get('case', '')} | {verdict} | {r.get('detail', '')} |")
    return lines


def _attention_table(results: list[dict]) -> list[str]:
    lines = ["| backend | shape | length | kind | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | contract |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "fwd_ms" in r:
            lines.append(f"| {r['backend']} | {r['shape']} | {r['length']} | {r['kind']} | {r['fwd_ms']:.1f} | "
                         f"{r['bwd_ms']:.1f} | {r['fwd_tflops']:.1f} | {r['bwd_tflops']:.1f} | ok |")
        else:
            what = "OOM" if r.get("oom") else "-"
            lines.append(f"| {r['backend']} | {r.get('shape', '-')} | {r.get('length', '-')} | {r.get('kind', '-')} | "
                         f"{what} | {what} | - | - | {r['contract']} |")
    device = next((r.get("device") for r in results if r.get("device")), None)
    ranked = ranking(results, device or "")
    if ranked:
        lines += ["", "Ranking (geometric mean of fwd + bwd TFLOP/s over the dense cases; `auto`'s order on this GPU): "
                  + " > ".join(f"{b} ({v:.0f})" for b, v in ranked)]
    return lines


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _memory_table(results: list[dict]) -> list[str]:
    """Two comparisons per run: at the depth the run built (``max_memory_allocated`` itself beside the
    planner at that depth: no extrapolation on either side) and at the flavor's depth (the
    emulator's extrapolation beside the planner and the paper)."""
    lines = ["| model | method | length | layers | max allocated GiB | planner GiB (same layers) "
             "| max allocated GiB (full) | max reserved GiB (full) | planner GiB (full) | paper T4 GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r.get("measurement") or {}
        full = m.get("full") or {}
        if r.get("oom"):
            cells = ["OOM", "OOM", "OOM"]
        else:
            cells = [_gib(m.get("device_peak_allocated_bytes")), _gib(full.get("device_peak_allocated_bytes")),
                     _gib(full.get("device_peak_reserved_bytes"))]
        lines.append(f"| {r['model']} | {r['method']} | {r['length']} | {m.get('n_layers', '-')} | {cells[0]} | "
                     f"{_fmt(r.get('planner_gib_run_depth'))} | {cells[1]} | {cells[2]} | "
                     f"{_fmt(r.get('planner_gib'))} | {_fmt(r.get('paper_gib'))} |")
    return lines


COLD_STEP = ("a single cold step (no untimed warm-up before it): its time includes first-use kernel compilation "
             "and set-up, so no tokens/s and no ratio are computed from it (run --steps 3 --warmup-steps 1)")
"""Why a speed figure is refused (``gpu_context.add_speed_context``)."""


def step_notes(measurement: dict) -> list[str]:
    """What a reader of a step time must know: a cold step, or kernels compiled while it was timed."""
    notes = [] if measurement.get("warm") else [COLD_STEP]
    compiles = measurement.get("kernel_compiles_during_timed_steps")
    if compiles:
        notes.append(f"WARNING: {compiles} kernel(s) compiled during the timed steps: the step time includes "
                     "compilation")
    return notes


def _steps_cell(m: dict) -> str:
    """``warm-up + timed`` steps of a measurement, and its compile pass (``-`` for a cold one)."""
    timed = len(m.get("step_times_s") or ())
    cell = f"{m.get('warmup_steps', 0)} + {timed}" if m.get("warm") else "1 cold"
    return cell + (f", compile {m['compile_s']:.1f} s" if m.get("compile_s") is not None else "")


def _notes(results: list[dict]) -> list[str]:
    noted = [(r, step_notes(r["measurement"])) for r in results if r.get("measurement")]
    lines = [f"- {r['name']}: {'; '.join(notes)}" for r, notes in noted if notes]
    return ["", "Notes:", "", *lines] if lines else []


def _speed_table(results: list[dict]) -> list[str]:
    """Tokens/s and the UPipe / Ulysses ratio from warm steps only (``step_notes`` says why not)."""
    lines = ["| length | method | steps (warm-up + timed) | step s (full, modelled comm.) | tokens/s/GPU | "
             "paper T3 tokens/s/GPU | UPipe / Ulysses | paper |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r.get("measurement") or {}
        lines.append(f"| {r['length']} | {r['method']} | {_steps_cell(m) if m else '-'} | {_fmt(r.get('step_s'))} | "
                     f"{_fmt(r.get('tokens_per_s')) if 'refused' not in r else 'refused'} | "
                     f"{_fmt(r.get('paper_tokens_per_s'))} | {_fmt(r.get('ratio'), '.3f')} | "
                     f"{_fmt(r.get('paper_ratio'), '.3f')} |")
    return lines + _notes(results)


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _tsp_table(results: list[dict]) -> list[str]:
    lines = ["| length | max allocated GiB (full) | max reserved GiB (full) | steps (warm-up + timed) | "
             "step s (full, modelled comm.) | TSP collectives GB per step (received) |", "|---|---|---|---|---|---|"]
    for r in results:
        m = r.get("measurement") or {}
        full = m.get("full") or {}
        if r.get("oom"):
            lines.append(f"| {r['length']} | OOM | OOM | - | - | - |")
            continue
        step = full.get("modeled_step_time_s")
        comm = full.get("p2p_bytes")
        lines.append(f"| {r['length']} | {_gib(full.get('device_peak_allocated_bytes'))} | "
                     f"{_gib(full.get('device_peak_reserved_bytes'))} | {_steps_cell(m) if m else '-'} | {_fmt(step)} | "
                     f"{_fmt(None if comm is None else comm / 1e9, '.1f')} |")
    return lines + _notes(results)


def _ring_documents_table(results: list[dict]) -> list[str]:
    """One row per (length, R, balance): each ring rank's fwd + bwd kernel ms, busiest / mean and the
    synchronous ring's step beside the computed ratios (``gpu_ring_documents``); then per (length, R)
    the zigzag ring step over the documents one, measured and computed."""
    lines = ["| length | R | balance | backend | per-rank fwd + bwd ms | busiest / mean | computed | "
             "ring step ms | ring step / mean | computed | pairs = W |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    timed: dict[tuple, dict[str, dict]] = {}
    for r in results:
        if r.get("skipped"):
            lines.append(f"| - | - | - | skipped | {r.get('detail', '')} | | | | | | |")
            continue
        head = f"| {r['length']} | {r['ring']} | {r['balance']} | {r.get('backend', '-')} |"
        if "rank_ms" not in r:
            what = "OOM" if r.get("oom") else f"FAILED: {r.get('error', '')}"
            lines.append(f"{head} {what} | | | | | | |")
            continue
        lines.append(f"{head} {' '.join(f'{x:.1f}' for x in r['rank_ms'])} | {r['busiest_over_mean']:.2f} | "
                     f"{r['computed_busiest_over_mean']:.2f} | {r['ring_step_ms']:.1f} | "
                     f"{r['ring_step_over_mean']:.2f} | {r['computed_ring_step_over_mean']:.2f} | "
                     f"{'yes' if r.get('pairs_match') else 'NO'} |")
        timed.setdefault((r["length"], r["ring"]), {})[r["balance"]] = r
    both = [(key, by) for key, by in timed.items() if {"zigzag", "documents"} <= set(by)]
    if both:
        # computed: both layouts hold the same total work, so the ratio of their ring step / mean is
        # the ratio of their ring times, sum_t max_r W[r, t]
        lines += ["", "| length | R | ring step zigzag / documents (measured) | computed |", "|---|---|---|---|"]
        for (length, ring), by in both:
            zz, dd = by["zigzag"], by["documents"]
            lines.append(f"| {length} | {ring} | {zz['ring_step_ms'] / dd['ring_step_ms']:.2f} | "
                         f"{zz['computed_ring_step_over_mean'] / dd['computed_ring_step_over_mean']:.2f} |")
    return lines


TABLES = {"kernels": _kernel_table, "attention": _attention_table, "memory": _memory_table, "speed": _speed_table,
          "tsp": _tsp_table, "ring_documents": _ring_documents_table}


def refresh_image_packages(out: Path) -> Path:
    """The machine's own packages (``pip list --format=freeze`` without the carried wheels or this
    checkout on the path) written over ``titan_upipe/resources/gpu_image_packages.txt`` and into ``out`` (the
    folder that comes back from a device machine), so the wheel closure is checked against the
    image as it is."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    freeze = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            env=env, cwd="/", timeout=120, check=True).stdout
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.node()
    write_image(freeze, IMAGE_PACKAGES, f"{device}, {when}")
    out.mkdir(parents=True, exist_ok=True)
    copy = out / IMAGE_PACKAGES.name
    if copy.resolve() != IMAGE_PACKAGES.resolve():
        copy.write_text(IMAGE_PACKAGES.read_text())
    return copy
