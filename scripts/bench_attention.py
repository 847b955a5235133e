"""Forward+backward time and peak memory of one context-parallel attention layer:
Ulysses against UPipe with U = C, 2C and H (or the U values given), and with ``--modes``
zigzag ring attention, USP (``--ulysses-degree`` Ulysses ranks x C/that ring ranks) and
UPipe inside USP (U = Ulysses degree and U = H). Each variant shards the input in its own
layout (contiguous, or zigzag for the ring modes).

CPU (default): spawns ``--cp`` gloo ranks on this machine; peak memory is the
``LiveTensorTracker``'s peak of live tensor bytes created in the layer (inputs and weights
excluded). CUDA (``--device cuda``): one rank per GPU under ``torchrun`` (NCCL), or a
1-rank mesh on one GPU without it; peak memory is ``torch.cuda.max_memory_allocated``
above what was allocated before the step. Times are the median over ``--iters`` steps of
the slowest rank's time; a variant's calls (causal, and each document layout) take turns step by
step, so a change in the machine's speed during the run shifts them alike.

``--documents`` adds, for every variant, the same call with a ``document_mask`` (block-causal
attention over packed documents: a few long documents among many short ones,
``document_lengths``) next to the plain causal call (``--no-causal``: without it). The ring modes
(ring, usp, upipe_usp) run it under each ``--document-balance`` (``[upipe] document_balance``):
``zigzag``, the fixed zigzag's chunks, and ``documents``, the batch's document-aware layout
(``document_mask(ids, mesh, balance="documents", min_split=--min-split)``, the inputs sharded by
its ``BatchDocumentLayout``); modes without a ring have one layout and one row. For every ring
degree the header then gives the batch's computed ring work per balance (on the layout each row
ran: busiest / mean ring rank, and the ring schedule's attention time over balanced,
``ring_balance``) and the table ends with the measured zigzag / documents time of each ring
variant beside the computed one. ``--modes local`` is the local kernel alone
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
    python scripts/bench_attention.py --cp 4 --n-heads 8 --n-kv-heads 2 --head-dim 64 --dim 128 \\
        --seq-len 16384 --modes ring --documents --no-causal --min-split 1024
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

from titan_upipe.spec.settings import DEFAULT_MIN_SPLIT, DOCUMENT_BALANCES

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
    variant: str = ""
    """The variant's label without the mask (pairs a ring variant's two balances)."""
    balance: str | None = None
    """``document_balance`` of a ring variant's documents row; None otherwise."""
    degrees: tuple[int, int] | None = None
    """``(ring, ulysses)`` degrees of a ring variant's documents row (its computed work's key)."""
    step_samples_ms: list[float] | None = None
    """Each timed step's milliseconds (the slowest rank's); ``step_ms`` is their median."""
    cpu_samples_ms: list[float] | None = None
    """Each timed step's process CPU milliseconds of the busiest rank (``_time_steps``)."""
    cpu_total_samples_ms: list[float] | None = None
    """Each timed step's process CPU milliseconds summed over the ranks."""

    @property
    def cpu_ms(self) -> float:
        return statistics.median(self.cpu_samples_ms)

    @property
    def cpu_total_ms(self) -> float:
        return statistics.median(self.cpu_total_samples_ms)


@dataclass
class RingLayout:
    """The layout one ring variant's documents rows ran on: ``ring_runs[b][r]``, ring rank ``r``'s
    ``(start, stop)`` token runs of row ``b`` (``DocumentMask.ring_runs``), and the seconds
    ``document_mask`` took to build the mask with it (per batch, in the loader in training)."""

    ring_size: int
    ulysses_size: int
    balance: str
    ring_runs: tuple
    build_s: float


