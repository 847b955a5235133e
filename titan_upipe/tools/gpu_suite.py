"""GPU validation suite: everything the CPU test suite cannot show, on one CUDA GPU.

    python -m titan_upipe.gpu_suite --next [--budget-s 540] [--out DIR]   # the GPU queue (gpu_queue.py)
    python -m titan_upipe.gpu_suite --stage kernels|attention|memory|speed|tsp|ring_documents|all [--lengths 1M,2M]
                                    [--select 'llama3_8b upipe'] [--budget-s 540]
    python -m titan_upipe.gpu_suite --dry-run [--next]   # on any machine: arguments, configs, wheels, plan, queue
    make gpu-suite STAGE=kernels                         # installs the carried wheels (.whl/) first

On a GPU machine without torchtitan, run it through ``scripts/gpu_suite.sh``, which
reassembles and installs the wheels ``scripts/gpu_wheels.sh`` downloaded (``.whl/``) before
importing the plugin.

=========== ========================================================================================
stage       runs
=========== ========================================================================================
kernels     the backend contract (``titan_upipe.contracts.backend``) for every backend usable here,
            bf16 and fp32; the varlen kernels' contract (``titan_upipe.contracts.varlen``:
            packed documents in one varlen call against per-document calls and fp32 masked
            attention, bf16, for each flash-attn backend installed); Liger's fused linear+CE against
            the chunked torch loss; the offloaded checkpoint's CUDA streams round trip (gradients
            bit-exact), with kept attention too (``keep_attention``: on the device and in pinned
            host memory, sdpa fp32 and the ``auto`` kernel in bf16); one bf16 step of a debug model with every converter (UPipe on a 1-rank mesh,
            tiled MLP/RMSNorm, fused RoPE/CE, offloaded AC) against the unconverted model; one bf16
            step of the UPipe model with ``compile.enable``'s compiled norms and feed-forwards
            (inductor) against the same model eager
attention   forward and backward TFLOP/s of every usable local kernel (after its bf16 contract) at one
            rank's shapes of Llama3-8B C=8 and Qwen3-32B, 128K and 1M (2M with ``--lengths 2M``), and
            packed documents for the varlen kernels (``gpu_attention``): ranked, and written to
            ``titan_upipe/resources/kernel_speed.csv``, which ``auto`` and these estimates read
memory      the rank emulator (``python -m titan_upipe.emulate``, fake process group, real kernels): Llama3-8B
            C=8 Ulysses and UPipe with the recipes' converters at 128K-5M and upward until OOM,
            Qwen3-32B UPipe-in-USP 8 x 2 at 1M-4M, and Qwen3-32B UPipe C=8 on one node (the
            ``upipe_8gpu`` recipes, 1M, 2M, 2.5M), on fewer layers with the emulator's extrapolation;
            ``max_memory_allocated``/``reserved`` beside the planner and the paper's Table 4
speed       the emulator on 2 layers, UPipe and Ulysses with the same kernel at 128K, 1M and 2M, 3
            steps: the kernels' compile pass, one untimed warm-up step, the median of 2 timed steps
            (``gpu_runs.TIMED_STEPS``): the UPipe / Ulysses step-time ratio and tokens/s/GPU with
            modelled communication beside the paper's Table 3, never from a single cold step; ``--select keep_attention``: both at 1M with
            ``--activation_checkpoint.keep_attention auto`` (a report of their own)
tsp         the rank emulator on TSP (issue 19), Llama3-8B over 8 GPUs with its recipes' converters at
            128K-2M and upward until OOM: ``max_memory_allocated``/``reserved`` at full depth, the
            warm step's time (3 steps, as speed) with modelled communication and the bytes its
            collectives move (beside the memory
            and speed stages' Ulysses and UPipe at the same lengths)
ring_documents
            packed documents on a ring (issue 35), one process playing every ring rank of R = 8 and 16
            (Llama3-8B heads, U = 1, the fastest varlen kernel, bf16) at 128K and 1M tokens under
            ``document_balance = "zigzag"`` and ``"documents"`` (``gpu_ring_documents``): each rank's
            kernel ms of its ring steps, busiest / mean and the synchronous ring's step beside the
            computed ``costs.document_balance`` figures
=========== ========================================================================================

A call runs its runs in order while the next one's estimate fits before the call's deadline,
``--budget-s`` from its start (default 540 s, under a 10-minute call; ``all`` shares it among the
stages, each in a child process of its own); the rest are listed in the report with the command
that runs them, and every emulator child is killed at the deadline. Reports are rewritten after
every run, so a killed call keeps what it measured. Estimates (``run_estimate_s``) divide one rank's
causal-attention FLOPs per layer by the TFLOP/s the kernel table measured for the kernel ``auto``
runs on the GPU's architecture (on a machine without a GPU: the newest measured one;
``kernel_speed.attention_rate``), plus a start-up cost and the layer's other work: with
FlashAttention-4 on an H100 or H200 a 2-block run fits one 10-minute call up to 5M; 6M-8M need a
machine without that limit (``--budget-s 3600``). ``--next`` runs the queue's pending items
(``gpu_queue``), each a child call.
Each stage writes ``<stage>.json`` and ``<stage>.md`` (``<stage>[-<select>][-<lengths>].*``) under
``docs/benchmarks/gpu/`` or ``--out`` (device, torch, driver, cuDNN, the backend ``auto`` runs, date,
the exact command); every GPU call also rewrites ``titan_upipe/resources/gpu_image_packages.txt`` (and the
attention stage ``titan_upipe/resources/kernel_speed.csv``) and copies them into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from titan_upipe.attention.backends import AUTO_ORDER, BACKENDS, choose_backend, current_arch
from titan_upipe.costs.kernel_speed import (
    KERNEL_SPEED_CSV,
    latest_arch,
    measured_order,
    read_rows,
)
from titan_upipe.spec.units import format_length
from titan_upipe.toolkit.cli_args import ToolParser, parse_length
from titan_upipe.tools import gpu_ring_documents
from titan_upipe.tools.gpu_attention import (
    DENSE_LENGTHS,
    case_key,
    layer_attention_seconds,
    plan_cases,
    run_attention_stage,
    usable_backends,
)
from titan_upipe.tools.gpu_context import REPO, replan_report
from titan_upipe.tools.gpu_kernels import CHECKS, run_kernel_checks
from titan_upipe.tools.gpu_queue import (
    KEEP_ATTENTION,
    KEEP_ATTENTION_WORD,
    QueueItem,
    build_queue,
    load_reports,
    next_item,
    pending,
)
from titan_upipe.tools.gpu_reports import StageReport, environment, refresh_image_packages
from titan_upipe.tools.gpu_runs import (  # the emulator stages' runs; Run and the rest importable from here
    MEMORY_LAYERS,
    TIMED_STEPS,
    Run,
    child_env,
    emulator_argv,
    llama_run,
    run_emulator_stage,
    schedule_within,
)
from titan_upipe.tools.gpu_wheels import (
    canonical,
    carried_versions,
    check_closure,
    check_manifest,
    read_image,
    read_lock,
)
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_0_2.registry import register_plugin

REPORT_DIR = REPO / "docs" / "benchmarks" / "gpu"
STAGES = ("kernels", "attention", "memory", "speed", "tsp", "ring_documents")
DEFAULT_BUDGET_S = 540

LENGTHS = {name: parse_length(name)
           for name in ("128K", "256K", "512K", "1M", "2M", "2.5M", "3M", "4M", "5M", "6M", "7M", "8M")}
MEMORY_LLAMA_LENGTHS = ("128K", "1M", "2M", "3M", "4M", "5M", "6M", "7M", "8M")
"""128K-5M from the recipes, then upward (the 5M recipe with a longer seq_len) until it no longer fits."""
MEMORY_QWEN_LENGTHS = ("1M", "2M", "3M", "4M", "5M", "6M")
MEMORY_QWEN_ONE_NODE_LENGTHS = ("1M", "2M", "2.5M")
"""Qwen3-32B UPipe C=8 on one 8-GPU node (issue 34): its ``upipe_8gpu`` recipes."""
QWEN_ONE_NODE_WORK = 2.0
"""Attention work per rank and layer of Qwen3-32B over 8 GPUs against Llama3-8B's over 8 (the
estimates' unit): 64 / 8 query heads per rank against 32 / 8, the same head dim and tokens."""
SPEED_LENGTHS = ("128K", "1M", "2M")
TSP_LENGTHS = ("128K", "1M", "2M", "3M", "4M")
"""TSP (issue 19) on Llama3-8B over 8 GPUs: its recipes (128K-2M), then upward until it no longer fits."""
STARTUP_S = 30.0
"""Process start, model build and first-use kernel compilation of one emulator run: 25 s at 128K on
an H100 (2026-11-23). With the per-layer terms below it gives the H200's FlashAttention-4 runs of
2026-11-27 within 5 %: 46 s planned for Llama3-8B at 1M (44-47 s measured), 99 s for Qwen3-32B
UPipe-in-USP at 2M (94 s)."""
OTHER_S_PER_LAYER_M = 1.5
"""A layer's time besides its attention (projections, MLP, norms, offload copies), per step and
million tokens, linear in the length: 1.43 s on the H200 (Llama3-8B at 1M, 2 blocks, 2026-11-27)."""
KEEP_ATTENTION_LENGTHS = ("1M",)
"""The speed stage's lengths that also run with ``gpu_queue.KEEP_ATTENTION`` (``--select keep_attention``)."""


