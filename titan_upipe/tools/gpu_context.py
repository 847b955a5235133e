"""The columns beside a GPU suite measurement: the planner's prediction for what the run measured
(at the flavor's depth and at the depth it built), the paper's Table 3-5 figures, and a committed
memory report's planner columns recomputed by this checkout (``--replan``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from titan_upipe.plan import plan
from titan_upipe.resources.paper_tables import paper_value
from titan_upipe.tools.gpu_reports import COLD_STEP, StageReport
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_0_2.job_plan import plan_input_from_job_config

REPO = Path.cwd()
"""The checkout the suite runs in (its recipes under ``configs/``, its reports under
``docs/benchmarks/gpu/``): the current directory, so that an installed package runs it too."""


def add_memory_context(result: dict) -> None:
    """The planner at the flavor's depth and at the depth the run built (``--n-layers``): the
    latter is the like-for-like figure, since the emulator's extrapolation carries the held
    reduce-scatter input of the last block's group (the output projection, 2.2x a block's in
    Llama3-8B) from a short model's peak block into the full depth (docs/planner.md)."""
    argv = result["argv"]
    config = argv[argv.index("--job.config_file") + 1]
    overrides = config_overrides(argv)
    cp_world = int(argv[argv.index("--cp-world") + 1])
    job = plan_input_from_job_config(parse_config(["--job.config_file", str(REPO / config), *overrides]),
                                     world_size=cp_world, device="cuda")
    result["planner_gib"] = plan(job).peak_gpu_bytes / 2**30
    if "--n-layers" in argv:
        depth = int(argv[argv.index("--n-layers") + 1])
        short = replace(job, model=replace(job.model, n_layers=depth))
        result["planner_gib_run_depth"] = plan(short).peak_gpu_bytes / 2**30
    model = result["model"]
    method = "upipe" if result["method"] == "upipe_usp" else result["method"]
    result["paper_gib"] = paper_value("4", model, method, "peak_memory", result["length"])


def config_overrides(argv: list[str]) -> list[str]:
    """The ``--section.key [value]`` overrides of an emulator command (its own options have no dot),
    so that the planner plans what the run measured."""
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith("--") and "." in arg and arg != "--job.config_file":
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            out += [arg] if value is None else [arg, value]
    return out


def replan_report(json_path: Path, when: str) -> StageReport:
    """A committed memory report with its planner columns recomputed by this checkout's planner
    (``--replan``); the measurements are left as they were. ``when`` is recorded beside the
    report's environment, so a reader sees which planner the columns come from."""
    data = json.loads(Path(json_path).read_text())
    if data.get("stage") != "memory":
        raise ValueError(f"{json_path}: --replan takes a memory report, this one is stage {data.get('stage')!r}")
    report = StageReport(data["stage"], dict(data["environment"]), data["results"], data.get("not_run", []),
                         tuple(data["lengths"]) if data.get("lengths") else None)
    for result in report.results:
        if result.get("argv"):
            add_memory_context(result)
    report.environment["planner columns recomputed"] = when
    return report


def add_speed_context(results: list[dict]) -> None:
    """Each speed result's full-depth step time (modelled communication) and, from warm steps
    only, its tokens/s/GPU and the UPipe / Ulysses step-time ratio beside the paper's Tables 3
    and 5. A cold step (no untimed warm-up before it: first-use kernel compilation and set-up
    inside it, the emulator's ``warm`` False, or a report from before issue 41) gets no tokens/s
    and no ratio: ``refused`` says why."""
    by_key = {}
    for r in results:
        m = r.get("measurement")
        if m is None:
            continue
        r["step_s"] = m["full"]["modeled_step_time_s"]
        r["paper_tokens_per_s"] = paper_value("3", "llama3_8b", r["method"], "throughput", r["length"])
        if not m.get("warm"):
            r["refused"] = COLD_STEP
            continue
        r["tokens_per_s"] = m["seq_len"] * m["batch"] / r["step_s"] / m["cp_degree"]
        by_key[(r["method"], r["length"])] = r
    for r in results:
        other = by_key.get(("ulysses", r["length"]))
        if r["method"] == "upipe" and other is not None and "tokens_per_s" in r:
            r["ratio"] = r["step_s"] / other["step_s"]
            up = paper_value("5", "llama3_8b", "upipe", "step_time_total", r["length"])
            ul = paper_value("5", "llama3_8b", "ulysses", "step_time_total", r["length"])
            r["paper_ratio"] = up / ul if up and ul else None
