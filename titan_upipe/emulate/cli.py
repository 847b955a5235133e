"""Rank emulator: one rank of an N-rank context-parallel job in a single process.

    python -m titan_upipe.emulate --job.config_file X.toml --cp-world N [--n-layers K] [--seq-len S]
        [--full-layers L] [--steps N] [--warmup-steps K] [--[no-]compile-pass] [--a2a-gbps B] [--p2p-gbps B]
        [--rank R] [--json] [--section.key value ...]

Builds the configured model for one rank (TorchTitan's train spec, converters, AC, FSDP,
optimizer, loss) and runs a training step with real kernels and transforms on torch's fake
process-group backend: collectives return at once with correctly shaped, uninitialised
outputs, so no peers are needed (numerics are garbage, memory and time are real).
Reports peak allocated/reserved memory, the state (params, grads, optimizer), activations,
offloaded host bytes, and the step time split into blocks, attention, other compute and
communication modeled from the all-to-all bytes at 150 GB/s (NVLink-class; ``--a2a-gbps B``
adds the same at a second bandwidth). With ``--n-layers K`` only K blocks are built and the
flavor's full depth is extrapolated (use K >= 2).

Times: ``--steps N`` runs N steps, the first ``--warmup-steps`` (default 1) untimed, and reports
the median timed step; with one step (the default, enough for memory) nothing is timed warm and
the report says so. Before step 1 the attention kernels run once (their first-use compilation,
``compile_s``), by default where a step is timed. See ``titan_upipe.emulate`` for the exact
definitions.

Launched under torchrun (``torchrun --nproc_per_node N -m titan_upipe.emulate ...``,
``WORLD_SIZE`` > 1) it measures the real job instead (gloo on CPU, nccl on GPU), one rank per
process, and rank 0 prints the same report: that is how the emulator is validated against a
real run.

TorchTitan overrides (``--training.seq_len 4096``, ``--upipe.heads_per_stage 8`` ...)
pass through. CUDA is used when available (as ``titan_upipe.check`` does), else the CPU;
``PYTORCH_CUDA_ALLOC_CONF`` defaults to ``expandable_segments:True`` as in ``scripts/run_train.sh``.
``--summarize A.json B.json ...`` tabulates ``--json`` outputs next to the paper's Llama3-8B
Table 4 (peak memory) and Table 5 (step time) from ``titan_upipe/resources/paper_tables.csv``.

A command or a job that cannot run (``--cp-world 0``, a world size the degrees do not fit, a
length the layout cannot shard, a job the memory planner predicts will not fit this machine with
the blocks built: ``torchtitan_0_2.memory_guard``) is one line, ``titan_upipe.emulate: error: ...``, printed once
(rank 0 under torchrun) before any process group starts, exit status 2; with ``--json`` a
memory refusal is also a record with ``"oom": true``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from titan_upipe.emulate.measure import DEFAULT_A2A_GBPS, measure_step
from titan_upipe.errors import ConfigError, exit_once
from titan_upipe.resources.paper_tables import LENGTH_COLUMNS, PAPER_TABLES_CSV, cell_value, paper_rows
from titan_upipe.spec.cp_layout import cp_mode
from titan_upipe.toolkit.cli_args import (
    ToolParser,
    non_negative_int,
    positive_int,
    positive_size,
    token_count,
)
from titan_upipe.torchtitan_0_2.load_job import load_job
from titan_upipe.torchtitan_0_2.memory_guard import (
    MemoryDoesNotFit,
    check_memory_fits,
    free_machine_memory,
    local_ranks,
)
from titan_upipe.torchtitan_0_2.rank_model import rank_device

TOOL = "titan_upipe.emulate"
"""The command's name in its error line."""