def run_estimate_s(length: str, work: float = 1.0, backend: str | None = None, arch: str | None = None) -> float:
    """Wall seconds of one emulator run of one step of ``MEMORY_LAYERS`` blocks at ``length``: the
    start-up, then per block its attention (``attention_seconds_per_layer``) times ``work`` (the
    attention work per rank and layer relative to Llama3-8B over 8 GPUs) and the rest of the block."""
    rest = OTHER_S_PER_LAYER_M * LENGTHS[length] / 2**20
    return STARTUP_S + MEMORY_LAYERS * (work * attention_seconds_per_layer(length, backend, arch) + rest)


def attention_seconds_per_layer(length: str, backend: str | None = None, arch: str | None = None) -> float:
    """One layer's attention of Llama3-8B over 8 GPUs at ``length`` under full activation
    checkpointing (two forwards and a backward): one rank's causal-attention FLOPs over the TFLOP/s
    the kernel table gives ``backend`` (default: what ``auto`` runs, ``fastest_backend``) on ``arch``
    (default: ``planning_arch``), ``gpu_attention.layer_attention_seconds``."""
    arch = arch or planning_arch()
    return layer_attention_seconds(LENGTHS[length], backend or fastest_backend(arch), arch)


def planning_arch() -> str | None:
    """The GPU architecture runs are planned for: this GPU's; on a machine without one, that of the
    newest rows of ``titan_upipe/resources/kernel_speed.csv``."""
    return current_arch() or latest_arch()


