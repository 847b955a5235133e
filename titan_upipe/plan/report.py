"""What the planner reports: the summary (one JSON-able dict), its text rendering, and the plot
of predicted peak vs sequence length with the paper's Table 4 points
(``titan_upipe/resources/paper_tables.csv``)."""

from __future__ import annotations

from dataclasses import replace

from titan_upipe.plan.documents import documents_summary
from titan_upipe.plan.job import UPIPE_MODES, PlanInput, as_tsp
from titan_upipe.plan.result import MemoryPlan
from titan_upipe.plan.search import longest_fit, max_seq_len, recommended_heads_per_stage
from titan_upipe.plan.sizes import StepSizes
from titan_upipe.plan.speed import A2A_GBPS, MATMUL_TFLOPS, predicted_speeds
from titan_upipe.plan.step import plan
from titan_upipe.resources.paper_tables import (
    LENGTH_COLUMNS,
    PAPER_TABLES_CSV,
    cell_value,
    paper_rows,
    paper_value,
)
from titan_upipe.spec.keep_attention import kept_attention_bytes
from titan_upipe.spec.units import GIB, K, format_bytes, format_length, parse_length

PLOT_LENGTHS = [parse_length(x) for x in ("128K", "256K", "512K", "1M", "2M", "3M", "4M", "5M", "6M", "7M", "8M")]
PAPER_ROWS = {"ulysses": "Ulysses", "upipe": "UPipe", "ring": "Ring"}
"""Table 4's methods drawn on the plot, by their labels' leading word."""


def keep_summary(job: PlanInput, setting: str | None) -> dict:
    """The kept attention of the plan (``attention.keep``): its setting, blocks and bytes."""
    s = StepSizes.of(job)
    per_block = kept_attention_bytes(s.tokens, job.model.n_heads, job.model.head_dim, s.act_bytes)
    return {"setting": setting or "off", "device_blocks": job.keep_device_blocks, "host_blocks": job.keep_host_blocks,
            "bytes_per_block": per_block, "text": job.keep.describe(job.model.n_layers)}


def speed_summary(job: PlanInput, paper_model: str | None) -> dict | None:
    """The predicted step and tokens/s per GPU with full recompute and as planned (``plan.speed``),
    beside the paper's Table 3 (its model and method at this length, where it has the cell); None
    for a CPU job (the prediction is a GPU's)."""
    if job.device != "cuda":
        return None
    speeds = predicted_speeds(job)
    rate = speeds["as planned"].rate
    out: dict = {name: {"step_s": t.step_s, "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu, "attention_s": t.attention_s,
                        "gemm_s": t.gemm_s, "head_s": t.head_s, "comm_s": t.comm_s} for name, t in speeds.items()}
    out["attention_rate"] = {"backend": rate.backend, "arch": rate.arch, "fwd_tflops": rate.fwd_tflops,
                             "bwd_tflops": rate.bwd_tflops, "basis": rate.basis}
    out["matmul_tflops_assumed"], out["a2a_gbps"] = MATMUL_TFLOPS, A2A_GBPS
    method = {"upipe-in-usp": "upipe"}.get(job.resolved_mode, job.resolved_mode)
    paper = paper_value("3", paper_model, method, "throughput", format_length(job.seq_len)) if paper_model else None
    out["paper_table3_tokens_per_s_per_gpu"] = paper
    return out