@dataclass(frozen=True)
class RingBalance:
    """The batch's computed ring work under one layout (``ring_balance``)."""

    ring_size: int
    ulysses_size: int
    balance: str
    busiest_over_mean: float
    """max / mean over ring ranks of the visible (query, key) pairs whose query the rank holds."""
    schedule: float
    """Attention time of one layer (forward + ``BWD_FACTOR`` x backward) through the ring's exchange
    order (``costs.document_balance.simulate_ring``, transfers free) over the same work balanced."""
    shared_cores: float | None
    """The same time when ``R x U`` ranks share ``cores`` cores (lockstep steps: a step lasts as long
    as its busiest rank, or its total work over the cores, whichever is longer), over balanced;
    None when every rank has a core."""
    build_ms: float


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
    p.add_argument("--document-balance", nargs="+", choices=DOCUMENT_BALANCES, default=list(DOCUMENT_BALANCES),
                   help="ring modes with --documents: the layouts to run ([upipe] document_balance)")
    p.add_argument("--min-split", type=int, default=DEFAULT_MIN_SPLIT,
                   help="document_balance = documents: documents this long (or S/(4R) when shorter: "
                        "costs.document_balance.split_threshold) are zigzagged inside themselves")
    p.add_argument("--no-causal", action="store_true", help="with --documents: skip the plain causal calls")
    args = p.parse_args(argv)
    if args.no_causal and not args.documents:
        p.error("--no-causal leaves nothing to run without --documents")
    return args


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


BWD_FACTOR = 2.5
"""Attention backward / forward work in ``RingBalance.schedule`` (``scripts/bench_document_balance.py``'s)."""


def ring_step_work(rows: list[list[int]], ring_runs, ring_size: int) -> np.ndarray:
    """``W[r, t]`` summed over the batch: the visible pairs ring rank ``r`` computes at ring step
    ``t`` (``costs.document_balance.step_work``), row ``b`` with document lengths ``rows[b]`` laid out
    as ``ring_runs[b]`` (each ring rank's ``(start, stop)`` runs)."""
    from titan_upipe.costs.document_balance import runs_intervals, step_work

    work = np.zeros((ring_size, ring_size), dtype=np.int64)
    for lengths, runs in zip(rows, ring_runs, strict=True):
        work += step_work(lengths, runs_intervals(runs), ring_size)
    return work


def _shared_core_time(work: np.ndarray, ulysses_size: int, cores: int) -> float:
    """Lockstep ring steps on ``cores`` cores shared by ``R x U`` ranks, each ring rank's work split
    over its ``U`` Ulysses ranks: step ``t`` takes ``max(max_r W[r, t] / U, sum_r W[r, t] / cores)``."""
    return float(np.maximum(work.max(axis=0) / ulysses_size, work.sum(axis=0) / cores).sum())


def ring_balance(rows: list[list[int]], layout: RingLayout, cores: int | None = None) -> RingBalance:
    """The computed ring work of the batch (document lengths ``rows``) on ``layout``, relative to the
    same work perfectly balanced (``RingBalance``). ``cores``: the cores the ranks share (CPU)."""
    from titan_upipe.costs.document_balance import simulate_ring

    R, U = layout.ring_size, layout.ulysses_size
    work = ring_step_work(rows, layout.ring_runs, R).astype(float)
    per_rank, total = work.sum(axis=1), work.sum()
    schedule = (simulate_ring(work) + simulate_ring(BWD_FACTOR * work, backward=True)) / ((1 + BWD_FACTOR) * total / R)
    shared = None
    if cores is not None and R * U > cores:
        # balanced: every step's work spread evenly over the ranks, total / R^2 per ring rank
        flat = np.full_like(work, total / R**2)
        shared = _shared_core_time(work, U, cores) / _shared_core_time(flat, U, cores)
    return RingBalance(R, U, layout.balance, float(per_rank.max() / per_rank.mean()), float(schedule), shared,
                       1e3 * layout.build_s)


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
        from titan_upipe.toolkit.memory_tracker import LiveTensorTracker

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
    from titan_upipe.toolkit.memory_tracker import LiveTensorTracker

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


