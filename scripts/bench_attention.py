"""Forward+backward time and peak memory of one context-parallel attention layer:
Ulysses against UPipe with U = C, 2C and H (or the U values given), and with ``--modes``
zigzag ring attention, USP (``--ulysses-degree`` Ulysses ranks x C/that ring ranks) and
UPipe inside USP (U = Ulysses degree and U = H). Each variant shards the input in its own
layout (contiguous, or zigzag for the ring modes).

CPU (default): spawns ``--cp`` gloo ranks on this machine; peak memory is the
``LiveTensorTracker``'s peak of live tensor bytes created in the layer (inputs and weights
excluded). CUDA (``--device cuda``): one rank per GPU under ``torchrun`` (NCCL), or a
1-rank mesh on one GPU without it; peak memory is ``torch.cuda.max_memory_allocated``
above what was allocated before the step. Times are the median over ``--iters`` steps,
the slowest rank's.

``--compare-model`` adds, for UPipe, the implementation's term model and the paper's
Table 2/6 formulas (see ``titan_upipe.attention.memory_model``); use it with
``--frozen-weights`` (activations only, the quantity those formulas describe).

Examples::

    python scripts/bench_attention.py --cp 8 --model qwen3 --n-heads 64 --n-kv-heads 8 \\
        --head-dim 128 --dim 256 --seq-len 512 --frozen-weights --compare-model
    python scripts/bench_attention.py --cp 4 --n-heads 8 --n-kv-heads 2 --head-dim 64 --seq-len 1024 \\
        --modes ulysses ring usp upipe_usp --ulysses-degree 2
    torchrun --nproc_per_node 8 scripts/bench_attention.py --device cuda --dtype bfloat16 \\
        --n-heads 64 --n-kv-heads 8 --head-dim 128 --dim 5120 --seq-len 131072
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("ulysses", "upipe", "ring", "usp", "upipe_usp")


@dataclass(frozen=True)
class Variant:
    mode: str
    heads_per_stage: int | None
    ulysses_degree: int = 0
    """``[upipe] ulysses_degree``: 0 = all of CP is Ulysses (ulysses/upipe), or the mode's ring split."""

    @property
    def label(self) -> str:
        if self.mode == "ring":
            return "ring"
        if self.mode == "usp":
            return f"usp ulysses={self.ulysses_degree}"
        if self.mode == "ulysses":
            return "ulysses"
        where = f" in usp ulysses={self.ulysses_degree}" if self.ulysses_degree else ""
        return f"upipe U={self.heads_per_stage}{where}"


@dataclass
class Row:
    label: str
    stages: int
    step_ms: float
    forward_no_grad_peak_mib: float
    forward_peak_mib: float
    backward_peak_mib: float
    model_forward_mib: float | None = None
    model_backward_mib: float | None = None
    paper_forward_mib: float | None = None
    paper_backward_mib: float | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("llama3", "qwen3"), default="qwen3")
    p.add_argument("--n-heads", type=int, default=64)
    p.add_argument("--n-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dim", type=int, default=256, help="model dim (Llama3: forced to n_heads * head_dim)")
    p.add_argument("--seq-len", type=int, default=512, help="global sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cp", type=int, default=8, help="CP ranks to spawn on CPU (ignored under torchrun)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--backend", default="sdpa")
    p.add_argument("--heads-per-stage", type=int, nargs="*", default=None,
                   help="UPipe U values (default: C, 2C, H)")
    p.add_argument("--no-ulysses", action="store_true", help="skip the Ulysses baseline")
    p.add_argument("--modes", nargs="*", choices=MODES, default=["ulysses", "upipe"],
                   help="variants to run (upipe_usp: UPipe inside USP with U = Ulysses degree and U = H)")
    p.add_argument("--ulysses-degree", type=int, default=0,
                   help="Ulysses ranks for usp / upipe_usp (the ring has C / this ranks)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--frozen-weights", action="store_true", help="no weight gradients: activation memory only")
    p.add_argument("--compare-model", action="store_true", help="add term-model and paper-formula columns")
    return p.parse_args(argv)