def _parse(argv: list[str]):
    parser = ToolParser(prog=f"python -m {TOOL}", description=__doc__.splitlines()[0])
    parser.add_argument("--cp-world", type=positive_int, default=None,
                        help="ranks of the emulated job (world size; FSDP shards over all of them)")
    parser.add_argument("--n-layers", type=positive_int, default=None,
                        help="build this many transformer blocks (default: the flavor's); the report "
                             "extrapolates to the flavor's depth")
    parser.add_argument("--full-layers", type=positive_int, default=None,
                        help="the depth the report extrapolates to (default: the flavor's)")
    parser.add_argument("--seq-len", type=token_count, default=None,
                        help="global sequence length, e.g. 4096 or 1M (training.seq_len)")
    parser.add_argument("--a2a-gbps", type=positive_size, default=None,
                        help=f"a second all-to-all bandwidth per rank and direction, GB/s: the communication is "
                             f"reported at the modeled {DEFAULT_A2A_GBPS:g} GB/s (NVLink-class) and at this one "
                             "(e.g. the paper's effective bandwidth, docs/benchmarks/emulator.md)")
    parser.add_argument("--p2p-gbps", type=positive_size, default=DEFAULT_A2A_GBPS,
                        help=f"ring point-to-point (and TSP collective) bandwidth, GB/s (default {DEFAULT_A2A_GBPS:g})")
    parser.add_argument("--steps", type=positive_int, default=1,
                        help="training steps in all, warm-up included; the median timed step is reported (default 1: "
                             "no warm step, enough for memory)")
    parser.add_argument("--warmup-steps", type=non_negative_int, default=1,
                        help="first steps run but not timed (default 1)")
    parser.add_argument("--compile-pass", action=argparse.BooleanOptionalAction, default=None,
                        help="run each attention kernel once before step 1 and time it apart (compile_s; default: "
                             "where a step is timed, --steps > --warmup-steps)")
    parser.add_argument("--rank", type=non_negative_int, default=0, help="the rank to emulate (default 0)")
    parser.add_argument("--no-attention-timing", action="store_true",
                        help="do not time the attention modules (no per-module CUDA synchronisation)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument("--summarize", nargs="+", metavar="JSON", default=None,
                        help="instead of measuring: tabulate --json outputs (one per file) next to the paper's "
                             "Llama3-8B Table 4 (peak memory) and Table 5 (step time)")
    parser.add_argument("--paper-csv", default=str(PAPER_TABLES_CSV),
                        help=f"the paper's tables (default {PAPER_TABLES_CSV})")
    return parser.parse_known_args(argv)


def _gib(n: float | None) -> str:
    """A byte count in GiB, or MiB below 1 GiB, 13 characters wide."""
    if n is None:
        return f"{'n/a':>13}"
    if abs(n) >= 2**30:
        return f"{n / 2**30:9.3f} GiB"
    return f"{n / 2**20:9.3f} MiB"


def _kept_lines(m) -> list[str]:
    """Which blocks keep their attention (``keep_attention``), measured and in the full model."""
    kept = m.kept_attention
    if not kept:
        return []
    return [f"  kept attn.   full model: {kept['device_blocks']} blocks on the device, {kept['host_blocks']} on the "
            f"host, {_gib(kept['bytes_per_block']).strip()} each; measured: {kept['measured_device']} on the device, "
            f"{kept['measured_host']} on the host (the extrapolation places the rest: titan_upipe.emulate.extrapolate)"]


def report_lines(m) -> list[str]:
    """The human-readable report of a ``StepMeasurement``."""
    how = "emulated (fake process group)" if m.fake else "measured (real process group)"
    u = f", U = {m.heads_per_stage}" if m.heads_per_stage else ""
    lines = [
        f"{m.config}: {m.model}/{m.flavor}, rank {m.rank} of {m.world_size} {how} on {m.device}",
        f"  layout       {m.cp_mode or 'no CP'}: CP {m.cp_degree} (ulysses {m.ulysses_degree} x ring "
        f"{m.ring_degree}{u}), FSDP over {m.dp_shard * m.cp_degree} ranks, seq_len {m.seq_len} x batch {m.batch} "
        f"({m.local_tokens} tokens on this rank), {m.param_dtype}, AC {m.activation_checkpoint}"
        + (", attention block_causal (packed documents, their mask on every rank)" if m.documents else ""),
        f"  layers       {m.n_layers} measured, {m.n_layers_full} in the full model",
        *_kept_lines(m),
        *step_lines(m),
        "",
    ]
    lines += _memory_lines(m) + [""] + _time_lines(m)
    if m.device_total_bytes and m.full.device_peak_allocated_bytes and \
            m.full.device_peak_allocated_bytes > m.device_total_bytes:
        lines.append(f"  the full model's peak exceeds this device's {_gib(m.device_total_bytes).strip()}: it would OOM")
    return lines


