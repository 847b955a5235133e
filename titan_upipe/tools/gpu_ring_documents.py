"""The GPU suite's ``ring_documents`` stage (issue 35): the attention kernel time of every rank of a
ring of ``R`` ranks over one packed batch, under ``[upipe] document_balance = "zigzag"`` and
``"documents"``, timed on one GPU.

One GPU cannot run ``R`` NCCL ranks, and what differs between the layouts is each rank's kernel
work, so one process plays every ring rank in turn. Ring rank ``r`` at step ``t`` runs exactly the
ring's calls: ``DocumentMask.ring_calls(ring_plan.document_step_calls, r, R, t)`` against the K/V
of ring rank ``(r - t) mod R``, through ``RingAttentionBackend``'s own ``_blocks`` /
``_kernel_forward`` / ``_kernel_backward`` (forward, the merge, then the backward from the merged
out/lse). For every case the stage reports, from CUDA events around each step's kernel calls (the
merges and the transfers are not in them)::

    fwd[r, t], bwd[r, t]     milliseconds of rank r's calls at step t     ([R, R])
    rank[r]                = sum_t (fwd[r, t] + bwd[r, t])
    busiest / mean         = max_r rank[r] / mean_r rank[r]
    ring step              = sum_t max_r fwd[r, t] + sum_t max_r bwd[r, t]
                             (the synchronous ring: every step waits for its slowest rank)

beside the computed figures of the same batch and layout (``costs.document_balance``):
``W = step_work`` (visible pairs per rank and step), busiest / mean ``= imbalance(W)["total"]``
and ring step / mean ``= imbalance(W)["stepwise"]``. Every run also counts the (query, key) pairs
its kernel calls cover (from the slices and segments it hands the kernel) and checks them equal to
``W``: a result whose calls do not cover the batch's mask exactly is reported as failed.

Shapes (``RING_SHAPE``): Llama3-8B on a plain ring (Ulysses ``U = 1``): every ring rank holds all
32 query and 8 KV heads of dim 128, ``q [1, 32, S/R, 128]``, ``k``/``v [1, 8, S/R, 128]``, bf16,
laid out as the projections make them (``[B, S, H, D]`` transposed). Under USP each of the ``U``
Ulysses ranks of a ring rank runs the same calls on ``1/U`` of the heads (the layout's ring runs
do not depend on ``U``): the times divide by about ``U``, the ratios stay. The kernel is the
fastest varlen one here (``choose_backend("auto", varlen=True)``: the flash-attn packages); without
one the stage reports why and times nothing, since CUDA refuses packed documents on a kernel
without ``cu_seqlens`` (``documents.document_kernel_problem``).

Batch: one row of ``S`` tokens, ``mixed-0.005`` seed 0 of ``costs.document_mixes``
(2K-token web documents with 0.5 % of them 100K-1M long, a window of the stream): at 1M 253
documents, the longest 271651 tokens; at 128K 48 documents, none of the default
``document_min_split`` (16384), but the job's threshold is ``min(16384, max(S/(4R), 2R x 128))`` (4096 at R = 16:
``costs.document_balance.split_threshold``), so the longer ones are zigzagged there too.

Run order: 128K before 1M, each at ``R = 8`` then 16, zigzag then documents; one warm-up pass of
every rank (first-use compilation, the per-step segment tables) before the timed passes, each
``(r, t)`` the median of ``gpu_attention.repeats_for(S)`` passes (3 below 1M, 1 from 1M).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from titan_upipe.attention.backends import BACKENDS, LocalAttentionBackend, choose_backend, default_scale
from titan_upipe.attention.ring import RingAttentionBackend, merge_partial
from titan_upipe.attention.ring_plan import DocumentPlan, document_step_calls, kv_source
from titan_upipe.costs.document_balance import imbalance, job_intervals, step_work
from titan_upipe.costs.document_mixes import make_batch
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.document_mask import DocumentMask, SegmentTable, document_mask
from titan_upipe.spec.settings import DEFAULT_MIN_SPLIT, DOCUMENT_BALANCES
from titan_upipe.tools.gpu_attention import ASSUMED_TFLOPS, repeats_for

K, M = 1024, 1024 * 1024
STAGE = "ring_documents"
RING_LENGTHS = {"128K": 128 * K, "1M": M}
"""The stage's lengths on a GPU (``--lengths``), the short one first (the queue's two items)."""
RINGS = (8, 16)
BALANCES = DOCUMENT_BALANCES
MIX, MIX_SEED = "mixed-0.005", 0
"""The batch: ``costs.document_mixes.make_batch(MIX, S, MIX_SEED)`` (docs/benchmarks/document_balance.md's mixes)."""

CPU_LENGTHS = {"4K": 4 * K}
CPU_RINGS = (2, 4)
CPU_MIN_SPLIT = 1024
"""What ``make test`` runs on CPU (fp32, ``sdpa``'s per-segment loop): the stage's bookkeeping and
the driver, not speeds. At 4K tokens the mix gives documents of 2182, 1818 and 96 tokens: two
split at this ``min_split``, one dealt whole."""

STARTUP_S = 60.0
"""The stage's start in a call: process, CUDA context and the first-use compilation of the varlen
kernel's forward and backward and the dense non-causal ones (an assumption: nothing measured yet)."""
CASE_SETUP_S = 10.0
"""Per case: the batch's layout and plan and the random inputs of every rank (an assumption)."""
BACKWARD_FACTOR = 2.5
"""Backward FLOPs over forward (``gpu_attention.causal_flops``: five matmuls against two)."""


@dataclass(frozen=True)
class RingShape:
    """One ring rank's attention heads (after the Ulysses all-to-all, ``ulysses`` > 1)."""

    q_heads: int
    kv_heads: int
    head_dim: int
    ulysses: int = 1


RING_SHAPE = RingShape(32, 8, 128)
"""Llama3-8B (32 query / 8 KV heads of dim 128) on a plain ring."""
CPU_SHAPE = RingShape(2, 1, 16)


@functools.cache
def batch_lengths(mix: str, tokens: int, seed: int) -> list[int]:
    """One packed row of ``tokens`` tokens: its document lengths, in order."""
    return [int(n) for n in make_batch(mix, tokens, seed)]


@dataclass(frozen=True)
class RingCase:
    """One timing: a batch of ``tokens`` over a ring of ``ring`` ranks in the layout ``balance``."""

    length: str
    tokens: int
    ring: int
    balance: str
    shape: RingShape = RING_SHAPE
    min_split: int = DEFAULT_MIN_SPLIT
    mix: str = MIX
    seed: int = MIX_SEED

    @property
    def name(self) -> str:
        return f"{STAGE} {self.length} R={self.ring} {self.balance}"

    def lengths(self) -> list[int]:
        return batch_lengths(self.mix, self.tokens, self.seed)

    def passes(self) -> int:
        """Passes over every rank on a GPU: one warm-up and ``repeats_for(S)`` timed ones."""
        return 1 + repeats_for(self.tokens)

    def estimate_s(self) -> float:
        """``CASE_SETUP_S`` plus every pass at ``ASSUMED_TFLOPS``: a pass is the batch's visible
        pairs ``sum_d L_d (L_d + 1) / 2`` (the same in every layout) at ``4 D Hq`` forward FLOPs
        each, ``1 + BACKWARD_FACTOR`` times for forward and backward."""
        pairs = sum(n * (n + 1) // 2 for n in self.lengths())
        flops = 4.0 * self.shape.head_dim * self.shape.q_heads * pairs * (1 + BACKWARD_FACTOR)
        return CASE_SETUP_S + self.passes() * flops / (ASSUMED_TFLOPS * 1e12)

    def describe(self) -> dict:
        return {"check": STAGE, "name": self.name, "length": self.length, "tokens": self.tokens, "ring": self.ring,
                "balance": self.balance, "ulysses": self.shape.ulysses, "q_heads": self.shape.q_heads,
                "kv_heads": self.shape.kv_heads, "head_dim": self.shape.head_dim, "mix": self.mix,
                "seed": self.seed, "min_split": self.min_split}


def plan_cases(device: str, lengths: dict[str, int] | None = None) -> list[RingCase]:
    """Length-major, then ring, then balance; on CPU the tiny cases (whatever ``lengths`` says)."""
    if device != "cuda":
        return [RingCase(label, tokens, ring, balance, CPU_SHAPE, CPU_MIN_SPLIT)
                for label, tokens in CPU_LENGTHS.items() for ring in CPU_RINGS for balance in BALANCES]
    lengths = RING_LENGTHS if lengths is None else lengths
    return [RingCase(label, tokens, ring, balance) for label, tokens in lengths.items()
            for ring in RINGS for balance in BALANCES]


def computed_work(rows: list[list[int]], ring: int, balance: str, min_split: int) -> np.ndarray:
    """``W[r, t]`` summed over the rows (``rows``: each row's document lengths), in closed form:
    ``costs.document_balance.step_work`` over the layout the job runs (``job_intervals``: the fixed
    zigzag's chunks, or the document-aware deal ``DocumentMask.balanced`` lays out)."""
    W = np.zeros((ring, ring), dtype=np.int64)
    for lengths in rows:
        W += step_work(lengths, job_intervals(lengths, ring, balance, min_split), ring)
    return W


def batch_mask(rows: list[list[int]], ring: int, balance: str, min_split: int) -> DocumentMask:
    """The mask the trainer builds for ``rows`` (public ``document_mask``), with the batch's
    ``BatchDocumentLayout`` over ``ring`` ranks for ``"documents"`` (``DocumentMask.balanced``)."""
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])
    mask = document_mask(ids)
    return mask if balance == "zigzag" else mask.balanced(ring, 1, min_split)