def summary(result: MemoryPlan, gpu_mem_bytes: float | None, host_mem_bytes: float | None,
            keep_setting: str | None = None, paper_model: str | None = None, keep_sized: bool = False) -> dict:
    """The plan as one dict (``--json``); with ``gpu_mem_bytes`` also the fit, the longest
    sequence that fits and the recommended U; the kept attention and, for a GPU job, the predicted
    speed (``keep_summary``, ``speed_summary``)."""
    job = result.job
    out = {
        "model": job.model.name,
        "mode": job.resolved_mode,
        "seq_len": job.seq_len,
        "cp": job.cp,
        "ulysses_degree": job.ulysses_degree,
        "ring_degree": job.ring,
        "heads_per_stage": job.u if job.resolved_mode in UPIPE_MODES else None,
        "world_size": job.ranks,
        "tokens_per_rank": job.tokens,
        "device": job.device,
        "peak_gpu_gib": result.peak_gpu_bytes / GIB,
        "peak_gpu_bytes": result.peak_gpu_bytes,
        "peak_phase": result.peak_phase,
        "peak_where": result.peak.where,
        "phase_peak_gib": {k: v / GIB for k, v in result.phase_peaks.items()},
        "breakdown_bytes": result.breakdown,
        "runtime_reserve_gib": job.reserve / GIB,
        "host_gib": result.host_bytes / GIB,
        "host_gib_per_rank": result.host_bytes_per_rank / GIB,
        "host_pinned": result.host_pinned,
        "host_optimizer_gib_per_rank": result.host_optimizer_bytes_per_rank / GIB,
        "documents": documents_summary(job),
        "keep_attention": keep_summary(job, keep_setting),
        "predicted_speed": speed_summary(job, paper_model),
        "notes": result.notes,
    }
    if gpu_mem_bytes is not None:
        out["gpu_mem_gib"] = gpu_mem_bytes / GIB
        out["fits"] = result.fits(gpu_mem_bytes, host_mem_bytes)
        # the longest context: full recompute where the planner sizes the kept attention (``keep_sized``:
        # it takes what fits at each length, maybe nothing)
        full = replace(job, keep_device_blocks=0, keep_host_blocks=0) if keep_sized else job
        out["max_seq_len_as_configured"] = max_seq_len(full, gpu_mem_bytes, host_mem_bytes)
        out["max_seq_len"], out["max_seq_len_settings"] = longest_fit(full, gpu_mem_bytes, host_mem_bytes)
        u, ok = recommended_heads_per_stage(job, gpu_mem_bytes, host_mem_bytes)
        out["recommended_heads_per_stage"] = u
        out["recommended_heads_per_stage_fits"] = ok
    if host_mem_bytes is not None:
        out["host_mem_gib"] = host_mem_bytes / GIB
    return out


def _lever_text(info: dict) -> str:
    """`` with X = true (as configured: L)`` when the longest fit needs settings the job lacks."""
    if not info.get("max_seq_len_settings"):
        return ""
    settings = ", ".join(f"{k} = {str(v).lower()}" for k, v in info["max_seq_len_settings"].items())
    configured = info["max_seq_len_as_configured"]
    return f" with {settings} (as configured: {format_length(configured)}, {configured})"


def render(result: MemoryPlan, info: dict) -> str:
    """The text report: the peak's terms, largest first, then host memory, fit and U."""
    job = result.job
    lines = [
        f"{job.model.name}: {info['mode']} (ulysses {job.ulysses_degree} x ring {job.ring}"
        + (f", U = {job.u}, {job.model.n_heads // job.u} stages" if info["heads_per_stage"] else "")
        + f"), seq_len {format_length(job.seq_len)} ({job.seq_len}), {job.ranks} ranks, {job.tokens} tokens/rank, "
        f"{job.device}",
        f"peak {result.peak_gpu_bytes / GIB:.2f} GiB per rank, set by {result.peak_phase} ({result.peak.where}):",
    ]
    width = max(len(k) for k in result.breakdown)
    for k, v in sorted(result.breakdown.items(), key=lambda kv: -kv[1]):
        if v:
            lines.append(f"  {k:<{width}}  {v / GIB:9.3f} GiB")
    lines.append(f"  {'= peak (predicted max_memory_allocated)':<{width}}  {result.peak_gpu_bytes / GIB:9.3f} GiB")
    lines.append(f"  {'+ runtime reserve (not allocated; fit check only)':<{width}}  {job.reserve / GIB:9.3f} GiB")
    lines.append("phase peaks: " + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in result.phase_peaks.items()))
    if info.get("documents"):
        d = info["documents"]
        lines.append(f"packed documents: document index {format_bytes(d['document_index_bytes'])} per rank (in every "
                     f"moment); transients: mask build {format_bytes(d['mask_build_bytes'])}, segments build "
                     f"{format_bytes(d['segments_build_bytes'])} (at block 0's first attention call)")
    lines += _keep_and_speed_lines(info)
    pin = "pinned" if result.host_pinned else "pageable"
    moments = result.host_optimizer_bytes_per_rank
    what = f"offloaded block inputs, {pin}" + (f"; AdamW moments {moments / GIB:.1f} GiB per rank" if moments else "")
    lines.append(f"host ({what}): {result.host_bytes_per_rank / GIB:.1f} GiB per rank, "
                 f"{result.host_bytes / GIB:.1f} GiB per node")
    if "fits" in info:
        lines.append(f"fits in {info['gpu_mem_gib']:g} GiB"
                     + (f" / {info['host_mem_gib']:g} GiB host" if "host_mem_gib" in info else "")
                     + f": {'yes' if info['fits'] else 'no'}")
        lines.append(f"longest sequence that fits: {format_length(info['max_seq_len'])} ({info['max_seq_len']})"
                     + _lever_text(info))
        ok = "" if info["recommended_heads_per_stage_fits"] else " (nothing fits; least memory)"
        lines.append(f"recommended U (heads per stage): {info['recommended_heads_per_stage']}{ok}")
    lines.extend(f"note: {n}" for n in result.notes)
    return "\n".join(lines)