def step_lines(m) -> list[str]:
    """Which step is reported, what the first uses cost, and whether kernels compiled while timed."""
    timed = len(m.step_times_s)
    lines = [f"  steps        {m.steps}: {m.warmup_steps} warm-up (untimed), {timed} timed "
             f"({', '.join(f'{t:.3f}' for t in m.step_times_s)} s), the median reported" if timed else
             f"  steps        {m.steps}, none timed after a warm-up (--warmup-steps {m.warmup_steps}): the last reported"]
    first = f"first step {m.first_step_time_s:.3f} s"
    lines.append(f"  first use    {first}" + ("" if m.compile_s is None else
                                             f", after the kernels' compile pass {m.compile_s:.3f} s (before step 1)"))
    if not m.warm:
        lines.append("  NOT WARM: no untimed step before the reported one; its time includes first uses (kernel "
                     "compilation, library set-up) and is no steady state: use --steps 3 for times")
    compiles = m.kernel_compiles_during_timed_steps
    counted = ", ".join(f"{k.replace('_', ' ')} {'-' if v is None else v}" for k, v in m.kernel_compiles.items())
    lines.append(f"  compiled     {counted} (counted: torch.compile graphs, FlashAttention-4 kernels"
                 + (f"; not counted: {', '.join(m.kernel_compiles_uncounted)})" if m.kernel_compiles_uncounted
                    else ")"))
    if compiles:
        lines.append(f"  WARNING: {compiles} kernel(s) compiled during the timed steps: their times include "
                     "compilation; run more --warmup-steps")
    return lines


def _memory_lines(m) -> list[str]:
    full = m.full
    lines = [
        f"  memory (per rank)               {'measured':>13}   {'full model':>13}",
        f"  peak allocated                  {_gib(m.device_peak_allocated_bytes)}   "
        f"{_gib(full.device_peak_allocated_bytes)}   (CUDA allocator)",
        f"  peak reserved                   {_gib(m.device_peak_reserved_bytes)}   "
        f"{_gib(full.device_peak_reserved_bytes)}",
        f"  tracked peak (baseline + step)  {_gib(m.total_peak_bytes)}   {_gib(full.total_peak_bytes)}",
        f"    state: params               {_gib(m.param_bytes)}   {_gib(full.param_bytes)}",
        f"           grads                {_gib(m.grad_bytes)}   {_gib(full.grad_bytes)}",
        f"           optimizer            {_gib(m.optimizer_bytes)}   {_gib(full.optimizer_bytes)}",
        f"    buffers (RoPE table)        {_gib(m.buffer_bytes)}   {_gib(m.buffer_bytes)}",
        f"    step peak above baseline    {_gib(m.peak_bytes)}   {_gib(full.peak_bytes)}   (at {m.peak_op})",
    ]
    for phase, value in m.phase_peak_bytes.items():
        lines.append(f"      {phase:<26}{_gib(value)}   {_gib(full.phase_peak_bytes.get(phase))}")
    return lines + [
        f"    activations kept per block  {_gib(m.retained_bytes_per_layer)}",
        f"  host offload (block inputs)     {_gib(m.host_offload_bytes)}   {_gib(full.host_offload_bytes)}",
    ]


def _time_lines(m) -> list[str]:
    full = m.full
    optimizer = m.phase_time_s["optimizer"]
    once = m.step_time_s - m.block_time_s * m.n_layers - optimizer
    which = "median timed step" if m.warm else "a cold step"
    lines = [
        f"  time (s, {which})" + " " * (22 - len(which)) + f"{'measured':>13}   {'full model':>13}",
        f"  step (compute)                  {m.step_time_s:13.3f}   {full.step_time_s:13.3f}",
        f"    one block (fwd + bwd)         {m.block_time_s:13.3f}   {full.block_time_s:13.3f}   "
        f"(x {m.n_layers} measured, x {full.n_layers} full)",
        f"    embedding, head, loss         {once:13.3f}   {full.once_time_s:13.3f}   (once per step)",
        f"    optimizer (clip + step)       {optimizer:13.3f}   {full.optimizer_time_s:13.3f}   (x parameter bytes)",
        f"    attention                     {m.attention_time_s:13.3f}   {full.attention_time_s:13.3f}   "
        f"(fwd {m.attention_forward_time_s:.3f}, bwd {m.attention_backward_time_s:.3f})",
        f"    other compute                 {m.other_compute_time_s:13.3f}   {full.other_compute_time_s:13.3f}",
        f"  communication (modeled)         {m.comm_time_s:13.3f}   {full.comm_time_s:13.3f}   "
        f"all-to-all {_gib(m.a2a_wire_bytes).strip()} sent at {m.a2a_gbps:g} GB/s"
        + (f", {'TSP collectives' if m.cp_mode == 'tsp' else 'ring'} {_gib(m.p2p_bytes).strip()} received at "
           f"{m.p2p_gbps:g} GB/s" if m.p2p_bytes else ""),
        f"  step + communication            {m.step_time_s + m.comm_time_s:13.3f}   {full.modeled_step_time_s:13.3f}",
    ]
    if m.second_a2a_gbps is not None:
        label = f"at {m.second_a2a_gbps:g} GB/s"
        lines += [f"  communication {label:<18}{m.second_comm_time_s:13.3f}   {full.second_comm_time_s:13.3f}   "
                  "(the all-to-all at the second bandwidth)",
                  f"  step + communication {label:<11}{m.step_time_s + m.second_comm_time_s:13.3f}   "
                  f"{full.second_modeled_step_time_s:13.3f}"]
    if not m.fake:
        lines.append("  (real run: the measured times already include the communication)")
    return lines