def ring_positions(mask: DocumentMask, ring: int, rank: int) -> torch.Tensor:
    """``[B, S/R]`` int64: the global positions of ring rank ``rank``'s ring-local sequence (its runs
    in global order), per row: how a ring-local tensor relates to the whole sequence."""
    return torch.stack([torch.cat([torch.arange(a, b) for a, b in row[rank]]) for row in mask.ring_runs(ring)])


# --- the single-process ring driver ---------------------------------------------------------------


class Clock:
    """Marks on the host clock (CPU: every kernel returns finished)."""

    def mark(self):
        return time.perf_counter()

    def sync(self) -> None:
        pass

    @staticmethod
    def ms(start, stop) -> float:
        return (stop - start) * 1e3


class CudaClock(Clock):
    """CUDA events in the current stream: the GPU's time between two marks, read after ``sync``
    (no host sync between a rank's steps, so the launches run ahead of the kernels as in the ring)."""

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        torch.cuda.synchronize()

    @staticmethod
    def ms(start, stop) -> float:
        return start.elapsed_time(stop)


class RingInputs:
    """Random ring-local ``q``, ``dout`` and K/V of each ring rank, ``[B, h, S/R, D]`` views of
    ``[B, S/R, h, D]`` tensors (the projections' layout); each rank's K/V made once and kept (every
    rank reads every other's), its ``q`` and ``dout`` made when it runs."""

    def __init__(self, batch: int, local_len: int, shape: RingShape, dtype: torch.dtype, device: str) -> None:
        self.batch, self.local_len, self.shape, self.dtype, self.device = batch, local_len, shape, dtype, device
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _randn(self, heads: int, seed: int) -> torch.Tensor:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        t = torch.randn(self.batch, self.local_len, heads, self.shape.head_dim, generator=gen, device=self.device,
                        dtype=self.dtype)
        return t.transpose(1, 2)

    def q(self, rank: int) -> torch.Tensor:
        return self._randn(self.shape.q_heads, 4 * rank)

    def dout(self, rank: int) -> torch.Tensor:
        return self._randn(self.shape.q_heads, 4 * rank + 1)

    def kv(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        if rank not in self._kv:
            self._kv[rank] = (self._randn(self.shape.kv_heads, 4 * rank + 2),
                              self._randn(self.shape.kv_heads, 4 * rank + 3))
        return self._kv[rank]


def call_pairs(q: torch.Tensor, k: torch.Tensor, how: bool | SegmentTable) -> int:
    """(query, key) pairs one kernel call covers, from what it is handed: a segment table's
    causal segments ``n (n + 1) / 2`` each, a causal block ``n (n + 1) / 2`` per row, a full one
    ``Sq Sk`` per row (heads not counted: ``W`` counts pairs of tokens)."""
    if isinstance(how, SegmentTable):
        return sum((b - a) * (b - a + 1) // 2 for row in how.rows for a, b in row)
    rows, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    return rows * (sq * (sq + 1) // 2 if how else sq * sk)


@dataclass
class RingTiming:
    """One pass over every ring rank: ``[R, R]`` milliseconds and pairs by (rank, step)."""

    fwd_ms: np.ndarray
    bwd_ms: np.ndarray
    pairs: np.ndarray
    calls: int
    outputs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """Each rank's merged ``(out, lse)`` (``keep_outputs``; the tests compare them with the mask's
    attention over the whole sequence)."""


def time_ring_ranks(mask: DocumentMask, ring: int, local: LocalAttentionBackend, inputs: RingInputs, scale: float,
                    clock: Clock, keep_outputs: bool = False, plan: DocumentPlan = document_step_calls) -> RingTiming:
    """Every ring rank's forward and backward ring pass, rank after rank, with the ring's own block
    plan and kernel calls (module docstring); ``plan`` is replaceable only to show the tests catch
    a wrong one."""
    fwd, bwd = np.zeros((ring, ring)), np.zeros((ring, ring))
    pairs = np.zeros((ring, ring), dtype=np.int64)
    calls, outputs = 0, []
    for rank in range(ring):
        backend = RingAttentionBackend(local, None, rank, ring, documents=mask, document_plan=plan)
        q = inputs.q(rank)
        # planned before the clock runs, as the trainer plans once per batch for every layer
        blocks = [backend._blocks(step, backend._slot_len(q)) for step in range(ring)]
        held = [inputs.kv(kv_source(rank, ring, step)) for step in range(ring)]
        out_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse_acc = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        marks = []
        for step in range(ring):
            k, v = held[step]
            start = clock.mark()
            parts = [backend._kernel_forward(q[qi], k[ki], v[ki], scale, how) for qi, ki, how in blocks[step]]
            marks.append((start, clock.mark()))
            for (qi, ki, how), (out, lse) in zip(blocks[step], parts, strict=True):
                merge_partial(out_acc[qi], lse_acc[qi], out, lse)
                pairs[rank, step] += call_pairs(q[qi], k[ki], how)
            calls += len(parts)
            del parts
        out, lse = out_acc.to(q.dtype), lse_acc
        del out_acc
        dout = inputs.dout(rank)
        for step in range(ring):
            k, v = held[step]
            start = clock.mark()
            grads = [backend._kernel_backward(dout[qi], q[qi], k[ki], v[ki], out[qi], lse[qi].contiguous(), scale, how)
                     for qi, ki, how in blocks[step]]
            marks.append((start, clock.mark()))
            del grads
        clock.sync()
        times = [clock.ms(a, b) for a, b in marks]
        fwd[rank], bwd[rank] = times[:ring], times[ring:]
        if keep_outputs:
            outputs.append((out, lse))
    return RingTiming(fwd, bwd, pairs, calls, outputs)


def summarize(fwd_ms: np.ndarray, bwd_ms: np.ndarray) -> dict:
    """The measured figures of one case (module docstring)."""
    rank = fwd_ms.sum(axis=1) + bwd_ms.sum(axis=1)
    ring_step = float(fwd_ms.max(axis=0).sum() + bwd_ms.max(axis=0).sum())
    return {"rank_ms": rank.tolist(), "busiest_over_mean": float(rank.max() / rank.mean()),
            "ring_step_ms": ring_step, "ring_step_over_mean": ring_step / float(rank.mean())}


def varlen_backend(device: str) -> str:
    """The kernel the stage times: on CUDA the fastest varlen one (ConfigError, saying why, where
    there is none); on CPU ``sdpa`` (the per-segment loop, the exact CPU path)."""
    if device != "cuda":
        return "sdpa"
    return choose_backend("auto", torch.bfloat16, ring=True, head_dim=RING_SHAPE.head_dim, varlen=True).name


def time_case(case: RingCase, device: str, backend: str, repeats: int | None = None,
              clock: Clock | None = None) -> dict:
    """One case: the warm-up pass, ``repeats`` timed passes (each ``(r, t)`` their median; default
    ``repeats_for(S)`` on a GPU, one on CPU), the summary and the computed figures beside it."""
    rows = [case.lengths()]
    mask = batch_mask(rows, case.ring, case.balance, case.min_split)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    inputs = RingInputs(len(rows), case.tokens // case.ring, case.shape, dtype, device)
    local = BACKENDS[backend]()
    clock = clock or (CudaClock() if device == "cuda" else Clock())
    scale = default_scale(case.shape.head_dim)
    repeats = repeats or (repeats_for(case.tokens) if device == "cuda" else 1)
    passes = [time_ring_ranks(mask, case.ring, local, inputs, scale, clock) for _ in range(1 + repeats)][1:]
    fwd = np.array([[statistics.median(p.fwd_ms[r, t] for p in passes) for t in range(case.ring)]
                    for r in range(case.ring)])
    bwd = np.array([[statistics.median(p.bwd_ms[r, t] for p in passes) for t in range(case.ring)]
                    for r in range(case.ring)])
    W = computed_work(rows, case.ring, case.balance, case.min_split)
    computed = imbalance(W)
    pairs = passes[0].pairs
    result = {"backend": backend, "dtype": str(dtype).removeprefix("torch."), "documents": len(rows[0]),
              "longest": max(rows[0]), "repeats": repeats, "calls": passes[0].calls,
              "fwd_ms": fwd.tolist(), "bwd_ms": bwd.tolist(), **summarize(fwd, bwd),
              "computed_busiest_over_mean": computed["total"], "computed_ring_step_over_mean": computed["stepwise"],
              "pairs": pairs.tolist(), "pairs_match": bool(np.array_equal(pairs, W))}
    if not result["pairs_match"]:
        result["ok"] = False
        result["error"] = "the kernel calls' (query, key) pairs differ from costs.document_balance.step_work"
    return result


def run_ring_documents_stage(device: str, deadline: float | None = None,
                             on_result: Callable[[list[dict], list[dict]], None] | None = None,
                             lengths: dict[str, int] | None = None) -> list[dict]:
    """Every case in order while the next one's estimate fits before ``deadline``
    (``time.monotonic()``); the rest listed as not run. ``on_result(results, not_run)`` after each."""
    results: list[dict] = []
    not_run: list[dict] = []
    try:
        backend = varlen_backend(device)
    except ConfigError as exc:
        results.append({"check": STAGE, "skipped": True, "ok": True, "detail": str(exc)})
        if on_result:
            on_result(results, not_run)
        return results
    cases = plan_cases(device, lengths)
    for i, case in enumerate(cases):
        if deadline is not None and time.monotonic() + case.estimate_s() > deadline:
            not_run = [{"name": c.name, "estimate_s": c.estimate_s(),
                        "command": f"python -m titan_upipe.gpu_suite --stage {STAGE} --lengths {c.length}"}
                       for c in cases[i:]]
            break
        try:
            result = {"ok": True, **time_case(case, device, backend)}
        except torch.OutOfMemoryError:
            result = {"ok": True, "oom": True}
        except Exception as exc:  # a kernel that fails at this shape: reported, the stage goes on
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        results.append({**case.describe(), **result})
        print(f"[{STAGE}] {case.name}: " + ("OOM" if result.get("oom") else "FAILED" if not result["ok"] else
              f"busiest/mean {result['busiest_over_mean']:.2f} (computed {result['computed_busiest_over_mean']:.2f}), "
              f"ring step {result['ring_step_ms']:.1f} ms"), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
        if on_result:
            on_result(results, not_run)
    if on_result:
        on_result(results, not_run)
    return results


__all__ = ["BALANCES", "RINGS", "RING_LENGTHS", "RING_SHAPE", "STAGE", "RingCase", "RingInputs", "RingTiming",
           "batch_mask", "computed_work", "plan_cases", "ring_positions", "run_ring_documents_stage", "summarize",
           "time_case", "time_ring_ranks"]