def _keep_and_speed_lines(info: dict) -> list[str]:
    """The kept attention and the predicted speed (``summary``'s ``keep_attention``, ``predicted_speed``)."""
    keep, lines = info["keep_attention"], []
    if keep["setting"] != "off":
        lines.append(f"kept attention (keep_attention = {keep['setting']}): {keep['text']}, "
                     f"{format_bytes(keep['bytes_per_block'])} per block and rank")
    speed = info.get("predicted_speed")
    if speed:
        rate = speed["attention_rate"]
        lines.append(f"predicted step ({rate['backend']} on {rate['arch'] or 'an unmeasured GPU'}: "
                     f"{rate['fwd_tflops']:.0f} / {rate['bwd_tflops']:.0f} TFLOP/s fwd / bwd, {rate['basis']}; "
                     f"GEMMs at an assumed {speed['matmul_tflops_assumed']:.0f} TFLOP/s; all-to-all at "
                     f"{speed['a2a_gbps']:.0f} GB/s):")
        for name in ("full recompute", "as planned"):
            t = speed[name]
            lines.append(f"  {name:<15} {t['step_s']:8.1f} s per step, {t['tokens_per_s_per_gpu']:7.0f} tokens/s/GPU "
                         f"(attention {t['attention_s']:.1f} s, GEMMs {t['gemm_s']:.1f} s, head {t['head_s']:.1f} s, "
                         f"communication {t['comm_s']:.1f} s)")
        if speed["paper_table3_tokens_per_s_per_gpu"]:
            lines.append(f"  paper Table 3 (8xH100, FA3): {speed['paper_table3_tokens_per_s_per_gpu']:.0f} tokens/s/GPU")
    return lines


def paper_table4(model: str) -> dict[str, dict[int, float | None]] | None:
    """Table 4 (peak GiB) rows of ``model`` (llama3_8b / qwen3_32b) from the shared anchors:
    {method: {seq_len: GiB or None (OOM)}}; None when the file is missing."""
    if not PAPER_TABLES_CSV.exists():
        return None
    rows: dict[str, dict[int, float | None]] = {}
    for row in paper_rows(PAPER_TABLES_CSV):  # this module's name: tests point it elsewhere
        if row["table"] != "4" or row["model"] != model:
            continue
        rows[row["method"]] = {parse_length(key): cell_value(row[key]) for key in LENGTH_COLUMNS if row.get(key, "")}
    return rows


LONG_CONTEXT_SWITCHES = {"prefetch_after_attention": True, "resident_blocks": 1}
"""Issue 18's switches (the longest fit of Llama3-8B on 8 GPUs and Qwen3-32B on 16): the plot's
"these settings" line beside UPipe with the paper's settings."""
LONG_CONTEXT_LABEL = "late prefetch + resident_blocks = 1"


def tsp_variant(job: PlanInput) -> PlanInput | None:
    """TSP on the job's ranks with what it composes with (``as_tsp``, AdamW's moments on the device),
    or None where it cannot run the job (a degree that does not split the model, packed documents,
    data parallelism on top)."""
    if job.ranks != job.cp or job.documents:
        return None
    variant = replace(as_tsp(job), optimizer_state_on_host=False)
    try:
        variant.check_tsp()
    except ValueError:
        return None
    return variant


