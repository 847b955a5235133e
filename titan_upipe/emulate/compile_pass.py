"""The attention kernels' first use, run before the first step and timed apart (``compile_s``).

FlashAttention-4 compiles each kernel at the first call of its compile key (about 6 s per
process on an H200, 2026-11-27); cuDNN builds plans and cuBLAS handles at first use too. Inside
step 1 that time is the step's. Here every converted attention's kernel runs forward and
backward once, at the shapes the step calls it with (the compile key of FlashAttention-4 also
depends on length-derived choices: split-KV, single-block kernels), so ``compile_s`` is the
compilation plus one execution of each distinct call.

Per rank, with batch ``B``, sequence ``S``, head dim ``D`` and the module's head schedule:

* Ulysses, UPipe: ``q [B, U/C, S, D]`` and ``k, v [B, kv, S, D]`` for each distinct stage shape
  (``kv``: this rank's KV heads of the stage, or ``U/C`` where they are expanded per query head),
  causal;
* ring, USP, UPipe in USP: the ring around the kernel over ``S / R`` tokens (its causal and full
  blocks; its exchanges run as the step's do: fake, or on every rank of a real job at once);
* TSP: a zigzag chunk ``S / 2D`` of one KV bucket's query heads against one chunk of keys,
  causal and full.

Packed documents (``block_causal``) run other kernels (varlen, per document): those first run in
the warm-up step(s), which ``measure.py`` samples the compile counters around as well.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from titan_upipe.attention import ContextParallelAttention
from titan_upipe.attention.backend_base import LocalAttentionBackend
from titan_upipe.parallel.mesh import ulysses_part
from titan_upipe.tsp.modules import TSPAttention


@dataclass(frozen=True)
class KernelCall:
    """One kernel call of a step, as far as its compilation is concerned."""

    kernel: LocalAttentionBackend
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    scale: float
    causal: bool

    @property
    def key(self) -> tuple:
        """What tells two calls apart (the blocks' ring kernels are distinct objects of one kind)."""
        return (self.kernel.name, self.batch, self.q_heads, self.kv_heads, self.q_len, self.kv_len,
                self.head_dim, self.causal)


def _stage_head_counts(module: ContextParallelAttention) -> list[tuple[int, int]]:
    """(query heads, KV heads) the kernel sees in each stage on this rank, in stage order, distinct."""
    schedule = module.schedule
    _, rank, _ = ulysses_part(module.cp_mesh)
    counts = []
    for stage in schedule.stages:
        queries = len(stage.query_heads_per_rank[rank])
        expanded = stage.local_kv_index(rank, schedule.n_rep) is not None
        pair = (queries, queries if expanded else len(stage.kv_heads_per_rank[rank]))
        if pair not in counts:
            counts.append(pair)
    return counts


def kernel_calls(module: ContextParallelAttention, batch: int, seq_len: int) -> list[KernelCall]:
    """The distinct kernel calls of one converted attention module in a step of ``seq_len`` tokens."""
    d, scale = module.head_dim, module.spec.scale
    if isinstance(module, TSPAttention):
        shards = module.shards
        bucket = module.kv_heads_per_bucket or shards.kv_heads
        chunk = seq_len // (2 * module.cp_degree)
        q_heads = bucket * (shards.n_heads // shards.n_kv_heads)
        return [KernelCall(module.backend, batch, q_heads, bucket, chunk, chunk, d, scale, causal)
                for causal in (True, False)]
    kernel = module.ring_backend if module.ring_degree > 1 else module.backend
    length = seq_len // module.ring_degree
    return [KernelCall(kernel, batch, q, kv, length, length, d, scale, True) for q, kv in _stage_head_counts(module)]


def _run_call(call: KernelCall, dtype: torch.dtype, device: torch.device) -> None:
    def tensor(heads: int, length: int) -> torch.Tensor:
        return torch.randn(call.batch, heads, length, call.head_dim, dtype=dtype, device=device)

    q, k, v = tensor(call.q_heads, call.q_len), tensor(call.kv_heads, call.kv_len), tensor(call.kv_heads, call.kv_len)
    out, lse = call.kernel.forward(q, k, v, call.scale, causal=call.causal)
    call.kernel.backward(torch.randn_like(out), q, k, v, out, lse, call.scale, causal=call.causal)


def run_compile_pass(model: nn.Module, batch: int, seq_len: int, dtype: torch.dtype, device: torch.device,
                     sync: Callable[[], None]) -> float:
    """Every distinct kernel call of ``model``'s converted attention, forward and backward once;
    the wall seconds (synchronised). The blocks cached on the device are released after it, so the
    first step's reserved memory is what it would be without the pass."""
    calls: dict[tuple, KernelCall] = {}
    for module in model.modules():
        if isinstance(module, ContextParallelAttention):
            for call in kernel_calls(module, batch, seq_len):
                calls.setdefault(call.key, call)
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        for call in calls.values():
            _run_call(call, dtype, device)
    sync()
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return elapsed
