"""Per-rank attention work under document masking: zigzag ring vs. balancing layouts.

Pure arithmetic (``titan_upipe.costs.document_balance``): for packed sequences of ``S`` tokens
drawn from a document-length mix, the number of visible (query, key) pairs per ring rank and per
ring step under block-causal document masking, for

* ``contig``     contiguous shards (what ring would do without zigzag; Ulysses' shard),
* ``zigzag``     ``ZigzagLayout`` (2R chunks, rank r owns r and 2R-1-r): the trainer's layout,
* ``snake-k``    k chunks per rank dealt forward/backward (fixed in (S, R), like zigzag),
* ``greedy-m``   m chunks per rank assigned per batch, heaviest chunk to the lightest rank,
* ``doczz``      zigzag inside every document of >= ``--min-split`` tokens, short ones fill
  (``doczz-64K``: the same with 65536; ``doczz-g``: short documents dealt whole, longest first,
  to the rank with the least work that has room, from the job's split length
  ``split_threshold(S, R, --min-split)``: the job's layout of issue 35);
* ``doczz-b``    the job's layout since issue 42 (``parallel.document_deal.row_deal``): ``doczz-g``,
  shorter documents split where the balance needs it, the fixed zigzag where that is not busier.

Reported per (mix, S, R, layout), over ``--seeds`` batches, all relative to perfect balance:

* ``total``    max/mean of per-rank work (a lower bound for any ring schedule);
* ``lockstep`` sum_t max_r W[r,t] / (sum W / R): every step as slow as its slowest rank (an
  upper bound);
* ``sim``      ``simulate_ring`` (the exchange order of ``titan_upipe/attention/ring.py``):
  forward + ``--bwd-factor`` x backward attention time, no transfer cost;
* ``model``    a whole training step: balanced per-token work (``--tok-pairs`` pair-equivalents
  per token: projections + MLP, fwd + bwd) plus ``sim`` with a transfer of ``--comm-pairs``
  pair-equivalents per K/V token per ring step (x3 in the backward: bf16 K/V + fp32 dK/dV),
  over the same with perfectly balanced attention. Defaults: Llama3-8B (7.5e9 params,
  32 layers, d = 4096, 8 KV heads x 128) with GEMMs and attention at the same FLOP rate and
  400 TFLOP/s vs 50 GB/s between ring ranks: 6 x 7.5e9 / 32 / (4 x 4096) = 85830 and
  (4096 B / 50 GB/s) / (4 x 4096 / 400 TFLOP/s) = 2000.

One pair-equivalent is the forward FLOPs of one (query, key) pair in one layer. With USP
(R ring x U Ulysses) every Ulysses rank does 1/U of its ring rank's work (and 1/U of its
tokens' per-token work), so all the numbers for R hold for any U.

Example::

    python scripts/bench_document_balance.py --seq-lens 1048576 8388608 --rings 2 4 8 16 --seeds 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_upipe.costs.document_balance import (  # noqa: E402
    contiguous_intervals,
    document_zigzag_intervals,
    greedy_chunk_intervals,
    imbalance,
    job_intervals,
    merge_runs,
    runs_intervals,
    simulate_ring,
    split_threshold,
    step_work,
    zigzag_intervals,
)
from titan_upipe.costs.document_mixes import LONG_MIN, make_batch  # noqa: E402
from titan_upipe.spec.document_deal import row_deal, zigzag_deal  # noqa: E402


def layouts(lengths: list[int], seq_len: int, R: int, min_split: int) -> dict[str, np.ndarray]:
    out = {
        "contig": contiguous_intervals(seq_len, R),
        "zigzag": zigzag_intervals(seq_len, R, 2),
        "snake-4": zigzag_intervals(seq_len, R, 4),
        "snake-8": zigzag_intervals(seq_len, R, 8),
        "snake-16": zigzag_intervals(seq_len, R, 16),
        "greedy-4": greedy_chunk_intervals(lengths, R, 4),
        "greedy-8": greedy_chunk_intervals(lengths, R, 8),
        "doczz": document_zigzag_intervals(lengths, R, min_split),
        "doczz-64K": document_zigzag_intervals(lengths, R, 65536),
        "doczz-g": document_zigzag_intervals(lengths, R, split_threshold(seq_len, R, min_split), greedy_fill=True),
        "doczz-b": job_intervals(lengths, R, "documents", min_split),
    }
    return out


def _sim(W: np.ndarray, bwd_factor: float) -> float:
    """Forward + backward ring pass through ``simulate_ring``, no transfer cost, over the balanced time."""
    R = W.shape[0]
    return ((simulate_ring(W) + simulate_ring(bwd_factor * W, backward=True))
            / ((1 + bwd_factor) * W.sum() / R))


def _attention_time(w: np.ndarray, comm: float, bwd_factor: float) -> float:
    """Forward + backward ring pass, the backward moving K/V and fp32 dK/dV (3x the bytes)."""
    return simulate_ring(w, comm) + simulate_ring(bwd_factor * w, 3 * comm, backward=True)


def batch_rows(lengths: list[int], mix: str, seed: int, rings: list[int], args: argparse.Namespace) -> list[dict]:
    """Every metric of one batch (document ``lengths``) on every layout, for each ring size."""
    S = int(sum(lengths))
    rows = []
    for R in rings:
        for name, lay in layouts(lengths, S, R, args.min_split).items():
            W = step_work(lengths, lay, R).astype(float)
            imb = imbalance(W)
            flat = np.full_like(W, W.sum() / R**2)
            bf = args.bwd_factor
            sim = _sim(W, bf)
            c = args.comm_pairs * S / R

            lin = args.tok_pairs * S / R
            model = (lin + _attention_time(W, c, bf)) / (lin + _attention_time(flat, c, bf))
            rows.append({"mix": mix, "S": S, "R": R, "seed": seed, "layout": name,
                         "total": imb["total"], "lockstep": imb["stepwise"], "sim": sim,
                         "model": model, "comm_bound": bool(3 * c > bf * W.sum() / R**2),
                         "runs": int(len(merge_runs(lay)))})
    return rows


KEY_MIXES = ("mixed-0.005", "mixed-0.02", "all-short", "long-start")
KEY_LAYOUTS = ("zigzag", "snake-16", "greedy-8", "doczz", "doczz-g", "doczz-b")
CLAIM_MIXES = ("mixed-0.005", "mixed-0.02", "all-short", "long-start", "long-end", "near-16384", "near-4096",
               "one-near-16384", "one-near-4096", "pareto-1.3")
CLAIM_BOUND, CLAIM_WHERE = 1.05, 1.2
"""Issue 42's claim: the job's layout within 1.05 of the mean wherever the fixed zigzag exceeds 1.2."""


def key_results(rows: list[dict], rings: list[int]) -> list[str]:
    """The summary table: ``sim`` and ``model`` per (mix, layout, R), mean over every batch of the
    mix (all seeds and sequence lengths pooled) / the worst batch, two decimals."""
    lines = ["| mix | layout | " + " | ".join(f"R = {R} sim" for R in rings) + " | "
             + " | ".join(f"R = {R} model" for R in rings) + " |",
             "|---|---|" + "---|" * (2 * len(rings))]
    for mix in KEY_MIXES:
        for name in KEY_LAYOUTS:
            cells = []
            for metric in ("sim", "model"):
                for R in rings:
                    v = [r[metric] for r in rows if (r["mix"], r["layout"], r["R"]) == (mix, name, R)]
                    cells.append(f"{np.mean(v):.2f} / {max(v):.2f}" if v else "-")
            if any(c != "-" for c in cells):
                lines.append(f"| {mix} | {name} | " + " | ".join(cells) + " |")
    return lines


def _size(seq_len: int) -> str:
    return f"{seq_len >> 20}M" if seq_len >= 1 << 20 else f"{seq_len >> 10}K"


def _ratio(work) -> float:
    work = np.asarray(work, dtype=np.float64)
    return float(work.max() / work.mean())


def claim_rows(args: argparse.Namespace) -> tuple[list[dict], list[float]]:
    """Per batch of ``--claim-mixes`` x ``--claim-seq-lens`` x ``--claim-seeds`` and ring size: busiest /
    mean under the fixed zigzag, ``doczz-g`` (issue 35's job layout) and ``doczz-b`` (the job's now,
    ``row_deal``: its own exact count, checked against ``step_work``), ``doczz-b``'s ``sim``; and the
    seconds each ``row_deal`` took (not in the tables: they vary from run to run)."""
    rows, seconds = [], []
    for mix in args.claim_mixes:
        for S in args.claim_seq_lens:
            for seed in range(args.claim_seeds):
                lengths = make_batch(mix, S, seed)
                for R in args.rings:
                    threshold = split_threshold(S, R, args.min_split)
                    t0 = time.perf_counter()
                    job = row_deal(lengths, R, threshold)
                    seconds.append(time.perf_counter() - t0)
                    W = step_work(lengths, runs_intervals(job.runs), R)
                    assert W.sum(axis=1).tolist() == list(job.work), (mix, S, seed, R)
                    old = document_zigzag_intervals(lengths, R, threshold, greedy_fill=True)
                    rows.append({"mix": mix, "S": S, "R": R, "seed": seed,
                                 "zigzag": _ratio(zigzag_deal(lengths, R).work),
                                 "doczz-g": _ratio(step_work(lengths, old, R).sum(axis=1)),
                                 "doczz-b": _ratio(job.work), "on_zigzag": job.is_zigzag,
                                 "sim": _sim(W.astype(float), args.bwd_factor)})
    return rows, seconds


def _worst(rows: list[dict], key: str) -> str:
    return f"{max(r[key] for r in rows):.3f}" if rows else "-"


def claim_table(rows: list[dict], mixes: list[str], seq_lens: list[int]) -> list[str]:
    """Per (mix, S), all ring sizes and seeds pooled, then every batch: where the zigzag exceeds
    ``CLAIM_WHERE``, the worst busiest / mean of ``doczz-g`` and ``doczz-b`` and how often ``doczz-b``
    exceeds ``CLAIM_BOUND``; everywhere, how often ``doczz-b`` is busier than the zigzag or runs its runs."""
    lines = [f"| mix | S | batches | zigzag > {CLAIM_WHERE} | zigzag worst | doczz-g worst there | doczz-b worst there "
             f"| doczz-b > {CLAIM_BOUND} there | doczz-b busier than zigzag | doczz-b on the zigzag | doczz-b sim worst |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    groups = [(mix, S) for mix in mixes for S in seq_lens] + [("all", None)]
    for mix, S in groups:
        sel = [r for r in rows if mix in ("all", r["mix"]) and S in (None, r["S"])]
        there = [r for r in sel if r["zigzag"] > CLAIM_WHERE]
        size = "all" if S is None else _size(S)
        lines.append(f"| {mix} | {size} | {len(sel)} | {len(there)} | {_worst(sel, 'zigzag')} "
                     f"| {_worst(there, 'doczz-g')} | {_worst(there, 'doczz-b')} "
                     f"| {sum(r['doczz-b'] > CLAIM_BOUND for r in there)} | {sum(r['doczz-b'] > r['zigzag'] for r in sel)} "
                     f"| {sum(r['on_zigzag'] for r in sel)} | {_worst(sel, 'sim')} |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1 << 20, 1 << 23])
    p.add_argument("--rings", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--mixes", nargs="+",
                   default=["mixed-0.005", "mixed-0.02", "all-short", "long-start", "long-end", "causal"])
    p.add_argument("--min-split", type=int, default=16384, help="doczz: split documents at least this long")
    p.add_argument("--tok-pairs", type=float, default=85830.0,
                   help="balanced per-token work (fwd+bwd) in forward (query, key)-pair FLOPs")
    p.add_argument("--comm-pairs", type=float, default=2000.0,
                   help="time to send one token's K/V to the next ring rank, in pair-equivalents")
    p.add_argument("--bwd-factor", type=float, default=2.5, help="attention backward / forward work")
    p.add_argument("--claim-mixes", nargs="+", default=list(CLAIM_MIXES),
                   help="issue 42's claim table: these mixes (the adversarial ones included) ...")
    p.add_argument("--claim-seq-lens", type=int, nargs="+", default=[1 << 17, 1 << 20], help="... at these S ...")
    p.add_argument("--claim-seeds", type=int, default=5, help="... and seeds, every --rings")
    p.add_argument("--json", type=Path, help="write every measurement here")
    return p.parse_args(argv)


def compute(args: argparse.Namespace) -> tuple[list[dict], dict, float]:
    """Every batch's metrics (``batch_rows``), each (mix, S)'s batch statistics, and the seconds it took."""
    t0 = time.time()
    rows = []
    stats = {}
    for mix in args.mixes:
        for S in args.seq_lens:
            seeds = [0] if mix == "causal" else list(range(args.seeds))
            for seed in seeds:
                lengths = make_batch(mix, S, seed)
                assert sum(lengths) == S
                L = np.asarray(lengths)
                stats.setdefault((mix, S), []).append({
                    "docs": len(L),
                    "long_share": float(L[L >= LONG_MIN].sum() / S),
                    "max_doc": int(L.max()),
                    "work_vs_causal": float((L * (L + 1) // 2).sum() / (S * (S + 1) / 2)),
                })
                rows += batch_rows(lengths, mix, seed, args.rings, args)
    return rows, stats, time.time() - t0


def report(args: argparse.Namespace, rows: list[dict], stats: dict, elapsed: float) -> str:
    """The printed tables (markdown; docs/benchmarks/document_balance.md holds them)."""
    out: list[str] = []
    out.append(f"# computed in {elapsed:.1f} s; seeds={args.seeds} min_split={args.min_split} "
               f"tok_pairs={args.tok_pairs} comm_pairs={args.comm_pairs} bwd_factor={args.bwd_factor}")
    out.append("\n## Key results: mean over every batch of the mix (seeds and S pooled) / worst batch\n")
    out.append("\n".join(key_results(rows, args.rings)))
    out.append("\n## Batches\n")
    out.append("| mix | S | docs (mean) | longest doc (mean) | tokens in docs >= 100K | doc-masked work / causal work |")
    out.append("|---|---|---|---|---|---|")
    for (mix, S), st in stats.items():
        out.append(f"| {mix} | {S} | {np.mean([s['docs'] for s in st]):.0f} | {np.mean([s['max_doc'] for s in st]):.0f} "
                   f"| {np.mean([s['long_share'] for s in st]):.2f} | {np.mean([s['work_vs_causal'] for s in st]):.4f} |")

    groups = defaultdict(list)
    for r in rows:
        groups[(r["mix"], r["S"], r["R"], r["layout"])].append(r)
    names = list(dict.fromkeys(r["layout"] for r in rows))
    for metric, title in (("total", "max/mean per-rank attention work"),
                          ("lockstep", "sum_t max_r W[r,t] / (sum W / R)"),
                          ("sim", "ring.py schedule, fwd + bwd attention time / balanced (no transfer cost)"),
                          ("model", f"training-step time / the same with balanced attention "
                                    f"(tok_pairs={args.tok_pairs:.0f}, comm_pairs={args.comm_pairs:.0f})")):
        out.append(f"\n## {metric}: {title}; mean over seeds [worst seed]\n")
        out.append("| mix | S | R | " + " | ".join(names) + " |")
        out.append("|---|---|---|" + "---|" * len(names))
        for mix in args.mixes:
            for S in args.seq_lens:
                for R in args.rings:
                    cells = []
                    for n in names:
                        v = [g[metric] for g in groups[(mix, S, R, n)]]
                        cells.append(f"{np.mean(v):.3f}" + (f" [{max(v):.3f}]" if len(v) > 1 else ""))
                    out.append(f"| {mix} | {_size(S)} | {R} | " + " | ".join(cells) + " |")
    out.append("\n## Transfer-bound: share of batches whose mean backward step (bwd_factor x sum W / R^2) "
          "is shorter than its K/V + dK/dV transfer (3 x comm_pairs x S / R)\n")
    out.append("| mix | " + " | ".join(f"S={_size(S)}" for S in args.seq_lens) + " |")
    out.append("|---|" + "---|" * len(args.seq_lens))
    for mix in args.mixes:
        cells = []
        for S in args.seq_lens:
            cells.append(" ".join(f"R{R}:{np.mean([g['comm_bound'] for g in groups[(mix, S, R, 'zigzag')]]):.0%}"
                                  for R in args.rings))
        out.append(f"| {mix} | " + " | ".join(cells) + " |")
    runs = defaultdict(list)
    for r in rows:
        runs[(r["layout"], r["R"])].append(r["runs"])
    out.append("\n## Layout size: intervals (runs of consecutive tokens) over all ranks, max over batches\n")
    out.append("| layout | " + " | ".join(f"R={R}" for R in args.rings) + " |")
    out.append("|---|" + "---|" * len(args.rings))
    for n in names:
        out.append(f"| {n} | " + " | ".join(str(max(runs[(n, R)])) for R in args.rings) + " |")
    return "\n".join(out)



def claim_report(args: argparse.Namespace, claim: list[dict], seconds: list[float]) -> str:
    """Issue 42's table (``claim_table``) and how long the job's layout took per batch."""
    out = [f"\n## Issue 42: busiest / mean ring work, {args.claim_seeds} seeds x R = "
           f"{', '.join(map(str, args.rings))} per (mix, S)\n", *claim_table(claim, args.claim_mixes, args.claim_seq_lens)]
    per_size = defaultdict(list)
    for row, sec in zip(claim, seconds, strict=True):
        per_size[row["S"]].append(sec * 1e3)
    out.append("\n" + "; ".join(f"row_deal at {_size(S)}: median {np.median(ms):.1f} ms, max {max(ms):.1f} ms"
                                 for S, ms in per_size.items()))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows, stats, elapsed = compute(args)
    print(report(args, rows, stats, elapsed))
    claim, seconds = claim_rows(args)
    print(claim_report(args, claim, seconds))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "claim": claim,
                                         "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))


if __name__ == "__main__":
    main()
