"""The GPU suite's ``attention`` stage: forward and backward TFLOP/s of every usable local attention
kernel at one rank's shapes of the recipes, ranked; the ranking is ``auto``'s order on that GPU.

Shapes (bf16, head_dim 128, causal; what one rank's kernel sees after the Ulysses all-to-all):

=========== ================ ============================================================
shape       q / KV heads     the recipe
=========== ================ ============================================================
llama3_8b   4 / 1            Llama3-8B (32 / 8 heads) over C = 8: UPipe's stages together
qwen3_32b   8 / 1            Qwen3-32B (64 / 8 heads) under Ulysses 8 (UPipe-in-USP 8 x 2)
=========== ================ ============================================================

at 128K and 1M tokens, and 2M where the call's budget allows; plus a varlen case (packed
documents, ``DOCUMENT_MIX``, 128K tokens) for the backends with a varlen kernel. Before timing, a
backend must pass the contract (``attention.contract``, bf16) on this device: one that fails is
reported, not timed, and leaves ``auto`` here (``costs.kernel_speed``).

FLOPs of causal attention (``kernel_speed.causal_flops``, over a sequence of ``L`` tokens, ``H``
query heads of dim ``D``: the half of ``QK^T`` and ``PV`` a causal mask keeps, two flops per
multiply-add):

    fwd = 2 * H * D * L^2          bwd = 2.5 * fwd   (five matmuls against two)

summed over the documents of a varlen call. Times are CUDA-event medians after a warm-up call
(which also pays a JIT kernel's first compilation); one timed call per case at 1M and beyond.
Results go to the stage report and ``titan_upipe/resources/kernel_speed.csv`` (this device's rows
replaced; each row carries the GPU's architecture, ``sm90`` on an H100 or H200, and the dtype, bf16).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from titan_upipe.attention.backends import AUTO_ORDER, BACKENDS, choose_backend, current_arch
from titan_upipe.contracts.backend import check_contract, contract_cases
from titan_upipe.costs.kernel_speed import (
    ASSUMED_TFLOPS,
    KERNEL_SPEED_CSV,
    arch_of_device,
    attention_rate,
    causal_flops,
    dense_seconds,
    read_rows,
    scores,
    write_rows,
)
from titan_upipe.errors import ConfigError

K, M = 1024, 1024 * 1024
HEAD_DIM = 128
DTYPE = "bf16"
"""What the stage times (``kernel_speed.dtype_name`` of the training dtype of the recipes)."""


@dataclass(frozen=True)
class KernelShape:
    """One rank's attention heads in a recipe."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int = HEAD_DIM


SHAPES = (KernelShape("llama3_8b", 4, 1), KernelShape("qwen3_32b", 8, 1))
DENSE_LENGTHS = {"128K": 128 * K, "1M": M, "2M": 2 * M}
VARLEN_TOKENS = 128 * K
DOCUMENT_MIX = ((0.55, 1024), (0.30, 8 * K), (0.15, 48 * K))
"""(share of documents, median length): short web pages, articles, long books/code; each length
log-normal around its median (sigma 0.6), clipped to [64, 128K], packed until 128K tokens."""
CPU_LENGTHS = {"256": 256}
"""What ``make test`` runs on CPU (``sdpa``'s CPU kernel): the stage's bookkeeping, not speeds."""


def repeats_for(tokens: int) -> int:
    """Timed calls per case: the median of 3 below 1M tokens, one from 1M on (seconds each)."""
    return 3 if tokens < M else 1