def attention_backends() -> list[str]:
    """The backends the attention stage times: on a GPU those usable there; elsewhere those the GPU
    machines will have (torch's own kernels, and packages carried by the wheel lock or in the image)."""
    if torch.cuda.is_available():
        return usable_backends("cuda")[0]
    there = {**read_image(), **carried_versions(read_lock())}
    return [name for name in AUTO_ORDER
            if canonical(getattr(BACKENDS[name], "distribution", "torch")) in {"torch", *there}]


ATTENTION_LENGTHS = ("128K", "1M")
"""The attention stage's lengths by default; 2M where asked (``--lengths 2M``: the queue's last item)."""


def attention_lengths(lengths: tuple[str, ...] | None) -> dict[str, int]:
    """The attention stage's lengths of ``--lengths`` (none where it names only emulator lengths)."""
    return {x: DENSE_LENGTHS[x] for x in (lengths or ATTENTION_LENGTHS) if x in DENSE_LENGTHS}


def ring_lengths(lengths: tuple[str, ...] | None) -> dict[str, int]:
    """The ring_documents stage's lengths of ``--lengths`` (all of them without it)."""
    return {x: gpu_ring_documents.RING_LENGTHS[x] for x in (lengths or gpu_ring_documents.RING_LENGTHS)
            if x in gpu_ring_documents.RING_LENGTHS}


def plan_runs(stage: str, lengths: tuple[str, ...] | None = None, select: str | None = None) -> list[Run]:
    """The runs of one stage, in order (``lengths`` narrows the emulator and attention stages,
    ``select`` keeps the runs whose name holds each of its words, ``selected``)."""
    return [r for r in _stage_runs(stage, lengths) if selected(r.name, select)]