def _length_label(seq_len: int) -> str:
    """131072 -> "128K", 1048576 -> "1M" (the paper's column names)."""
    if seq_len % 2**20 == 0:
        return f"{seq_len // 2**20}M"
    return f"{seq_len // 2**10}K" if seq_len % 2**10 == 0 else str(seq_len)


def _paper_values(path: str) -> dict[tuple[str, str, str], float]:
    """{(method, metric, length): value} of the paper's Llama3-8B rows (tables 4 and 5)."""
    values: dict[tuple[str, str, str], float] = {}
    if not os.path.exists(path):
        return values
    for row in paper_rows(Path(path)):
        if row["model"] != "llama3_8b" or row["table"] not in ("4", "5"):
            continue
        for key in LENGTH_COLUMNS:
            if row.get(key):
                try:
                    value = cell_value(row[key])
                except ValueError:  # not a number: shown like an OOM
                    value = None
                values[(row["method"], row["metric"], key)] = math.nan if value is None else value
    return values


def summarize(paths: list[str], paper_csv: str) -> list[str]:
    """A Markdown table of ``--json`` results (full-model estimates) beside the paper's Tables 4 and 5."""
    paper = _paper_values(paper_csv)

    def size(n: float | None) -> float | None:
        return None if n is None else n / 2**30

    def cell(value: float | None, fmt: str) -> str:
        if value is None:
            return "-"
        return "OOM" if isinstance(value, float) and math.isnan(value) else format(value, fmt)

    records = []
    for path in paths:
        with open(path) as f:
            lines = [line for line in f.read().splitlines() if line.strip().startswith("{")]
        if lines:
            records.append(json.loads(lines[-1]))
    records.sort(key=lambda r: (r.get("seq_len", 0), r.get("cp_mode") or ""))
    out = [
        "| method | length | layers run | peak alloc. GiB (full) | peak reserved GiB (full) | tracked GiB (full) "
        "| paper T4 GiB | step s (full, modeled) | a2a s (modeled) | paper T5 step s | paper T5 a2a s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    steps: dict[tuple[str, str], float] = {}
    for r in records:
        method, length = r.get("cp_mode") or "-", _length_label(r.get("seq_len", 0))
        p4 = paper.get((method, "peak_memory", length))
        p5 = paper.get((method, "step_time_total", length))
        p5a = paper.get((method, "step_time_all_to_all", length))
        if r.get("oom"):
            out.append(f"| {method} | {length} | {r.get('n_layers') or 'all'} | OOM | OOM | - | {cell(p4, '.2f')} "
                       f"| - | - | {cell(p5, '.2f')} | {cell(p5a, '.2f')} |")
            continue
        full = r["full"]
        if r.get("warm"):  # no ratio from a cold step (first uses inside it)
            steps[(method, length)] = full["modeled_step_time_s"]
        out.append(
            f"| {method} | {length} | {r['n_layers']} of {full['n_layers']} | "
            f"{cell(size(full['device_peak_allocated_bytes']), '.2f')} | "
            f"{cell(size(full['device_peak_reserved_bytes']), '.2f')} | {cell(size(full['total_peak_bytes']), '.2f')} | "
            f"{cell(p4, '.2f')} | {full['modeled_step_time_s']:.2f}{'' if r.get('warm') else ' (cold)'} | "
            f"{full['comm_time_s']:.2f} | {cell(p5, '.2f')} | {cell(p5a, '.2f')} |"
        )
    if any(not r.get("oom") and not r.get("warm") for r in records):
        out += ["", "(cold): a single step with no untimed warm-up before it (`--steps 1`): first-use kernel "
                "compilation and set-up inside it; no ratio is computed from it (time with `--steps 3`)"]
    lengths = sorted({length for (_, length) in steps}, key=lambda x: (x[-1] != "K", float(x[:-1] or 0)))
    ratios = [length for length in lengths if ("upipe", length) in steps and ("ulysses", length) in steps]
    if ratios:
        out += ["", "| length | UPipe / Ulysses step time (emulated) | paper Table 5 |", "|---|---|---|"]
        for length in ratios:
            ours = steps[("upipe", length)] / steps[("ulysses", length)]
            up, ul = paper.get(("upipe", "step_time_total", length)), paper.get(("ulysses", "step_time_total", length))
            theirs = up / ul if up and ul and not (math.isnan(up) or math.isnan(ul)) else None
            out.append(f"| {length} | {ours:.3f} | {cell(theirs, '.3f')} |")
    return out


def checked_job(options, titan_args: list[str], launched: int):
    """The job to emulate (``--seq-len`` applied), validated before any process group: the
    arguments that depend on each other, the launch, and the job checks at ``--cp-world`` ranks.
    Raises ConfigError."""
    if options.cp_world is None:
        raise ConfigError("--cp-world N is required: the ranks of the job to emulate (e.g. 8)")
    if options.rank >= options.cp_world:
        raise ConfigError(f"--rank {options.rank} is not one of the {options.cp_world} ranks: valid values are 0 to "
                          f"{options.cp_world - 1}")
    if launched > 1 and launched != options.cp_world:
        raise ConfigError(f"launched with {launched} ranks but --cp-world {options.cp_world}: launch "
                          f"--nproc_per_node {options.cp_world}, or emulate one rank in one process (no torchrun)")
    if options.seq_len:
        titan_args = [*titan_args, "--training.seq_len", str(options.seq_len)]
    job_config = load_job(titan_args, options.cp_world).config
    # what this process will allocate: one rank (fake) or this node's share, --n-layers blocks
    machine = free_machine_memory(1 if launched == 1 else local_ranks(launched), rank_device().type)
    check_memory_fits(job_config, options.cp_world, machine, n_layers=options.n_layers)
    return job_config


def _start_process_group() -> bool:
    """A real run's default process group (nccl on CUDA, gloo else), unless one exists; whether
    this call started it."""
    if dist.is_initialized():
        return False
    on_cuda = rank_device().type == "cuda"
    if on_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if on_cuda else "gloo")
    return True