def _time_steps(cases, args: argparse.Namespace, mesh, device: torch.device, zero_grad) -> list:
    """``(wall, CPU)`` seconds of each forward+backward step of every case ``(run, inputs, grad_y)``,
    ``--iters`` steps after ``--warmup``, the cases taken in turn at every iteration (so a machine that
    slows down or speeds up over the run shifts them alike); ``ConfigError`` for a case that refused.
    CPU: this process's (``time.process_time``): on CPU ranks, the time it computed, without the
    time it waited for its ring peers or for a core."""
    from titan_upipe.errors import ConfigError

    times: list = [[] for _ in cases]
    for i in range(args.warmup + args.iters):
        for c, (run, inputs, grad_y) in enumerate(cases):
            if isinstance(times[c], ConfigError):
                continue
            fresh = _fresh(inputs)
            dist.barrier(group=mesh.get_group())
            _sync(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            try:
                run(*fresh).backward(grad_y)
            except ConfigError as err:  # refused before any collective, on every rank alike
                times[c] = err
                continue
            _sync(device)
            if i >= args.warmup:
                times[c].append((time.perf_counter() - start, time.process_time() - cpu_start))
            zero_grad()
    return times


def _document_masks(args: argparse.Namespace, device: torch.device, mesh=None) -> list[tuple[str | None, object]]:
    """``(balance, mask)`` of a variant's calls: ``(None, None)`` (plain causal) unless
    ``--no-causal``, and with ``--documents`` the mask of ``document_ids``, with its segments computed
    (once per mask in training too: every layer reads the same mask): on a ring ``mesh`` one per
    ``--document-balance``, otherwise one (balance None: the layout is the mesh's own)."""
    from titan_upipe.parallel.document_mask import document_mask
    from titan_upipe.parallel.mesh import mesh_degrees

    out: list[tuple[str | None, object]] = [] if args.no_causal else [(None, None)]
    if not args.documents:
        return out
    ids = document_ids(args).to(device)
    balances = args.document_balance if mesh is not None and mesh_degrees(mesh)[0] > 1 else [None]
    for balance in balances:
        mask = document_mask(ids, mesh, balance=balance or "zigzag", min_split=args.min_split)
        _ = mask.document_segments
        out.append((balance, mask))
    return out


def _ring_layout(args: argparse.Namespace, mesh, balance: str, mask) -> RingLayout:
    """The ring runs ``mask`` lays the batch out in on ``mesh``, and the time to build such a mask."""
    from titan_upipe.parallel.document_mask import document_mask
    from titan_upipe.parallel.mesh import mesh_degrees

    ring, ulysses = mesh_degrees(mesh)
    ids = document_ids(args)
    start = time.perf_counter()
    document_mask(ids, mesh, balance=balance, min_split=args.min_split)
    seconds = time.perf_counter() - start
    return RingLayout(ring, ulysses, balance, mask.ring_runs(ring), seconds)


def _layer_case(layer, table, mesh, mask, x_full, grad_full):
    """``(run, inputs, grad_y)`` of a converted layer on this rank's shard: the balanced mask's
    layout places each row's tokens (and their positions) per batch; otherwise the mesh's own."""
    from titan_upipe.parallel import shard_sequence

    batch_layout = None if mask is None else mask.layout
    x_local, positions = shard_sequence(x_full, mesh, 1, batch_layout)
    grad_y = shard_sequence(grad_full, mesh, 1, batch_layout)[0]
    return (lambda x: layer(x, table, mask, positions)), (x_local,), grad_y


def bench_rank(args: argparse.Namespace, mesh, device: torch.device) -> tuple[list[Row], list[RingLayout]]:
    """Every variant's rows (the slowest rank's time, the largest peaks) and the layouts the ring
    variants' documents rows ran on."""
    from titan_upipe.attention import convert_attention
    from titan_upipe.torchtitan_0_2.model_classes import register_model_classes

    register_model_classes()  # the core converts registered model families only (TorchTitan's Llama3, Qwen3)
    from titan_upipe.costs.attention_memory import (
        LayerShape,
        paper_table2_peak,
        paper_table6_peak,
        upipe_backward_peak,
        upipe_forward_terms,
    )
    from titan_upipe.errors import ConfigError
    from titan_upipe.parallel import context_parallel_mesh

    cp = mesh.size()
    module, table, dim, dtype = _build(args, device)
    x_full = torch.randn(args.batch, args.seq_len, dim, device=device, dtype=dtype)
    grad_full = torch.randn_like(x_full)
    shape = LayerShape(args.n_heads, args.n_kv_heads, args.head_dim, cp, args.seq_len, args.batch, dim,
                       dtype.itemsize)
    rows, layouts, seen = [], [], set()
    for variant in _variants(args, cp):
        if variant.mode == "local":
            make_run, local_inputs, local_grad = _local_case(args, cp, device, dtype)
            stages, masks = 1, _document_masks(args, device)
            cases = [(make_run(mask), local_inputs, local_grad) for _, mask in masks]
        else:
            variant_mesh = context_parallel_mesh(mesh, variant.mode, variant.ulysses_degree)
            layer = convert_attention(module, variant.mode, variant_mesh, variant.heads_per_stage,
                                      backend=args.backend)
            stages, masks = layer.schedule.n_stages, _document_masks(args, device, variant_mesh)
            cases = [_layer_case(layer, table, variant_mesh, mask, x_full, grad_full) for _, mask in masks]
        degrees = None
        for balance, mask in masks:
            if balance is not None:
                layout = _ring_layout(args, variant_mesh, balance, mask)
                degrees = (layout.ring_size, layout.ulysses_size)
                if (layout.ring_size, layout.ulysses_size, balance) not in seen:
                    seen.add((layout.ring_size, layout.ulysses_size, balance))
                    layouts.append(layout)
        timed = _time_steps(cases, args, mesh, device, lambda: module.zero_grad(set_to_none=True))
        for (balance, mask), (run, inputs, grad_y), seconds in zip(masks, cases, timed, strict=True):
            if isinstance(seconds, ConfigError):
                if mesh.get_rank() == 0:
                    print(f"skipped {variant.label} with documents: {seconds}")
                continue
            no_grad = _peak_forward_no_grad(run, inputs, device)
            fwd, bwd = _peak_step(run, _fresh(inputs), grad_y, device)
            module.zero_grad(set_to_none=True)
            mib = 2.0**20
            label = variant.label + (", documents" if mask is not None else "") + \
                (f", balance={balance}" if balance is not None else "")
            row = Row(label, stages, 1e3 * statistics.median(t for t, _ in seconds), no_grad / mib, fwd / mib,
                      bwd / mib, variant=variant.label, balance=balance,
                      degrees=degrees if balance is not None else None,
                      step_samples_ms=[1e3 * t for t, _ in seconds], cpu_samples_ms=[1e3 * c for _, c in seconds])
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
        # each step as long as its slowest rank
        row.step_samples_ms = [max(steps) for steps in zip(*(r[i].step_samples_ms for r in gathered), strict=True)]
        row.step_ms = statistics.median(row.step_samples_ms)
        per_rank_cpu = list(zip(*(r[i].cpu_samples_ms for r in gathered), strict=True))
        row.cpu_samples_ms = [max(steps) for steps in per_rank_cpu]
        row.cpu_total_samples_ms = [sum(steps) for steps in per_rank_cpu]
        row.forward_no_grad_peak_mib = max(r[i].forward_no_grad_peak_mib for r in gathered)
        row.forward_peak_mib = max(r[i].forward_peak_mib for r in gathered)
        row.backward_peak_mib = max(r[i].backward_peak_mib for r in gathered)
    return rows, layouts


def balance_lines(args: argparse.Namespace, rows: list[Row], layouts: list[RingLayout],
                  cores: int | None = None) -> tuple[list[str], list[str]]:
    """(header lines, lines after the table): each ring layout's computed work (``ring_balance``) and
    each ring variant's measured fwd+bwd time zigzag / documents beside the computed ratio."""
    from titan_upipe.costs.document_balance import split_threshold

    lengths = [document_lengths(args.seq_len, args.doc_seed + b) for b in range(args.batch)]
    computed = {(b.ring_size, b.ulysses_size, b.balance): b for b in (ring_balance(lengths, lay, cores)
                                                                     for lay in layouts)}
    head = []
    for b in computed.values():
        shared = "" if b.shared_cores is None else f", {b.shared_cores:.3f} on {cores} shared cores"
        # the job's layout zigzags documents from min(min_split, S / 4R) tokens on
        threshold = split_threshold(args.seq_len, b.ring_size, args.min_split)
        split = f", min_split {args.min_split} (splits documents >= {threshold})" if b.balance == "documents" else ""
        head.append(f"ring R={b.ring_size} x U={b.ulysses_size}, balance={b.balance}{split}: busiest / mean "
                    f"ring work {b.busiest_over_mean:.3f}, ring schedule {b.schedule:.3f}{shared} x balanced "
                    f"(computed); mask built in {b.build_ms:.1f} ms")
    tail = []
    by_variant: dict[str, dict[str, Row]] = {}
    for r in rows:
        if r.balance is not None:
            by_variant.setdefault(r.variant, {})[r.balance] = r
    for variant, pair in by_variant.items():
        if set(pair) != {"zigzag", "documents"}:
            continue
        zz, dd = (computed[(*pair[b].degrees, b)] for b in ("zigzag", "documents"))
        predicted = f"{zz.schedule / dd.schedule:.3f}"
        if zz.shared_cores is not None:
            predicted += f" ({zz.shared_cores / dd.shared_cores:.3f} on {cores} shared cores)"
        # steps of the two balances alternate, so each pair of steps ran on the same machine state
        wall = _paired_ratios(pair["zigzag"].step_samples_ms, pair["documents"].step_samples_ms)
        tail.append(f"{variant}: measured fwd+bwd zigzag / documents {wall}; computed attention time {predicted}")
        if cores is not None:
            cpu = _paired_ratios(pair["zigzag"].cpu_samples_ms, pair["documents"].cpu_samples_ms)
            tail.append(f"{variant}: busiest rank's CPU time zigzag / documents {cpu}; computed busiest / mean "
                        f"ring work {zz.busiest_over_mean / dd.busiest_over_mean:.3f}")
            # all ranks' CPU time over the wall time: the cores the step kept busy on average
            busy = ", ".join(f"{b} {_cores_busy(pair[b]):.2f}" for b in ("zigzag", "documents"))
            tail.append(f"{variant}: cores busy (all ranks' CPU time / wall time, median) {busy} of {cores}")
    return head, tail


def _cores_busy(row: Row) -> float:
    """Median over the steps of all ranks' CPU time over the wall time."""
    return statistics.median(c / w for c, w in zip(row.cpu_total_samples_ms, row.step_samples_ms, strict=True))


def _paired_ratios(numerators: list[float], denominators: list[float]) -> str:
    """The median of the step-by-step ratios, and their range."""
    ratios = sorted(a / b for a, b in zip(numerators, denominators, strict=True))
    return f"{statistics.median(ratios):.3f} (median of {len(ratios)} step pairs, {ratios[0]:.3f}-{ratios[-1]:.3f})"


def format_table(args: argparse.Namespace, cp: int, rows: list[Row], device_name: str,
                 layouts: list[RingLayout] = (), cores: int | None = None) -> str:
    head = (f"{args.model} H={args.n_heads} KV={args.n_kv_heads} D={args.head_dim} dim={args.dim} "
            f"S={args.seq_len} B={args.batch} C={cp} {args.dtype} backend={args.backend} on {device_name}, "
            f"torch {torch.__version__}{', weights frozen' if args.frozen_weights else ''}")
    cols = ["variant", "stages", "fwd+bwd ms", "fwd no-grad peak MiB", "fwd peak MiB", "bwd peak MiB"]
    cpu_column = bool(layouts) and cores is not None  # spawned CPU ranks with document layouts
    if cpu_column:
        cols[3:3] = ["busiest rank CPU ms", "all ranks CPU ms"]
    if args.compare_model:
        cols += ["model fwd", "model bwd", "paper T2 fwd", "paper T6 bwd"]
    balance_head, balance_tail = balance_lines(args, rows, list(layouts), cores) if layouts else ([], [])
    lines = [head, *([f"documents: {describe_documents(args)}"] if args.documents else []), *balance_head, "",
             "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        cells = [r.label, str(r.stages), f"{r.step_ms:.1f}", f"{r.forward_no_grad_peak_mib:.2f}",
                 f"{r.forward_peak_mib:.2f}", f"{r.backward_peak_mib:.2f}"]
        if cpu_column:
            cells[3:3] = [f"{r.cpu_ms:.1f}", f"{r.cpu_total_ms:.1f}"]
        if args.compare_model:
            cells += ["-" if v is None else f"{v:.2f}" for v in
                      (r.model_forward_mib, r.model_backward_mib, r.paper_forward_mib, r.paper_backward_mib)]
        lines.append("| " + " | ".join(cells) + " |")
    if balance_tail:
        lines += ["", *balance_tail]
    return "\n".join(lines)


def _spawned_rank(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    os.environ.setdefault("TITAN_UPIPE_DEVICE", "cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        rows, layouts = bench_rank(args, mesh, torch.device("cpu"))
        if rank == 0:
            results.put(([asdict(r) for r in rows], [asdict(lay) for lay in layouts]))
        # every rank done before any tears its groups down: a gloo peer whose other side closed
        # mid-teardown aborted the process now and then ("terminate called without an active exception")
        dist.barrier()
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
        rows, layouts = bench_rank(args, mesh, device)
        if dist.get_rank() == 0:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
            print(format_table(args, mesh.size(), rows, name, layouts))
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
    rows, layouts = results.get(timeout=10)
    print(format_table(args, args.cp, [Row(**r) for r in rows], f"{os.cpu_count()}-core CPU (gloo)",
                       [RingLayout(**lay) for lay in layouts], os.cpu_count()))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