def selected(name: str, select: str | None) -> bool:
    """``--select``: the runs whose name holds every word of ``select`` (``'llama3_8b upipe'``: both
    words); a run named with ``KEEP_ATTENTION_WORD`` only where ``select`` names it, so that a
    stage's plain runs and its keep_attention runs are separate calls with separate reports."""
    words, wanted = name.split(), (select or "").split()
    return set(wanted) <= set(words) and (KEEP_ATTENTION_WORD not in words or KEEP_ATTENTION_WORD in wanted)


def keep_attention_run(run: Run) -> Run:
    """``run`` with ``KEEP_ATTENTION``, named ``<run> keep_attention`` (its estimate kept: the
    full-recompute one is the longer)."""
    argv = list(run.argv)
    at = argv.index(KEEP_ATTENTION[0])  # every emulator run sets it (gpu_runs.emulator_argv: off)
    argv[at + 1] = KEEP_ATTENTION[1]
    return replace(run, name=f"{run.name} {KEEP_ATTENTION_WORD}", argv=tuple(argv))


def _stage_runs(stage: str, lengths: tuple[str, ...] | None) -> list[Run]:
    def wanted(candidates: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(x for x in candidates if lengths is None or x in lengths)

    if stage == "attention":
        rows, arch = read_rows(), planning_arch()
        return [Run("attention", case.name, estimate_s=case.estimate_s(rows, arch), length=case.length)
                for case in plan_cases("cuda", attention_backends(), attention_lengths(lengths))]
    if stage == "kernels":
        return [Run("kernels", name, estimate_s=est) for name, est in
                (("contract", 60), ("varlen", 30), ("fused_ce", 30), ("offload_streams", 10), ("kept_attention", 20),
                 ("bf16_parity", 60), ("compile", 90))]
    if stage == "memory":
        # length-major: a call that covers the short lengths covers both methods there
        runs = [llama_run("memory", method, length, run_estimate_s(length), stop_group=method)
                for length in wanted(MEMORY_LLAMA_LENGTHS) for method in ("ulysses", "upipe")]
        # Qwen3-32B's 64 heads over 16 GPUs: the same attention work per rank and layer as
        # Llama3-8B's 32 heads over 8, so the same per-layer estimate.
        runs += [Run("memory", f"qwen3_32b upipe_usp {length}",
                     emulator_argv(f"configs/qwen3_32b/upipe_usp_{length.lower()}.toml", 16),
                     run_estimate_s(length), "upipe_usp", length,
                     "qwen3_upipe_usp") for length in wanted(MEMORY_QWEN_LENGTHS)]
        # One node: the 2.5M recipe keeps its last 2 inputs on the device, which in a 2-block run
        # is every input (nothing offloaded, and the extrapolation would add a resident input per
        # block); the run offloads them all, as the full model's low blocks, whose peak it is.
        runs += [Run("memory", f"qwen3_32b upipe_8gpu {length}",
                     emulator_argv(f"configs/qwen3_32b/upipe_8gpu_{length.lower().replace('.', '_')}.toml", 8,
                               "--activation_checkpoint.resident_blocks", "0"),
                     run_estimate_s(length, work=QWEN_ONE_NODE_WORK), "upipe_8gpu", length,
                     "qwen3_upipe_8gpu") for length in wanted(MEMORY_QWEN_ONE_NODE_LENGTHS)]
        return runs
    if stage == "speed":
        runs = [llama_run("speed", method, length, run_estimate_s(length), steps=TIMED_STEPS, startup_s=STARTUP_S)
                for length in wanted(SPEED_LENGTHS) for method in ("ulysses", "upipe")]
        return runs + [keep_attention_run(r) for r in runs if r.length in KEEP_ATTENTION_LENGTHS]
    if stage == "tsp":
        return [llama_run("tsp", "tsp", length, run_estimate_s(length), stop_group="tsp", steps=TIMED_STEPS,
                          startup_s=STARTUP_S) for length in wanted(TSP_LENGTHS)]
    if stage == "ring_documents":
        # one process for the whole call: the start-up (and first-use compilation) rides on its first case
        cases = gpu_ring_documents.plan_cases("cuda", ring_lengths(lengths))
        return [Run("ring_documents", case.name, length=case.length,
                    estimate_s=case.estimate_s() + (gpu_ring_documents.STARTUP_S if i == 0 else 0.0))
                for i, case in enumerate(cases)]
    raise ValueError(f"unknown stage {stage!r}: valid stages are {', '.join(STAGES)}, all")


# --- the CLI -----------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = ToolParser(prog="python -m titan_upipe.gpu_suite", description=__doc__.splitlines()[0])
    parser.add_argument("--stage", default="all", choices=[*STAGES, "all"])
    parser.add_argument("--lengths", default=None,
                        help=f"comma-separated lengths for the emulator, attention and ring_documents stages, "
                             f"of {', '.join(LENGTHS)}")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds this call may use, all stages together (default {DEFAULT_BUDGET_S})")
    parser.add_argument("--out", default=str(REPORT_DIR),
                        help=f"report folder (default {REPORT_DIR}; on the device tool's machine use $OUT, the "
                             "folder that comes back)")
    parser.add_argument("--select", default=None, metavar="WORDS",
                        help="emulator stages: only the runs whose name holds every one of WORDS (e.g. 'llama3_8b "
                             "upipe'); the speed stage's keep_attention runs only with 'keep_attention'")
    parser.add_argument("--next", action="store_true",
                        help="the GPU queue: run the highest-priority measurements no report shows yet, within "
                             "--budget-s (titan_upipe.tools.gpu_queue); with --dry-run, print the queue")
    parser.add_argument("--dry-run", action="store_true",
                        help="check arguments, configs, the wheel closure and manifest and print the plan; run nothing")
    parser.add_argument("--replan", metavar="REPORT_JSON", type=Path, default=None,
                        help="recompute the planner columns of a memory report (JSON and Markdown, in place) "
                             "with this checkout's planner; runs nothing, needs no GPU")
    args = parser.parse_args(argv)
    if (text := args.lengths) is not None:  # "1M,131072" -> ("1M", "128K"), read by the one length parser
        try:
            args.lengths = tuple(format_length(parse_length(x)) for x in text.split(",") if x.strip())
        except ValueError as err:
            parser.error(f"--lengths: {err}")
        if not args.lengths or any(x not in LENGTHS for x in args.lengths):
            parser.error(f"--lengths {text!r}: valid lengths are {', '.join(LENGTHS)}")
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s:g}")
    if args.next and (args.stage != "all" or args.lengths or args.select):
        parser.error("--next picks its own stages, lengths and runs: drop --stage, --lengths and --select")
    if args.stage == "attention" and args.lengths and not set(args.lengths) & set(DENSE_LENGTHS):
        parser.error(f"--lengths for the attention stage: {', '.join(DENSE_LENGTHS)}")
    if args.stage == "ring_documents" and args.lengths and not ring_lengths(args.lengths):
        parser.error(f"--lengths for the ring_documents stage: {', '.join(gpu_ring_documents.RING_LENGTHS)}")
    if args.select is not None and args.stage in ("attention", "ring_documents", "all"):
        parser.error(f"--select narrows the emulator stages (memory, speed, tsp) and the kernels stage's checks, not "
                     f"--stage {args.stage}")
    if args.select is not None and args.stage == "kernels" and not set(args.select.split()) <= set(CHECKS):
        parser.error(f"--select for the kernels stage names checks: {', '.join(CHECKS)}")
    return args


