"""Issue 18's lever tables (docs/planner.md, "Beyond 5M on one node"): the planner's peak, host
bytes per node and longest fit for Llama3-8B UPipe C = 8 at 7M and Qwen3-32B UPipe in USP 8 x 2 at
6M, under each implemented switch and each *what-if* (a term removed from every moment of the
planner's walk, optionally moved to the host: nothing implements those).

    python scripts/plan_levers.py      # ~15 s

Predictions only; the GPU fit check keeps the 2 GiB runtime reserve, the host 1,900 GiB per node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from titan_upipe.plan import GIB, PlanInput, model_dims, parse_length, plan
from titan_upipe.plan.search import longest_multiple

GPU_BYTES, HOST_BYTES = 80 * GIB, 1900 * GIB
Drop = Callable[[str, int], int]
"""(term label, bytes) -> the bytes a what-if removes from that term."""


HostPerRank = Callable[[PlanInput], int]
"""job -> bytes per rank a what-if moves to the host."""


def _measure(job: PlanInput, drop: Drop | None, host_per_rank: HostPerRank | None) -> tuple[int, int, str]:
    """(device peak, host bytes per node, where) with ``drop`` applied to every moment and
    ``host_per_rank`` added on the host."""
    result = plan(job, HOST_BYTES)
    totals = [(m.total - (sum(drop(k, v) for k, v in m.terms.items()) if drop else 0), m.where)
              for m in result.moments]
    peak, where = max(totals)
    host = result.host_bytes + (host_per_rank(job) * min(job.ranks, job.gpus_per_node) if host_per_rank else 0)
    return peak, host, where


def _fits(job: PlanInput, peak: int, host: int) -> bool:
    return peak + job.reserve <= GPU_BYTES and host <= HOST_BYTES


def _longest(job: PlanInput, drop: Drop | None, host_per_rank: HostPerRank | None) -> int:
    unit = job.seq_unit

    def fits(k: int) -> bool:
        longer = replace(job, seq_len=k * unit)
        peak, host, _ = _measure(longer, drop, host_per_rank)
        return _fits(longer, peak, host)

    return longest_multiple(fits) * unit


def row(label: str, job: PlanInput, drop: Drop | None = None, host_per_rank: HostPerRank | None = None) -> str:
    peak, host, where = _measure(job, drop, host_per_rank)
    longest = _longest(job, drop, host_per_rank)
    return (f"| {label} | {peak / GIB:.2f} | {host / GIB:.1f} | {'yes' if _fits(job, peak, host) else 'no'} | "
            f"{longest / 2**20:.2f}M ({longest}) | {where} |")


def main() -> None:
    jobs = {
        "Llama3-8B UPipe C = 8 at 7M": PlanInput(model_dims("llama3_8b"), seq_len=parse_length("7M"), cp=8,
                                                 ulysses=8),
        "Qwen3-32B UPipe in USP 8 x 2 at 6M": PlanInput(model_dims("qwen3_32b"), seq_len=parse_length("6M"),
                                                        cp=16, ulysses=8),
    }
    for title, job in jobs.items():
        print(f"\n{title}\n| setting | peak GiB | host GiB / node | fits | longest fitting | peak moment |")
        print(row("today", job))
        print(row("state_on_host", replace(job, optimizer_state_on_host=True)))
        print(row("prefetch_after_attention", replace(job, prefetch_after_attention=True)))
        print(row("prefetch_after_attention + resident_blocks 1",
                  replace(job, prefetch_after_attention=True, resident_blocks=1)))
        print(row("what-if one receive buffer", job, lambda k, v: v * 2 // 3 if "receive buffers" in k else 0))
        print(row("what-if no fp32 dK/dV sums", job, lambda k, v: v if "fp32 sums" in k else 0))
        print(row("what-if AdamW + fp32 parameters on the host", job,
                  lambda k, v: v if k.startswith(("AdamW", "parameters")) else 0,
                  lambda j: 12 * j.model.total_params // j.ranks))
        print(row("what-if AdamW + parameters + gradient shards on the host", job,
                  lambda k, v: v if k.startswith(("AdamW", "parameters", "gradients")) else 0,
                  lambda j: 16 * j.model.total_params // j.ranks))


if __name__ == "__main__":
    main()