def main(argv: list[str] | None = None) -> int:
    # As scripts/run_train.sh launches training (read when CUDA first allocates).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    options, titan_args = _parse(sys.argv[1:] if argv is None else argv)
    if options.summarize:
        print("\n".join(summarize(options.summarize, options.paper_csv)))
        return 0
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        job_config = checked_job(options, titan_args, launched)
    except MemoryDoesNotFit as err:
        if options.json:  # recorded as an OOM, as a run that allocated it would be (tools/gpu_runs.py)
            print(json.dumps({"oom": True, "predicted": True, "n_layers": options.n_layers, "error": str(err)}))
        raise exit_once(TOOL, str(err)) from None
    except ConfigError as err:
        raise exit_once(TOOL, str(err)) from None
    real = launched > 1
    owns_group = real and _start_process_group()
    try:
        m = measure_step(job_config, options.cp_world, fake=not real, n_layers=options.n_layers,
                         steps=options.steps, warmup_steps=options.warmup_steps, compile_pass=options.compile_pass,
                         rank=options.rank, second_a2a_gbps=options.a2a_gbps, p2p_gbps=options.p2p_gbps,
                         time_attention=not options.no_attention_timing, full_layers=options.full_layers)
    except torch.OutOfMemoryError as err:
        message = str(err).splitlines()[0]
        record = {"oom": True, "config": job_config.job.config_file, "cp_mode": cp_mode(job_config.model.converters),
                  "seq_len": job_config.training.seq_len, "n_layers": options.n_layers, "error": message}
        print(json.dumps(record) if options.json
              else f"{job_config.job.config_file}: OOM on this device with {options.n_layers or 'all'} layers: {message}")
        return 3
    finally:
        if owns_group:
            dist.barrier()
            dist.destroy_process_group()
    if m.rank == (options.rank if not real else 0):
        if options.json:
            record = m.to_dict()
            record["modeled_step_time_s"] = m.step_time_s + m.comm_time_s
            record["second_modeled_step_time_s"] = (None if m.second_comm_time_s is None
                                                    else m.step_time_s + m.second_comm_time_s)
            record["oom"] = False
            print(json.dumps(record))
        else:
            print("\n".join(report_lines(m)))
    return 0