def selected_stages(stage: str) -> tuple[str, ...]:
    return STAGES if stage == "all" else (stage,)


def call_estimate_s(stage: str, lengths: tuple[str, ...], select: str | None) -> float:
    """The time estimate of one ``--stage``/``--lengths``/``--select`` call (its runs together)."""
    return sum(run.estimate_s for run in plan_runs(stage, lengths or None, select))


def call_start_s(stage: str, lengths: tuple[str, ...]) -> float | None:
    """What an attention call needs to make progress: its first case (the stage continues an
    earlier call's report); None for the other stages (a call is its runs together)."""
    runs = plan_runs(stage, lengths or None) if stage == "attention" else []
    return runs[0].estimate_s if runs else None


def fastest_backend(arch: str | None = None) -> str:
    """What ``auto`` runs on this GPU for the recipes (bf16, head_dim 128); on a machine without one,
    the first of ``auto``'s order on ``arch`` (default: the newest measured architecture) that the GPU
    machines will have (``attention_backends``)."""
    if torch.cuda.is_available():
        return choose_backend("auto", torch.bfloat16, head_dim=128).name
    order = measured_order(arch or latest_arch(), AUTO_ORDER, head_dim=128, dtype=torch.bfloat16)
    there = attention_backends()
    return next((name for name in order if name in there), order[0])


