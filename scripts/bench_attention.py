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

``--documents`` adds, for every variant, the same call with a ``document_mask`` (block-causal
attention over packed documents: a few long documents among many short ones,
``document_lengths``) next to the plain causal call; ``--modes local`` is the local kernel alone
(one rank's heads after the Ulysses all-to-all, H/C query and max(KV/C, 1) K/V heads, over the
whole sequence): causal, and with ``--documents`` causal on each document segment (one call per
segment on CPU, one varlen call on CUDA). A variant that refuses document masks (ConfigError:
e.g. a CUDA backend without a varlen kernel) is skipped with its reason.

``--compare-model`` adds, for UPipe, the implementation's term model and the paper's
Table 2/6 formulas (see ``titan_upipe.costs.attention_memory``); use it with
``--frozen-weights`` (activations only, the quantity those formulas describe).

Examples::

    python scripts/bench_attention.py --cp 8 --model qwen3 --n-heads 64 --n-kv-heads 8 \\
        --head-dim 128 --dim 256 --seq-len 512 --frozen-weights --compare-model
    python scripts/bench_attention.py --cp 4 --n-heads 8 --n-kv-heads 2 --head-dim 64 --seq-len 1024 \\
        --modes ulysses ring usp upipe_usp --ulysses-degree 2
    python scripts/bench_attention.py --cp 2 --model llama3 --n-heads 8 --n-kv-heads 2 --head-dim 64 \\
        --seq-len 4096 --modes local ulysses upipe --heads-per-stage 2 --documents
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

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("ulysses", "upipe", "ring", "usp", "upipe_usp", "local")


@dataclass(frozen=True)
class Variant:
    mode: str
    heads_per_stage: int | None
    ulysses_degree: int = 0
    """``[upipe] ulysses_degree``: 0 = all of CP is Ulysses (ulysses/upipe), or the mode's ring split."""

    @property
    def label(self) -> str:
        if self.mode == "local":
            return "local kernel"
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
    p.add_argument("--documents", action="store_true",
                   help="add each variant with a block-causal document mask (a few long among many short documents)")
    p.add_argument("--doc-seed", type=int, default=0, help="seed of the document lengths (row b: seed + b)")
    return p.parse_args(argv)


