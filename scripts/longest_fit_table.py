"""The planner's longest context per cluster shape, beside what was measured: the tables of
docs/planner.md's "Longest fit per cluster shape" section, as markdown.

    python scripts/longest_fit_table.py

Planner rows: UPipe with the paper's recipe (bf16 FSDP, offloaded full AC, tiled MLP/RMSNorm,
fused RoPE, Liger CE, FA3 kernels, batch 1, 8 GPUs per node); 8 GPUs: CP 8 = Ulysses 8; 16 GPUs:
UPipe inside USP, Ulysses 8 x ring 2 (the recipes' layouts). Each cell is ``plan.longest_fit``:
the longest multiple of the sequence unit whose peak + the 2 GiB runtime reserve fits the GPU and
whose host memory (offloaded block inputs, and AdamW's moments where on the host) fits the node,
over the job as configured and every combination of ``plan.LEVERS``, with the levers it needs.
The one-node Qwen3-32B recipes are planned from their TOMLs, their host memory as ``validate``
counts it. Measured rows: the paper's Table 4 (``titan_upipe/resources/paper_tables.csv``), its
Figure 5 (text only) and the Hugging Face run (huggingface/trl#6845). tests/test_docs.py checks
that docs/planner.md holds exactly this output.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODELS = {"llama3_8b": "Llama3-8B", "qwen3_32b": "Qwen3-32B"}
GPUS = (8, 16)
GPU_GIB = (80, 141)
HOST_GIB = (1900, 1000)
ULYSSES = 8
LEVER_NAMES = {"optimizer.state_on_host": "`state_on_host`",
               "activation_checkpoint.prefetch_after_attention": "`prefetch_after_attention`",
               "activation_checkpoint.resident_blocks": "`resident_blocks = {}`"}
ONE_NODE_RECIPES = ("configs/qwen3_32b/upipe_8gpu_1m.toml", "configs/qwen3_32b/upipe_8gpu_2m.toml",
                    "configs/qwen3_32b/upipe_8gpu_2_5m.toml")
PAPER_METHODS = {"upipe": "UPipe", "fpdt": "FPDT", "ulysses": "Ulysses", "ring": "Ring"}
HF_ANCHOR = ("Hugging Face, accelerate + TRL: torch CP on FSDP2, chunked loss, offloaded activation checkpoints; "
             "the levers it lists for >= 30B: FSDP parameter/optimizer CPU offload, sequence-tiled MLP "
             "(huggingface/trl#6845, the same table merged in #6846)")
"""The one measured Qwen3-32B run on one 8-GPU node we know of (a PR's table, 2026-08-21)."""


def tokens(n: int) -> str:
    """``7.66M (8,033,440)``: millions of 2^20 tokens, as the rest of docs/planner.md writes them."""
    return f"{n / 2**20:.2f}M ({n:,})"


def levers(settings: dict[str, object]) -> str:
    return ", ".join(LEVER_NAMES[key].format(value) for key, value in settings.items()) or "none"


def job(model: str, gpus: int):
    from titan_upipe.plan import KNOWN_MODELS, PlanInput

    return PlanInput(KNOWN_MODELS[model], seq_len=1 << 20, cp=gpus, ulysses=ULYSSES, mode="upipe")


def bound(base, length: int, settings: dict[str, object], gpu: float, host: float) -> str:
    """What the next length refuses: the GPU (peak + reserve), the node's host memory, or both."""
    from titan_upipe.plan import LEVERS, plan

    fields = {LEVERS[key][0]: value for key, value in settings.items()}
    after = plan(replace(base, seq_len=length + base.seq_unit, **fields), host)
    over = [name for name, full in (("GPU", after.peak_gpu_bytes + base.reserve > gpu), ("host", after.host_bytes > host))
            if full]
    return " and ".join(over)


def cluster_rows() -> list[str]:
    from titan_upipe.plan import GIB, longest_fit, max_seq_len

    rows = ["| model | GPUs (layout) | GiB per GPU | host GiB per node | longest fit, tokens | levers it needs | "
            "as configured | next length over |",
            "|---|---|---|---|---|---|---|---|"]
    for model, name in MODELS.items():
        for gpus in GPUS:
            layout = f"CP {gpus} = Ulysses {ULYSSES}" if gpus == ULYSSES else f"Ulysses {ULYSSES} x ring {gpus // ULYSSES}"
            base = job(model, gpus)
            for gpu_gib in GPU_GIB:
                for host_gib in HOST_GIB:
                    gpu, host = gpu_gib * GIB, host_gib * GIB
                    length, settings = longest_fit(base, gpu, host)
                    configured = max_seq_len(base, gpu, host)
                    rows.append(f"| {name} | {gpus} ({layout}) | {gpu_gib} | {host_gib:,} | {tokens(length)} | "
                                f"{levers(settings)} | {tokens(configured)} | {bound(base, length, settings, gpu, host)} |")
    return rows


def paper_rows() -> list[str]:
    """The longest length each method ran in the paper's Table 4 (the next one: OOM, or not run)."""
    from titan_upipe.resources.paper_tables import LENGTH_COLUMNS, OOM
    from titan_upipe.resources.paper_tables import paper_rows as csv_rows

    rows = ["| measured | model | GPUs | longest that ran (peak GiB per GPU) | next length |", "|---|---|---|---|---|"]
    table4 = [row for row in csv_rows() if row["table"] == "4" and row["method"] in PAPER_METHODS]
    for row in sorted(table4, key=lambda r: (list(MODELS).index(r["model"]), list(PAPER_METHODS).index(r["method"]))):
        ran = [x for x in LENGTH_COLUMNS if row[x] not in ("", OOM)]
        longest = ran[-1]
        after = LENGTH_COLUMNS.index(longest) + 1
        following = row[LENGTH_COLUMNS[after]] if after < len(LENGTH_COLUMNS) else ""
        nxt = (f"{LENGTH_COLUMNS[after]} {'out of memory' if following == OOM else 'empty in the table'}"
               if after < len(LENGTH_COLUMNS) else "(the table ends at 5M)")
        rows.append(f"| paper Table 4, {PAPER_METHODS[row['method']]} | {MODELS[row['model']]} | "
                    f"{row['gpus'].replace('x', ' x ')} | {longest} ({float(row[longest]):.2f}) | {nxt} |")
    rows.append("| paper Figure 5 (text), UPipe / USP-Hybrid | Llama3-8B | 16 x H100 | 8M / 6M | - |")
    rows.append(f"| {HF_ANCHOR} | Qwen3-32B | 8 x H100 | 1M (60.8 GB as reported), 1,295 s per step | - |")
    return rows


def one_node_rows() -> list[str]:
    """The one-node Qwen3-32B recipes, as ``python -m titan_upipe.plan --job.config_file X
    --gpu-mem 80 --host-mem 1900`` plans them, and their host memory as ``validate`` counts it."""
    from titan_upipe.plan import GIB
    from titan_upipe.plan.step import plan
    from titan_upipe.tools.preflight import host_memory_needed
    from titan_upipe.torchtitan_0_2.config_parse import parse_config
    from titan_upipe.torchtitan_0_2.job_plan import plan_input_from_job_config
    from titan_upipe.torchtitan_0_2.registry import register_plugin

    register_plugin()
    rows = ["| recipe | tokens | settings beyond the paper's | predicted peak GiB per GPU (+ 2 reserve, of 80) | "
            "peak moment | host GiB per node (of 1,900): inputs and moments (+ staging) |", "|---|---|---|---|---|---|"]
    for path in ONE_NODE_RECIPES:
        job_config = parse_config(["--job.config_file", str(REPO / path)])
        planned = plan_input_from_job_config(job_config)
        result = plan(planned, 1900 * GIB)
        assert result.fits(80 * GIB, 1900 * GIB), path
        needed, _ = host_memory_needed(job_config, planned.cp)
        staging = needed - result.host_bytes
        extra = ["`state_on_host`"] if planned.optimizer_state_on_host else []
        extra += [f"`resident_blocks = {planned.resident_blocks}`"] if planned.resident_blocks else []
        extra += ['`async_mode = "disabled"`'] if job_config.checkpoint.async_mode == "disabled" else []
        rows.append(f"| `{path}` | {tokens(planned.seq_len)} | {', '.join(extra)} | {result.peak_gpu_bytes / GIB:.2f} | "
                    f"{result.peak.where} | {needed / GIB:,.0f}" + (f" = {result.host_bytes / GIB:,.0f} + {staging / GIB:,.0f} "
                                                                    "async checkpoint staging" if staging else "") + " |")
    return rows


def markdown() -> str:
    """The three tables, each followed by a blank line."""
    return "\n\n".join("\n".join(rows) for rows in (cluster_rows(), paper_rows(), one_node_rows())) + "\n"


def main() -> int:
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