def gpu_queue(out: Path) -> tuple[list[QueueItem], list[dict]]:
    """The queue's items and the reports they are judged by (committed and this call's)."""
    reports = load_reports([REPORT_DIR, out])
    return build_queue(call_estimate_s, fastest_backend(), AUTO_ORDER, call_start_s), reports


def print_queue(out: Path) -> None:
    items, reports = gpu_queue(out)
    print(f"GPU queue ({len(pending(items, reports))} of {len(items)} pending; the reports in {REPORT_DIR} and "
          f"{out} are its state):")
    for item in items:
        state = "done   " if item.done(reports) else "pending"
        print(f"  {state} ~{item.estimate_s:6.0f} s  {item.name}  (--stage ... {' '.join(item.argv)})")


def run_next(args: argparse.Namespace, deadline: float) -> int:
    """``--next``: queue items in priority order, each in a child call of the suite, while one fits."""
    attempted: set[str] = set()
    codes = []
    while True:
        remaining = deadline - time.monotonic()
        items, reports = gpu_queue(Path(args.out))
        item = next_item(items, reports, remaining, attempted)
        if item is None:
            break
        attempted.add(item.name)
        print(f"[next] {item.name} (~{item.estimate_s:.0f} s of {remaining:.0f} s left)", flush=True)
        child = [sys.executable, "-m", "titan_upipe.gpu_suite", *item.argv, "--budget-s", f"{remaining:.0f}",
                 "--out", args.out]
        codes.append(subprocess.run(child, cwd=REPO, env=child_env()).returncode)
    items, reports = gpu_queue(Path(args.out))
    left = pending(items, reports)
    print(f"[next] {len(attempted)} item(s) run in this call; {len(left)} pending"
          + (f", next: {left[0].name} (~{left[0].estimate_s:.0f} s)" if left else ""), flush=True)
    return 0 if all(code == 0 for code in codes) else 1