def _variants(args: argparse.Namespace, cp: int) -> list[Variant]:
    from titan_upipe.attention import valid_heads_per_stage

    variants: list[Variant] = []
    for mode in args.modes:
        if mode == "ulysses" and not args.no_ulysses:
            variants.append(Variant("ulysses", None))
        elif mode == "upipe":
            us = args.heads_per_stage or [cp, 2 * cp, args.n_heads]
            valid = valid_heads_per_stage(args.n_heads, cp)
            variants += [Variant("upipe", u) for u in dict.fromkeys(us) if u in valid]
        elif mode == "ring":
            variants.append(Variant("ring", None))
        elif mode == "usp":
            variants.append(Variant("usp", None, args.ulysses_degree))
        elif mode == "upipe_usp":
            d = args.ulysses_degree
            valid = valid_heads_per_stage(args.n_heads, d) if d > 0 else []
            variants += [Variant("upipe", u, d) for u in dict.fromkeys((d, args.n_heads)) if u in valid]
    return variants


def _build(args: argparse.Namespace, device: torch.device):
    dtype = getattr(torch, args.dtype)
    if args.model == "llama3":
        from torchtitan.models.llama3.model.args import TransformerModelArgs
        from torchtitan.models.llama3.model.model import Attention, precompute_freqs_cis

        margs = TransformerModelArgs(dim=args.n_heads * args.head_dim, n_heads=args.n_heads,
                                     n_kv_heads=args.n_kv_heads, max_seq_len=args.seq_len)
        table = precompute_freqs_cis(args.head_dim, args.seq_len, margs.rope_theta, margs.rope_scaling_args)
    else:
        from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
        from torchtitan.models.qwen3.model.model import Attention, precompute_rope_cache

        margs = Qwen3ModelArgs(dim=args.dim, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                               head_dim=args.head_dim, max_seq_len=args.seq_len)
        table = precompute_rope_cache(args.head_dim, args.seq_len, margs.rope_theta)
    torch.manual_seed(0)
    module = Attention(margs).to(device=device, dtype=dtype)
    module.requires_grad_(not args.frozen_weights)
    return module, table.to(device), module.wq.in_features, dtype


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_forward_no_grad(layer, x, table, positions, device) -> int:
    """Peak bytes of a forward without autograd (as under activation checkpointing)."""
    with torch.no_grad():
        if device.type == "cuda":
            _sync(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            layer(x, table, None, positions)
            _sync(device)
            return torch.cuda.max_memory_allocated(device) - base
        from titan_upipe.memory_tracker import LiveTensorTracker

        with LiveTensorTracker() as mem:
            layer(x, table, None, positions)
        return mem.peak_bytes


def _peak_step(layer, x, table, positions, grad_y, device) -> tuple[int, int]:
    """(forward peak, backward peak) bytes of one step."""
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        y = layer(x, table, None, positions)
        _sync(device)
        fwd = torch.cuda.max_memory_allocated(device) - base
        torch.cuda.reset_peak_memory_stats(device)
        base_bwd = torch.cuda.memory_allocated(device)
        y.backward(grad_y)
        _sync(device)
        return fwd, torch.cuda.max_memory_allocated(device) - base_bwd + (base_bwd - base)
    from titan_upipe.memory_tracker import LiveTensorTracker

    with LiveTensorTracker() as mem:
        y = layer(x, table, None, positions)
        fwd = mem.peak_bytes
        mem.reset_peak()
        y.backward(grad_y)
        return fwd, mem.peak_bytes


def bench_rank(args: argparse.Namespace, mesh, device: torch.device) -> list[Row]:
    from titan_upipe.attention import convert_attention
    from titan_upipe.attention.memory_model import (
        LayerShape,
        paper_table2_peak,
        paper_table6_peak,
        upipe_backward_peak,
        upipe_forward_terms,
    )
    from titan_upipe.parallel import context_parallel_mesh, shard_sequence

    cp = mesh.size()
    module, table, dim, dtype = _build(args, device)
    x_full = torch.randn(args.batch, args.seq_len, dim, device=device, dtype=dtype)
    grad_full = torch.randn_like(x_full)
    shape = LayerShape(args.n_heads, args.n_kv_heads, args.head_dim, cp, args.seq_len, args.batch, dim,
                       dtype.itemsize)
    rows = []
    for variant in _variants(args, cp):
        variant_mesh = context_parallel_mesh(mesh, variant.mode, variant.ulysses_degree)
        x_local, positions = shard_sequence(x_full, variant_mesh, seq_dim=1)
        grad_y = shard_sequence(grad_full, variant_mesh, seq_dim=1)[0]
        layer = convert_attention(module, variant.mode, variant_mesh, variant.heads_per_stage, backend=args.backend)
        times = []
        for i in range(args.warmup + args.iters):
            x = x_local.detach().clone().requires_grad_(True)
            dist.barrier(group=mesh.get_group())
            _sync(device)
            start = time.perf_counter()
            layer(x, table, None, positions).backward(grad_y)
            _sync(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
            module.zero_grad(set_to_none=True)
        no_grad = _peak_forward_no_grad(layer, x_local, table, positions, device)
        fwd, bwd = _peak_step(layer, x_local.detach().clone().requires_grad_(True), table, positions, grad_y, device)
        module.zero_grad(set_to_none=True)
        mib = 2.0**20
        row = Row(variant.label, layer.schedule.n_stages, 1e3 * statistics.median(times), no_grad / mib, fwd / mib,
                  bwd / mib)
        if args.compare_model and variant.mode == "upipe" and not variant.ulysses_degree:
            u = layer.heads_per_stage
            row.model_forward_mib = sum(upipe_forward_terms(shape, u).values()) / mib
            # The measured backward is the overall peak: a stage's kernel or the final dX GEMM.
            row.model_backward_mib = upipe_backward_peak(shape, u) / mib
            row.paper_forward_mib = paper_table2_peak(shape, u) / mib
            row.paper_backward_mib = paper_table6_peak(shape, u) / mib
        rows.append(row)
    # The slowest rank's time and the largest peak are what bound a step.
    gathered: list[list[Row] | None] = [None] * cp
    dist.all_gather_object(gathered, rows, group=mesh.get_group())
    for i, row in enumerate(rows):
        row.step_ms = max(r[i].step_ms for r in gathered)
        row.forward_no_grad_peak_mib = max(r[i].forward_no_grad_peak_mib for r in gathered)
        row.forward_peak_mib = max(r[i].forward_peak_mib for r in gathered)
        row.backward_peak_mib = max(r[i].backward_peak_mib for r in gathered)
    return rows


def format_table(args: argparse.Namespace, cp: int, rows: list[Row], device_name: str) -> str:
    head = (f"{args.model} H={args.n_heads} KV={args.n_kv_heads} D={args.head_dim} dim={args.dim} "
            f"S={args.seq_len} B={args.batch} C={cp} {args.dtype} backend={args.backend} on {device_name}, "
            f"torch {torch.__version__}{', weights frozen' if args.frozen_weights else ''}")
    cols = ["variant", "stages", "fwd+bwd ms", "fwd no-grad peak MiB", "fwd peak MiB", "bwd peak MiB"]
    if args.compare_model:
        cols += ["model fwd", "model bwd", "paper T2 fwd", "paper T6 bwd"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        cells = [r.label, str(r.stages), f"{r.step_ms:.1f}", f"{r.forward_no_grad_peak_mib:.2f}",
                 f"{r.forward_peak_mib:.2f}", f"{r.backward_peak_mib:.2f}"]
        if args.compare_model:
            cells += ["-" if v is None else f"{v:.2f}" for v in
                      (r.model_forward_mib, r.model_backward_mib, r.paper_forward_mib, r.paper_backward_mib)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _spawned_rank(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    os.environ.setdefault("TITAN_UPIPE_DEVICE", "cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        rows = bench_rank(args, mesh, torch.device("cpu"))
        if rank == 0:
            results.put([asdict(r) for r in rows])
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ:  # under torchrun: one rank per process
        device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" \
            else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("cp",))
        rows = bench_rank(args, mesh, device)
        if dist.get_rank() == 0:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
            print(format_table(args, mesh.size(), rows, name))
        dist.destroy_process_group()
        return
    if args.device == "cuda":
        # One GPU without torchrun: a 1-rank NCCL mesh (C = 1).
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="1", RANK="0",
                          LOCAL_RANK="0")
        main(argv)
        return
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_spawned_rank, args=(r, args.cp, port, args, results)) for r in range(args.cp)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode != 0 for proc in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    rows = [Row(**r) for r in results.get(timeout=10)]
    print(format_table(args, args.cp, rows, f"{os.cpu_count()}-core CPU (gloo)"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
