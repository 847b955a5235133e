"""Selective activation checkpointing against full and none, per context-parallel converter.

Part 1 (``--part measure``): one rank of a CPU job measured with the rank emulator
(``titan_upipe.emulate.measure_step``, fake process group, live-tensor tracker): the Llama3 debug
flavor with ``--layers`` blocks, 4 ranks, bf16 FSDP, tiled MLP/RMSNorm, fused RoPE/CE, every
converter, the AC settings of ``CASES``. The settings ``checks.training.check_activation_checkpointing`` refuses are measured
too (that check is bypassed here, nothing else). Next to each measurement, the planner's
prediction (``--device cpu``): ``none`` and ``full`` directly, selective layer AC as
:func:`selective_estimate` (the planner does not model it).

Part 2 (``--part plan``): the planner for the shipped Llama3-8B recipes (``configs/llama3_8b``)
under full AC with offload (as shipped), full without offload, none, and selective layer AC
``"2"`` (:func:`selective_estimate`); ``--part fit``: the longest ``seq_len`` each fits in 80 GiB.

    python scripts/bench_selective_ac.py --part measure     # ~25 min on a loaded 2-core CPU
    python scripts/bench_selective_ac.py --part plan        # seconds
    python scripts/bench_selective_ac.py --part fit         # longest seq_len within --gpu-mem (80) GiB

Results: docs/benchmarks/selective_ac.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("TITAN_UPIPE_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torchtitan.distributed.activation_checkpoint as titan_ac  # noqa: E402

from titan_upipe.plan.block import attention_terms, block_retained  # noqa: E402
from titan_upipe.plan.sizes import StepSizes  # noqa: E402
from titan_upipe.plan.step import plan  # noqa: E402
from titan_upipe.torchtitan_0_2 import (
    checks,  # noqa: E402
    parallelize,
)
from titan_upipe.torchtitan_0_2.checks import training as training_checks  # noqa: E402
from titan_upipe.torchtitan_0_2.config_parse import parse_config  # noqa: E402
from titan_upipe.torchtitan_0_2.job_plan import plan_input_from_job_config  # noqa: E402
from titan_upipe.torchtitan_0_2.registry import register_plugin  # noqa: E402

GIB = 1024**3
BASE = "configs/debug/llama3_upipe_transforms.toml"
TRANSFORMS = "tiled_mlp,tiled_rmsnorm,fused_rope,fused_ce"

OP_LIST = "selective op + TorchTitan's save list"
# (label, converter, context_parallel_degree, ulysses_degree, AC settings) of part 1 (world size 4)
CASES = [
    ("upipe", "upipe", 4, 0, ["none", "full", "full + offload", "selective 2", "selective op", OP_LIST]),
    ("ulysses", "ulysses", 4, 0, ["full", "selective 2", "selective op", OP_LIST]),
    ("ring", "ring", 4, 0, ["full", "selective 2", "selective op"]),
    ("usp 2x2", "usp", 4, 2, ["full", "selective 2", "selective op"]),
    ("FSDP only", "", 1, 0, ["full", "selective 2"]),
]
AC_SETTINGS = {
    "none": ["--activation_checkpoint.mode", "none", "--activation_checkpoint.no-cpu_offload"],
    "full": ["--activation_checkpoint.mode", "full", "--activation_checkpoint.no-cpu_offload"],
    "full + offload": ["--activation_checkpoint.mode", "full", "--activation_checkpoint.cpu_offload"],
    "selective 2": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2",
                    "--activation_checkpoint.no-cpu_offload"],
    "selective op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
                     "--activation_checkpoint.no-cpu_offload"],
    # not a setting of this plugin: TorchTitan's Llama3 parallelize passes this save list; the plugin's passes none
    OP_LIST: ["--activation_checkpoint.mode", "selective",
              "--activation_checkpoint.selective_ac_option", "op", "--activation_checkpoint.no-cpu_offload"],
}


def titan_save_list() -> set:
    """TorchTitan's Llama3 op-SAC save list, plus the CPU SDPA kernel (the list names the CUDA ones)."""
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

    return {*_op_sac_save_list, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def job_config(config: str, overrides: list[str]):
    return parse_config(["--job.config_file", config, *overrides])


def selective_estimate(full_job, none_job, frequency: int) -> int:
    """Peak bytes under TorchTitan's selective layer AC (every ``frequency``-th block wrapped in a
    full checkpoint, the others not checkpointed), from the planner's moments for full AC without
    offload (``full_job``, a PlanInput): each moment of block i, and the loss, holds for every
    un-checkpointed block below it that block's no-AC activations (``block_retained`` of
    ``none_job``, the same job with ``ac_mode = "none"``) instead of its checkpointed input ``u``.
    Blocks are counted as TorchTitan counts them: block j is checkpointed when (j + 1) % k == 0."""
    full = plan(full_job)
    sizes = StepSizes.of(none_job)
    extra = sum(block_retained(sizes, attention_terms(sizes)).values()) - sizes.hidden
    n = full_job.model.n_layers

    def unckpt_below(i: int) -> int:
        return sum(1 for j in range(i) if (j + 1) % frequency != 0)

    best = 0
    for m in full.moments:
        found = re.match(r"block (\d+) ", m.where)
        below = unckpt_below(int(found.group(1))) if found else (unckpt_below(n) if m.phase == "loss" else 0)
        best = max(best, m.total + below * extra)
    return best


def with_layers(job, layers: int):
    """The PlanInput ``job`` with ``layers`` blocks (the emulator builds fewer than the flavor's)."""
    return dataclasses.replace(job, model=dataclasses.replace(job.model, n_layers=layers))


def measure(label: str, converter: str, cp: int, ulysses: int, setting: str, seq_len: int, layers: int) -> dict:
    """One emulated rank's tracked total peak, and the planner's prediction for it."""
    from titan_upipe.emulate import measure_step

    converters = f"{converter},{TRANSFORMS}" if converter else TRANSFORMS
    seq = seq_len if cp > 1 else seq_len // 4  # the same tokens per rank without CP (4 data-parallel ranks)
    common = ["--training.seq_len", str(seq), "--training.mixed_precision_param", "bfloat16",
              "--transforms.ce_backend", "torch", "--transforms.mlp_tile_tokens", "1024",
              "--transforms.rmsnorm_tile_tokens", "1024", "--parallelism.context_parallel_degree", str(cp),
              "--upipe.ulysses_degree", str(ulysses), "--model.converters", converters]
    jc = job_config(BASE, common + AC_SETTINGS[setting])
    titan_ac._layer_sac_count = 0  # TorchTitan's module-level block counter (one model per process in training)
    apply_ac = parallelize.apply_ac
    if setting == OP_LIST:
        parallelize.apply_ac = functools.partial(apply_ac, op_sac_save_list=titan_save_list())
    start = time.time()
    try:
        m = measure_step(jc, 4, fake=True, n_layers=layers, full_layers=layers, time_attention=False)
    finally:
        parallelize.apply_ac = apply_ac
    seconds = time.time() - start

    def planned(name: str):
        return with_layers(plan_input_from_job_config(job_config(BASE, common + AC_SETTINGS[name]), 4, "cpu"), layers)

    predicted = None
    if setting in ("none", "full", "full + offload", "selective op"):  # op without a save list is full AC
        predicted = plan(planned("full" if setting == "selective op" else setting)).peak_gpu_bytes
    elif setting == "selective 2":
        predicted = selective_estimate(planned("full"), planned("none"), 2)
    return {"measured": m.total_peak_bytes, "predicted": predicted, "seconds": seconds,
            "peak_phase": max(m.phase_peak_bytes, key=m.phase_peak_bytes.get)}


def part_measure(args) -> None:
    # measure what is refused too
    checks.JOB_CHECKS = tuple(c for c in checks.JOB_CHECKS if c is not training_checks.check_activation_checkpointing)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, seq_len {args.seq_len} (CP 4; FSDP only: "
          f"{args.seq_len // 4}), batch 2, {args.layers} blocks, bf16, Llama3 debug flavor", flush=True)
    print("| case | AC | measured B | predicted B | error | peak phase |", flush=True)
    print("|---|---|---|---|---|---|", flush=True)
    for label, converter, cp, ulysses, settings in CASES:
        if args.cases and label.split()[0] not in args.cases:
            continue
        for setting in settings:
            if args.settings and setting not in args.settings:
                continue
            r = measure(label, converter, cp, ulysses, setting, args.seq_len, args.layers)
            pred = r["predicted"]
            cells = (f"{pred:,} | {(pred - r['measured']) / r['measured']:+.2%}" if pred else "– | –")
            print(f"| {label} | {setting} | {r['measured']:,} | {cells} | {r['peak_phase']} |  "
                  f"<!-- {r['seconds']:.0f} s -->", flush=True)


RECIPES = ["upipe_128k", "upipe_1m", "upipe_5m", "ulysses_1m", "ring_1m", "usp_1m", "upipe_usp_1m"]


def part_plan(args) -> None:
    print("| recipe | ranks | full + offload (shipped) | full | none | selective 2 (estimate) | sel. 2 − full |")
    print("|---|---|---|---|---|---|---|")
    for name in args.recipes:
        config = f"configs/llama3_8b/{name}.toml"
        jc = job_config(config, [])
        world = jc.parallelism.context_parallel_degree
        peaks = {}
        for setting in ("full + offload", "full", "none"):
            peaks[setting] = plan(plan_input_from_job_config(job_config(config, AC_SETTINGS[setting]), world)).peak_gpu_bytes
        sel = selective_estimate(plan_input_from_job_config(job_config(config, AC_SETTINGS["full"]), world),
                                 plan_input_from_job_config(job_config(config, AC_SETTINGS["none"]), world), 2)
        cells = [f"{peaks[s] / GIB:.2f}" for s in ("full + offload", "full", "none")]
        print(f"| {name} | {world} | {' | '.join(cells)} | {sel / GIB:.2f} | +{(sel - peaks['full']) / GIB:.2f} |")


def part_fit(args) -> None:
    """Longest ``seq_len`` (multiples of 64K) whose peak + the runtime reserve fits ``--gpu-mem``."""
    print(f"| 8 ranks | none | selective 2 | full |  (longest seq_len within {args.gpu_mem:g} GiB, multiples of 64K)")
    print("|---|---|---|---|")
    for name in ("upipe_1m", "ulysses_1m", "ring_1m"):
        config = f"configs/llama3_8b/{name}.toml"
        jobs = {s: plan_input_from_job_config(job_config(config, AC_SETTINGS[s]), 8) for s in ("none", "full")}
        longest = {}
        for seq in range(65536, 4 * 2**20 + 1, 65536):
            at = {s: dataclasses.replace(job, seq_len=seq) for s, job in jobs.items()}
            peaks = {"none": plan(at["none"]).peak_gpu_bytes, "full": plan(at["full"]).peak_gpu_bytes,
                     "selective 2": selective_estimate(at["full"], at["none"], 2)}
            for s, peak in peaks.items():
                if peak + at["full"].reserve <= args.gpu_mem * GIB:
                    longest[s] = seq
        print(f"| {name.split('_')[0]} | " + " | ".join(f"{longest.get(s, 0) // 1024}K" for s in
                                                       ("none", "selective 2", "full")) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["measure", "plan", "fit"], required=True)
    parser.add_argument("--gpu-mem", type=float, default=80.0, help="--part fit: GiB per GPU")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cases", nargs="*", default=None, help="first word of the case labels (default: all)")
    parser.add_argument("--settings", nargs="*", default=None, help="AC settings to run (default: each case's)")
    parser.add_argument("--recipes", nargs="*", default=RECIPES)
    args = parser.parse_args()
    register_plugin()
    {"measure": part_measure, "plan": part_plan, "fit": part_fit}[args.part](args)


if __name__ == "__main__":
    main()