def dry_run(args: argparse.Namespace) -> list[str]:
    """Everything a CPU machine can check; returns the problems (empty: ready)."""
    problems = []
    if args.next:
        print_queue(Path(args.out))
    for stage in selected_stages(args.stage):
        runs = plan_runs(stage, args.lengths, args.select)
        now, later = schedule_within(runs, args.budget_s)
        print(f"stage {stage}: {len(runs)} runs, {len(now)} within {args.budget_s:.0f} s")
        for run in runs:
            where = "now  " if run in now else "later"
            print(f"  {where} ~{run.estimate_s:6.0f} s  {run.name}" + (f"  ({' '.join(run.argv[1:])})" if run.argv else ""))
            if run.argv:
                argv = list(run.argv)
                config = argv[argv.index("--job.config_file") + 1]
                if not (REPO / config).exists():
                    problems.append(f"{run.name}: config {config} does not exist")
                    continue
                try:
                    parse_config(["--job.config_file", str(REPO / config)])
                except Exception as exc:  # a config that does not parse is a problem to report
                    problems.append(f"{run.name}: {config} does not parse: {exc}")
        if stage not in ("kernels", "attention") and not now:
            problems.append(f"stage {stage}: no run fits --budget-s {args.budget_s:g}")
    for check in (check_closure, lambda: check_manifest(REPO / ".whl")):
        wheel_problems, wheel_lines = check()
        print("\n".join(wheel_lines))
        problems += wheel_problems
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    register_plugin()
    if args.replan is not None:
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        report = replan_report(args.replan, when)
        json_path, md_path = report.write(args.replan.parent)
        print(f"replanned: {json_path}, {md_path}")
        return 0
    if args.dry_run:
        problems = dry_run(args)
        for problem in problems:
            print(f"problem: {problem}", file=sys.stderr)
        print("dry run: " + ("ready" if not problems else f"{len(problems)} problem(s)"))
        return 1 if problems else 0
    if not torch.cuda.is_available():
        print("titan_upipe.gpu_suite: no CUDA device here; run it on a GPU machine, or use --dry-run to check "
              "the arguments, configs, wheels and plan", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s
    print(f"image packages: {refresh_image_packages(Path(args.out))}", flush=True)
    if args.next:
        return run_next(args, deadline)
    if args.stage == "all":
        return run_all_in_children(args, deadline)
    report = run_stage(args.stage, args, argv, deadline=deadline)
    print(f"[{args.stage}] {'ok' if report.ok else 'FAILED'}: {report.paths(Path(args.out))}")
    return 0 if report.ok else 1


def run_all_in_children(args: argparse.Namespace, deadline: float) -> int:
    """``--stage all``: each stage in a process of its own (no CUDA context or cached blocks of one
    stage skew the next one's memory), all within the one deadline of this call."""
    codes = []
    for stage in STAGES:
        remaining = deadline - time.monotonic()
        if remaining < 30:
            print(f"[{stage}] not started: the call's --budget-s is spent; run --stage {stage}", flush=True)
            codes.append(1)
            continue
        child = [sys.executable, "-m", "titan_upipe.gpu_suite", "--stage", stage, "--budget-s", f"{remaining:.0f}",
                 "--out", args.out, *(["--lengths", ",".join(args.lengths)] if args.lengths else [])]
        codes.append(subprocess.run(child, cwd=REPO, env=child_env()).returncode)
    return 0 if all(code == 0 for code in codes) else 1


def run_stage(stage: str, args: argparse.Namespace, argv: list[str], device: str = "cuda",
              deadline: float | None = None) -> StageReport:
    """One stage; its report is written to ``args.out`` after every run, not only at the end."""
    report = StageReport(stage, environment(argv), lengths=args.lengths if stage != "kernels" else None,
                         select=args.select)
    out = Path(args.out)
    if stage == "kernels":
        def save_checks(results: list[dict]) -> None:
            report.results = results
            report.write(out)

        report.results = run_kernel_checks(device, on_result=save_checks,
                                           only=tuple(args.select.split()) if args.select else None)
        report.write(out)
        return report
    if stage == "attention":
        # An earlier call's report of the same lengths on this GPU is continued, not redone: its
        # timed cases are kept and not timed again (the queue's progress over several calls).
        earlier = [r for r in _same_report(report, out) if "fwd_ms" in r or r.get("oom")]

        def save_cases(results: list[dict], not_run: list[dict]) -> None:
            report.results = earlier + [{**r, "device": report.environment.get("device", device)} for r in results]
            report.not_run = not_run
            report.write(out)
            copy = out / KERNEL_SPEED_CSV.name
            if device == "cuda" and KERNEL_SPEED_CSV.exists() and copy.resolve() != KERNEL_SPEED_CSV.resolve():
                copy.write_text(KERNEL_SPEED_CSV.read_text())  # the folder that comes back from a device machine

        # (on a CPU, make test's run: the stage's tiny CPU lengths, whatever --lengths says)
        run_attention_stage(device, deadline, report.environment, save_cases,
                            attention_lengths(args.lengths) if device == "cuda" else None,
                            measured={case_key(r) for r in earlier})
        return report
    if stage == "ring_documents":
        def save_ring(results: list[dict], not_run: list[dict]) -> None:
            report.results, report.not_run = results, not_run
            report.write(out)

        # (on a CPU, make test's run: the stage's tiny CPU cases, whatever --lengths says)
        gpu_ring_documents.run_ring_documents_stage(device, deadline, save_ring,
                                                    ring_lengths(args.lengths) if device == "cuda" else None)
        return report
    runs = plan_runs(stage, args.lengths, args.select)
    if deadline is None:
        runs, later = schedule_within(runs, args.budget_s)
        report.not_run = _not_run(stage, later)

    def save(results: list[dict], not_started: list[Run]) -> None:
        report.results, report.not_run = results, _not_run(stage, not_started)
        report.write(out)

    report.results = run_emulator_stage(stage, runs, deadline, save)
    report.write(out)
    return report


def _same_report(report: StageReport, out: Path) -> list[dict]:
    """The results of this call's report as an earlier call on the same device left it (in ``out``,
    else committed in ``REPORT_DIR``); none where there is none."""
    for folder in (out, REPORT_DIR):
        path = report.paths(folder)[0]
        if path.exists():
            data = json.loads(path.read_text())
            if data["environment"].get("device") == report.environment.get("device"):
                return data["results"]
    return []


def _not_run(stage: str, runs: list[Run]) -> list[dict]:
    return [{"name": r.name, "estimate_s": r.estimate_s,
             "command": f"python -m titan_upipe.gpu_suite --stage {stage} --lengths {r.length}"} for r in runs]


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.exit(main())