def plot_variants(job: PlanInput) -> list[tuple[str, PlanInput]]:
    """Ulysses, UPipe (U = C) with the paper's settings and with issue 18's switches, and USP on
    the job's model and cluster."""
    variants = []
    cu = job.ulysses_degree if job.ulysses_degree > 1 else job.cp
    ring = job.cp // cu
    if ring == 1:
        variants.append(("Ulysses", replace(job, mode="ulysses", ulysses=job.cp, heads_per_stage=None)))
        upipe = replace(job, mode="upipe", ulysses=job.cp, heads_per_stage=None)
        variants.append((f"UPipe (U = C = {cu})", upipe))
        variants.append((f"UPipe (U = C = {cu}), {LONG_CONTEXT_LABEL}", replace(upipe, **LONG_CONTEXT_SWITCHES)))
        usp_u = next((d for d in range(job.cp // 2, 1, -1) if job.cp % d == 0 and job.model.n_heads % d == 0), None)
        if usp_u:
            variants.append((f"USP (ulysses {usp_u} x ring {job.cp // usp_u})",
                             replace(job, mode="usp", ulysses=usp_u, heads_per_stage=None)))
        variants.append((f"Ring (zigzag, {job.cp})", replace(job, mode="ring", ulysses=1, heads_per_stage=None)))
        tsp = tsp_variant(job)
        if tsp is not None:
            variants.append((f"TSP ({job.cp})", tsp))
    else:
        variants.append((f"USP (ulysses {cu} x ring {ring})", replace(job, mode="usp", ulysses=cu, heads_per_stage=None)))
        upipe = replace(job, mode="upipe", ulysses=cu, heads_per_stage=None)
        variants.append((f"UPipe in USP (U = {cu})", upipe))
        variants.append((f"UPipe in USP (U = {cu}), {LONG_CONTEXT_LABEL}", replace(upipe, **LONG_CONTEXT_SWITCHES)))
        if job.model.n_heads % job.cp == 0:
            variants.append((f"Ulysses ({job.cp})", replace(job, mode="ulysses", ulysses=job.cp, heads_per_stage=None)))
    return variants


COLORS = {"Ulysses": "tab:blue", "UPipe": "tab:green", "USP": "tab:orange", "Ring": "tab:red", "FPDT": "tab:gray",
          "TSP": "tab:purple"}


def _color(label: str) -> str:
    return next((c for k, c in COLORS.items() if label.startswith(k)), "black")


def _plot_predictions(ax, job: PlanInput, host_mem_bytes: float | None) -> None:
    for label, variant in plot_variants(job):
        xs, ys = [], []
        for s in PLOT_LENGTHS:
            v = replace(variant, seq_len=s - s % variant.seq_unit)
            try:
                ys.append(plan(v, host_mem_bytes).peak_gpu_bytes / GIB)
            except ValueError:
                continue
            xs.append(s / (K * K))
        style = "--^" if label.startswith("Ring") else (":s" if LONG_CONTEXT_LABEL in label else "-o")
        ax.plot(xs, ys, style, color=_color(label), label=f"{label}: predicted", markersize=4)


def _plot_paper(ax, paper_model: str | None) -> str | None:
    """The paper's Table 4 points; a message when the table is missing."""
    table = paper_table4(paper_model) if paper_model else None
    if paper_model and table is None:
        return f"paper Table 4 points not drawn: {PAPER_TABLES_CSV} not found"
    if table:
        gpus = "8xH100" if paper_model == "llama3_8b" else "16xH100"
        for method, label in PAPER_ROWS.items():
            points = table.get(method, {})
            xs = [s / (K * K) for s, v in points.items() if v is not None]
            ys = [v for v in points.values() if v is not None]
            if xs:
                ax.plot(xs, ys, linestyle="none", marker="x" if method != "upipe" else "s", color=_color(label),
                        markerfacecolor="none", markersize=8, label=f"paper Table 4 {label} ({gpus})")
    return None


def make_plot(job: PlanInput, path: str, gpu_mem_bytes: float | None, host_mem_bytes: float | None,
              paper_model: str | None) -> str | None:
    """Write the PNG; returns a message about the paper's points when they are missing."""
    import matplotlib  # optional dependency: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    _plot_predictions(ax, job, host_mem_bytes)
    message = _plot_paper(ax, paper_model)
    if gpu_mem_bytes:
        ax.axhline(gpu_mem_bytes / GIB, color="black", linewidth=0.8, linestyle="--", label="GPU memory")
        ax.axhline((gpu_mem_bytes - job.reserve) / GIB, color="black", linewidth=0.6, linestyle=":",
                   label="GPU memory - runtime reserve")
    top = max(max(line.get_ydata()) for line in ax.get_lines() if len(line.get_ydata()))
    if gpu_mem_bytes:
        top = min(top, 1.6 * gpu_mem_bytes / GIB)
    ax.set_ylim(0, top * 1.05)
    ax.set_xlabel("sequence length (M tokens, 1M = 2^20)")
    ax.set_ylabel("peak memory per GPU (GiB)")
    ax.set_title(f"{job.model.name}, {job.ranks} GPUs, {job.attention_backend}: predicted peak vs paper Table 4",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return message
