"""The predicted tokens/s per GPU of the GPU recipes by length, with full recompute and with kept
attention as ``auto`` sizes it, beside the paper's Table 3 (``docs/benchmarks/predicted_speed.md``,
written by ``scripts/speed_table.py``; ``tests/test_docs.py`` recomputes it).

Each row is a recipe (``configs/llama3_8b/upipe_*.toml``, ``configs/qwen3_32b/upipe_usp_*.toml``) as
``python -m titan_upipe.plan --job.config_file X --gpu-mem 80 --host-mem 1900`` plans it: the paper's
cluster (8 x H100 80 GiB per node, 1,900 GiB of host memory per node).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from titan_upipe.plan.machine import keep_host_budget
from titan_upipe.plan.search import size_keep_attention
from titan_upipe.plan.speed import predicted_speeds
from titan_upipe.plan.step import plan
from titan_upipe.resources.paper_tables import paper_value
from titan_upipe.spec.units import GIB
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_0_2.job_plan import async_checkpoint_staging_bytes, plan_input_from_job_config

GPU_GIB, HOST_GIB = 80.0, 1900.0
"""The paper's cluster: H100 80 GiB, 1,900 GiB of host memory per 8-GPU node."""


@dataclass(frozen=True)
class SpeedTable:
    """One model's recipes: (paper model, method in Table 3, recipe paths by length)."""

    model: str
    title: str
    method: str
    recipes: tuple[tuple[str, str], ...]


TABLES = (
    SpeedTable("llama3_8b", "Llama3-8B, UPipe (CP 8) on 8 GPUs", "upipe",
               tuple((x, f"configs/llama3_8b/upipe_{x.lower()}.toml")
                     for x in ("128K", "256K", "512K", "1M", "2M", "3M", "4M", "5M"))),
    SpeedTable("qwen3_32b", "Qwen3-32B, UPipe in USP (Ulysses 8 x ring 2) on 16 GPUs", "upipe",
               tuple((x, f"configs/qwen3_32b/upipe_usp_{x.lower()}.toml")
                     for x in ("128K", "256K", "512K", "1M", "2M", "3M", "4M"))),
)


def recipe_row(length: str, path: str, repo: Path, model: str, method: str) -> str:
    """One Markdown row: the recipe's kept blocks and both predictions beside Table 3."""
    job_config = parse_config(["--job.config_file", str(repo / path)], quiet=True)
    job = plan_input_from_job_config(job_config)
    host = keep_host_budget(HOST_GIB * GIB, async_checkpoint_staging_bytes(job_config, job))
    keep = size_keep_attention(job, "auto", None, GPU_GIB * GIB, host)
    job = replace(job, keep_device_blocks=keep.device_blocks, keep_host_blocks=keep.host_blocks)
    peak = plan(job, HOST_GIB * GIB).peak_gpu_bytes / GIB
    speeds = predicted_speeds(job)
    full, kept = (speeds[k].tokens_per_s_per_gpu for k in ("full recompute", "as planned"))
    paper = paper_value("3", model, method, "throughput", length)
    ulysses = paper_value("3", model, "ulysses", "throughput", length)
    where = f"{keep.device_blocks} GPU + {keep.host_blocks} host" if keep.blocks else "none"
    return (f"| {length} | {where} | {peak:.1f} | {full:.0f} | {kept:.0f} | {kept / full:.2f}x | "
            f"{'-' if paper is None else f'{paper:.0f}'} | {'-' if ulysses is None else f'{ulysses:.0f}'} |")


def speed_tables(repo: Path) -> list[str]:
    """The document's tables (Markdown lines)."""
    lines = []
    for table in TABLES:
        lines += [f"### {table.title}", "",
                  "| length | blocks keeping (auto) | peak GiB (planned) | full recompute tokens/s/GPU | kept "
                  "attention tokens/s/GPU | gain | paper T3 UPipe | paper T3 Ulysses |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [recipe_row(length, path, repo, table.model, table.method) for length, path in table.recipes]
        lines.append("")
    return lines