def document_lengths(total: int, seed: int = 0) -> list[int]:
    """A packed row of ``total`` tokens drawn from ``DOCUMENT_MIX`` (the last document cut to fit)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        share = rng.random()
        median = next(m for s, m in _cumulative(DOCUMENT_MIX) if share <= s)
        n = int(min(max(rng.lognormvariate(0.0, 0.6) * median, 64), 128 * K))
        lengths.append(min(n, total - sum(lengths)))
    return lengths


def _cumulative(mix: tuple[tuple[float, int], ...]) -> list[tuple[float, int]]:
    out, acc = [], 0.0
    for share, median in mix:
        acc += share
        out.append((acc, median))
    out[-1] = (1.0, out[-1][1])
    return out


@dataclass(frozen=True)
class Case:
    backend: str
    shape: KernelShape
    length: str
    tokens: int
    kind: str = "dense"
    """``dense``: one causal sequence; ``varlen``: ``document_lengths(tokens)`` packed."""

    @property
    def name(self) -> str:
        return f"{self.backend} {self.shape.name} {self.length} {self.kind}"

    def lengths(self) -> list[int]:
        return [self.tokens] if self.kind == "dense" else document_lengths(self.tokens)

    def estimate_s(self, rows: list[dict] | None = None, arch: str | None = None) -> float:
        """The calls ``time_case`` makes (a warm-up and ``repeats`` timed forward + backward pairs) at the
        rate measured on ``arch`` (the table), else at ``ASSUMED_TFLOPS``, plus 5 s of set-up."""
        measured = dense_seconds(rows or [], arch, self.backend, self.shape.name, self.tokens) if arch else None
        if measured is None:
            fwd, bwd = causal_flops(self.lengths(), self.shape.q_heads, self.shape.head_dim)
            measured = (fwd + bwd) / (ASSUMED_TFLOPS * 1e12)
        return 5.0 + (1 + repeats_for(self.tokens)) * measured


def layer_attention_seconds(tokens: int, backend: str, arch: str | None, rows: list[dict] | None = None,
                            forwards: int = 2) -> float:
    """Seconds of one layer's attention of Llama3-8B over 8 GPUs at ``tokens`` (one rank's causal
    attention, ``SHAPES[0]``: 4 query heads of 128 over the whole sequence) with ``backend`` on
    ``arch``: its FLOPs over the kernel table's rates (``kernel_speed.attention_rate``), ``forwards``
    forward passes (2: full activation checkpointing runs the forward again in backward) and one
    backward."""
    shape = SHAPES[0]
    rate = attention_rate(backend, arch, shape.head_dim, DTYPE, rows, AUTO_ORDER)
    return rate.seconds(*causal_flops([tokens], shape.q_heads, shape.head_dim), forwards=forwards)


def usable_backends(device: str) -> tuple[list[str], dict[str, str]]:
    """Backends that run bf16 heads of dim 128 here, and why each other one does not."""
    usable, skipped = [], {}
    for name in AUTO_ORDER:
        if device != "cuda" and name != "sdpa":
            skipped[name] = "runs on CUDA tensors only"
            continue
        try:
            choose_backend(name, torch.bfloat16, head_dim=HEAD_DIM)
        except ConfigError as exc:
            skipped[name] = str(exc)
            continue
        usable.append(name)
    return usable, skipped


def plan_cases(device: str, backends: list[str], lengths: dict[str, int] | None = None) -> list[Case]:
    """Dense cases length-major (every backend at 128K before any at 1M), then the varlen cases."""
    if lengths is None:
        lengths = DENSE_LENGTHS if device == "cuda" else CPU_LENGTHS
    cases = [Case(b, shape, label, tokens) for label, tokens in lengths.items() for shape in SHAPES for b in backends]
    # the varlen case rides with the shortest dense length of the stage's calls (128K on a GPU)
    varlen_tokens = VARLEN_TOKENS if device == "cuda" else min(lengths.values())
    if varlen_tokens in lengths.values():
        label = next(label for label, tokens in lengths.items() if tokens == varlen_tokens)
        cases += [Case(b, SHAPES[0], label, varlen_tokens, "varlen") for b in backends if BACKENDS[b].varlen]
    return cases


def _inputs(case: Case, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(0)
    shape = case.shape

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=torch.bfloat16)

    if case.kind == "dense":
        return (randn(1, shape.q_heads, case.tokens, shape.head_dim), randn(1, shape.kv_heads, case.tokens, shape.head_dim),
                randn(1, shape.kv_heads, case.tokens, shape.head_dim))
    return (randn(case.tokens, shape.q_heads, shape.head_dim), randn(case.tokens, shape.kv_heads, shape.head_dim),
            randn(case.tokens, shape.kv_heads, shape.head_dim))


def _timer(device: str) -> Callable[[Callable[[], object]], tuple[object, float]]:
    def timed(fn):
        if device == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            stop.record()
            torch.cuda.synchronize()
            return out, start.elapsed_time(stop)
        began = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - began) * 1e3
    return timed


def time_case(case: Case, device: str, repeats: int | None = None) -> dict:
    """Median fwd and bwd milliseconds of one case (after a warm-up call of each), and TFLOP/s."""
    backend = BACKENDS[case.backend]()
    q, k, v = _inputs(case, device)
    scale = case.shape.head_dim ** -0.5
    lengths = case.lengths()
    if case.kind == "dense":
        forward = lambda: backend.forward(q, k, v, scale, True)  # noqa: E731
    else:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        forward = lambda: backend.varlen_forward(q, k, v, scale, cu, max(lengths))  # noqa: E731
    timed = _timer(device)
    repeats = repeats or repeats_for(case.tokens)
    (out, lse), _ = timed(forward)  # warm-up (first-use compilation)
    dout = torch.randn_like(out)
    if case.kind == "dense":
        backward = lambda: backend.backward(dout, q, k, v, out, lse, scale, True)  # noqa: E731
    else:
        backward = lambda: backend.varlen_backward(dout, q, k, v, out, lse, scale, cu, max(lengths))  # noqa: E731
    timed(backward)
    fwd_ms = sorted(timed(forward)[1] for _ in range(repeats))[repeats // 2]
    bwd_ms = sorted(timed(backward)[1] for _ in range(repeats))[repeats // 2]
    fwd_flops, bwd_flops = causal_flops(lengths, case.shape.q_heads, case.shape.head_dim)
    return {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "fwd_tflops": fwd_flops / fwd_ms / 1e9,
            "bwd_tflops": bwd_flops / bwd_ms / 1e9, "documents": len(lengths)}


def contract_verdict(name: str, device: str) -> tuple[bool, str]:
    """The backend's bf16 contract on this device (small shapes): ("ok" or the worst failure)."""
    backend = BACKENDS[name]()
    for case in contract_cases((torch.bfloat16,)):
        result = check_contract(backend, case, device)
        if not result.ok:
            worst = max(result.split, key=lambda n: max(result.whole[n], result.split[n]) / result.allowed[n])
            return False, (f"failed {case.id}: {worst} whole {result.whole[worst]:.2e}, split "
                           f"{result.split[worst]:.2e}, allowed {result.allowed[worst]:.2e}")
    return True, "ok"