def document_lengths(seq_len: int, seed: int, n_long: int = 2) -> list[int]:
    """One packed row of ``seq_len`` tokens: ``n_long`` long documents (log-uniform in ``S/8 .. S/4``)
    among short ones (log-normal, median ``S/128``, sigma 0.9, clipped to ``[8, S/16]``), in random
    order; the last document is cut to fill the row exactly. The mixed streams of
    ``scripts/bench_document_balance.py`` scaled down to the short sequences a CPU runs (theirs
    have absolute lengths: 2K-token short and 100K-1M-token long documents)."""
    rng = np.random.default_rng(seed)
    lo, hi = max(seq_len // 8, 1), max(seq_len // 4, 1)
    lengths = [int(x) for x in np.round(np.exp(rng.uniform(np.log(lo), np.log(hi), size=n_long)))]
    short_hi = max(seq_len // 16, 8)
    while sum(lengths) < seq_len:
        lengths.append(int(np.clip(round(rng.lognormal(np.log(max(seq_len / 128, 8)), 0.9)), 8, short_hi)))
    lengths = [lengths[i] for i in rng.permutation(len(lengths))]
    out, room = [], seq_len
    for length in lengths:
        if room == 0:
            break
        out.append(min(length, room))
        room -= out[-1]
    return out


def document_ids(args: argparse.Namespace) -> torch.Tensor:
    """``[B, S]`` int64 global document ids, row ``b`` from ``document_lengths(S, doc_seed + b)``."""
    rows = [document_lengths(args.seq_len, args.doc_seed + b) for b in range(args.batch)]
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


def visible_fraction(lengths: list[int]) -> float:
    """Visible (query, key) pairs of the packed row over plain causal's:
    ``sum_i L_i (L_i + 1) / 2`` over ``S (S + 1) / 2`` (the work a mask-aware kernel skips)."""
    s = sum(lengths)
    return sum(n * (n + 1) for n in lengths) / (s * (s + 1))


def describe_documents(args: argparse.Namespace) -> str:
    rows = [document_lengths(args.seq_len, args.doc_seed + b) for b in range(args.batch)]
    return "; ".join(f"row {b}: {len(r)} documents, longest {max(r)}, median {int(np.median(r))}, "
                     f"shortest {min(r)} tokens, {100 * visible_fraction(r):.1f} % of causal's visible pairs"
                     for b, r in enumerate(rows))


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
        elif mode == "local":
            variants.append(Variant("local", None))
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


def _fresh(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach().clone().requires_grad_(True) for t in inputs)


def _peak_forward_no_grad(run, inputs, device) -> int:
    """Peak bytes of a forward without autograd (as under activation checkpointing)."""
    with torch.no_grad():
        if device.type == "cuda":
            _sync(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            run(*inputs)
            _sync(device)
            return torch.cuda.max_memory_allocated(device) - base
        from titan_upipe.tools.memory_tracker import LiveTensorTracker

        with LiveTensorTracker() as mem:
            run(*inputs)
        return mem.peak_bytes


def _peak_step(run, inputs, grad_y, device) -> tuple[int, int]:
    """(forward peak, backward peak) bytes of one step."""
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        y = run(*inputs)
        _sync(device)
        fwd = torch.cuda.max_memory_allocated(device) - base
        torch.cuda.reset_peak_memory_stats(device)
        base_bwd = torch.cuda.memory_allocated(device)
        y.backward(grad_y)
        _sync(device)
        return fwd, torch.cuda.max_memory_allocated(device) - base_bwd + (base_bwd - base)
    from titan_upipe.tools.memory_tracker import LiveTensorTracker

    with LiveTensorTracker() as mem:
        y = run(*inputs)
        fwd = mem.peak_bytes
        mem.reset_peak()
        y.backward(grad_y)
        return fwd, mem.peak_bytes


class _KernelCall(torch.autograd.Function):
    """A local backend's forward and merged-out/LSE backward as one autograd op (``--modes local``)."""

    @staticmethod
    def forward(ctx, q, k, v, backend, scale):
        out, lse = backend.forward(q, k, v, scale, causal=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backend, ctx.scale = backend, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*ctx.backend.backward(dout, q, k, v, out, lse, ctx.scale, causal=True), None, None)


def _local_case(args: argparse.Namespace, cp: int, device: torch.device, dtype: torch.dtype):
    """(make_run(mask), inputs, grad_out) of one rank's kernel after the Ulysses all-to-all:
    ``q [B, H/C, S, D]``, ``k``/``v`` ``[B, max(KV/C, 1), S, D]`` (K/V replicated when C > KV)."""
    from titan_upipe.attention.backends import default_scale, get_backend
    from titan_upipe.attention.documents import DocumentMaskedBackend

    hq, hkv = args.n_heads // cp, max(args.n_kv_heads // cp, 1)
    q = torch.randn(args.batch, hq, args.seq_len, args.head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(args.batch, hkv, args.seq_len, args.head_dim, device=device, dtype=dtype) for _ in range(2))
    backend, scale = get_backend(args.backend, dtype), default_scale(args.head_dim)

    def make_run(mask):
        kernel = backend if mask is None else DocumentMaskedBackend(backend, mask)
        return lambda q, k, v: _KernelCall.apply(q, k, v, kernel, scale)

    return make_run, (q, k, v), torch.randn_like(q)


def _time_steps(run, inputs, grad_y, args, mesh, device, zero_grad) -> float:
    """Median seconds of a forward+backward over ``--iters`` steps after ``--warmup``."""
    times = []
    for i in range(args.warmup + args.iters):
        fresh = _fresh(inputs)
        dist.barrier(group=mesh.get_group())
        _sync(device)
        start = time.perf_counter()
        run(*fresh).backward(grad_y)
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        zero_grad()
    return statistics.median(times)


def _document_masks(args: argparse.Namespace, device: torch.device) -> list:
    """``[None]``, and with ``--documents`` the mask of ``document_ids`` with its segments
    computed (once per mask in training too: every layer reads the same mask)."""
    if not args.documents:
        return [None]
    from titan_upipe.attention.documents import document_mask

    mask = document_mask(document_ids(args).to(device))
    _ = mask.document_segments
    return [None, mask]


def bench_rank(args: argparse.Namespace, mesh, device: torch.device) -> list[Row]:
    from titan_upipe.attention import convert_attention
    from titan_upipe.costs.attention_memory import (
        LayerShape,
        paper_table2_peak,
        paper_table6_peak,
        upipe_backward_peak,
        upipe_forward_terms,
    )
    from titan_upipe.errors import ConfigError
    from titan_upipe.parallel import context_parallel_mesh, shard_sequence

    cp = mesh.size()
    module, table, dim, dtype = _build(args, device)
    x_full = torch.randn(args.batch, args.seq_len, dim, device=device, dtype=dtype)
    grad_full = torch.randn_like(x_full)
    shape = LayerShape(args.n_heads, args.n_kv_heads, args.head_dim, cp, args.seq_len, args.batch, dim,
                       dtype.itemsize)
    masks = _document_masks(args, device)
    rows = []
    for variant in _variants(args, cp):
        if variant.mode == "local":
            make_run, inputs, grad_y = _local_case(args, cp, device, dtype)
            stages = 1
        else:
            variant_mesh = context_parallel_mesh(mesh, variant.mode, variant.ulysses_degree)
            x_local, positions = shard_sequence(x_full, variant_mesh, seq_dim=1)
            grad_y = shard_sequence(grad_full, variant_mesh, seq_dim=1)[0]
            layer = convert_attention(module, variant.mode, variant_mesh, variant.heads_per_stage,
                                      backend=args.backend)
            inputs, stages = (x_local,), layer.schedule.n_stages

            def make_run(mask, layer=layer, positions=positions):
                return lambda x: layer(x, table, mask, positions)
        for mask in masks:
            run = make_run(mask)
            try:
                seconds = _time_steps(run, inputs, grad_y, args, mesh, device,
                                      lambda: module.zero_grad(set_to_none=True))
            except ConfigError as err:  # refused before any collective, on every rank alike
                if mesh.get_rank() == 0:
                    print(f"skipped {variant.label} with documents: {err}")
                continue
            no_grad = _peak_forward_no_grad(run, inputs, device)
            fwd, bwd = _peak_step(run, _fresh(inputs), grad_y, device)
            module.zero_grad(set_to_none=True)
            mib = 2.0**20
            label = variant.label + (", documents" if mask is not None else "")
            row = Row(label, stages, 1e3 * seconds, no_grad / mib, fwd / mib, bwd / mib)
            if args.compare_model and variant.mode == "upipe" and not variant.ulysses_degree and mask is None:
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
    lines = [head, *([f"documents: {describe_documents(args)}"] if args.documents else []), "",
             "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
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
