"""TSP's bf16 error against the dtype's own, per tensor, over many seeds (docs/tsp.md, issue 30).

One TSP block (attention + MLP) at degree 3 on gloo ranks of the test pool, Qwen3 12/3 heads
(qk-norm), bf16, through the test harness ``tests/test_tsp.py::_block_on_rank``: for every tensor
(output, dX, each owner's weight gradient, the summed qk-norm weight gradients, the MLP's), the
ratio of its error against the fp32 reference to the unconverted modules' own bf16 error, over
every seed and rank (median and worst). ``--owner-sums bf16`` replaces the fp32 sums over the
owners (``tsp.grad_sum``) by autograd's sums in the compute dtype: the code before issue 30.

    python scripts/tsp_bf16_error.py --seeds 16
    python scripts/tsp_bf16_error.py --seeds 16 --owner-sums bf16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

DEGREE = 3


def _seeds_on_rank(rank: int, pool_size: int, mesh, seeds: list[int], owner_sums: str) -> list[dict]:
    import torch.distributed as dist
    from test_tsp import _block_on_rank

    import titan_upipe.tsp.attention as tsp_attention_module

    if owner_sums == "bf16":
        tsp_attention_module.fp32_summed_uses = lambda t, n: [t] * n
    group = dist.new_group(list(range(DEGREE)))
    if rank >= DEGREE:
        return []
    return [_block_on_rank(rank, DEGREE, group, "qwen3", 12, 3, "bfloat16", None, None, seed) for seed in seeds]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--owner-sums", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args(argv)
    from dist_utils import run_distributed

    per_rank = run_distributed(DEGREE + 1, _seeds_on_rank, list(range(args.seeds)), args.owner_sums)[:DEGREE]
    ratios: dict[str, list[float]] = {}
    for results in per_rank:
        for result in results:
            for key, err in result["errors"].items():
                ratios.setdefault(key, []).append(err / result["own"][key])
    print(f"degree {DEGREE}, Qwen3 12/3 heads, bf16, {args.seeds} seeds x {DEGREE} ranks, owner sums in "
          f"{args.owner_sums}: error / the unconverted bf16 modules' error")
    print("| tensor | median | worst |\n|---|---|---|")
    for key, values in ratios.items():
        print(f"| {key} | {statistics.median(values):.2f} | {max(values):.2f} |")


if __name__ == "__main__":
    main()