def case_key(result: dict) -> tuple:
    return result.get("backend"), result.get("shape"), result.get("length"), result.get("kind")


def run_attention_stage(device: str, deadline: float | None = None, environment: dict | None = None,
                        on_result: Callable[[list[dict], list[dict]], None] | None = None,
                        lengths: dict[str, int] | None = None, measured: set[tuple] = frozenset()) -> list[dict]:
    """Contract, then timing, of every usable backend; a case whose estimate no longer fits before
    ``deadline`` (``time.monotonic()``) is listed as not run, and a case in ``measured``
    (``case_key``s an earlier call timed on this GPU) is not timed again. ``on_result(results,
    not_run)`` after each case. On CUDA this call's rows go into ``titan_upipe/resources/kernel_speed.csv``."""
    environment = environment or {}
    usable, skipped = usable_backends(device)
    results = [{"check": "attention", "backend": name, "skipped": True, "ok": True, "contract": f"skipped: {why}"}
               for name, why in skipped.items()]
    passed = []
    for name in usable:
        ok, verdict = contract_verdict(name, device)
        if ok:
            passed.append(name)
        else:
            results.append({"check": "attention", "backend": name, "ok": False, "contract": verdict})
    rows_before = read_rows()
    device_name = environment.get("device", device)
    arch = (current_arch() if device == "cuda" else None) or arch_of_device(device_name) or ""
    cases = [c for c in plan_cases(device, passed, lengths)
             if (c.backend, c.shape.name, c.length, c.kind) not in measured]
    not_run: list[dict] = []
    for i, case in enumerate(cases):
        estimate = case.estimate_s(rows_before, arch)
        if deadline is not None and time.monotonic() + estimate > deadline:
            not_run = [{"name": c.name, "estimate_s": c.estimate_s(rows_before, arch),
                        "command": "python -m titan_upipe.gpu_suite --stage attention"} for c in cases[i:]]
            break
        try:
            timing = time_case(case, device)
            result = {"ok": True, **timing}
        except torch.OutOfMemoryError:
            result = {"ok": True, "oom": True}
        except Exception as exc:  # a kernel that fails at this shape: reported, the stage goes on
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        results.append({"check": "attention", "backend": case.backend, "shape": case.shape.name, "length": case.length,
                        "tokens": case.tokens, "kind": case.kind, "contract": "ok", **result})
        if device == "cuda":
            torch.cuda.empty_cache()
            # after every case, so a call killed at its limit keeps the table in step with its report
            write_rows(csv_rows(results, environment, arch), device_name, passed=set(passed))
        if on_result:
            on_result(results, not_run)
    if device == "cuda":
        write_rows(csv_rows(results, environment, arch), device_name, passed=set(passed))
    if on_result:
        on_result(results, not_run)
    return results


def csv_rows(results: list[dict], environment: dict, arch: str | None = None) -> list[dict]:
    """``kernel_speed.csv`` rows of a stage's results (timed cases and failed contracts) on a GPU of
    ``arch`` (default: the architecture of the environment's device name)."""
    shapes = {s.name: s for s in SHAPES}
    device = environment.get("device", "")
    rows = []
    for r in results:
        if r.get("skipped") or r.get("oom"):
            continue
        base = {"device": device, "arch": arch or arch_of_device(device) or "", "date": environment.get("date", "")[:10],
                "torch": environment.get("torch", ""), "backend": r["backend"], "dtype": DTYPE,
                "contract": r["contract"]}
        if "fwd_ms" not in r:  # a failed contract: no timing, but auto must see it
            rows.append({**base, "kind": "dense"})
            continue
        shape = shapes[r["shape"]]
        rows.append({**base, "shape": shape.name, "q_heads": shape.q_heads, "kv_heads": shape.kv_heads,
                     "head_dim": shape.head_dim, "length": r["length"], "tokens": r["tokens"], "kind": r["kind"],
                     **{k: f"{r[k]:.4g}" for k in ("fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops")}})
    return rows


def ranking(results: list[dict], device: str) -> list[tuple[str, float]]:
    """(backend, geometric-mean fwd+bwd TFLOP/s over its dense cases), fastest first: one stage's
    results, all on ``device``."""
    rows = csv_rows(results, {"device": device})
    arch = rows[0]["arch"] if rows else ""  # one device: one architecture
    return sorted(scores(rows, arch).items(), key=lambda item: -item[1])


__all__ = ["KERNEL_SPEED_CSV", "SHAPES", "Case", "causal_flops", "document_lengths", "plan_cases", "ranking",
           "run_attention_stage", "time_case"]
