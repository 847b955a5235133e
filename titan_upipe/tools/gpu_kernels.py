"""The GPU suite's ``kernels`` stage: numerical checks of the CUDA paths, one result dict each.

Every check compares against an fp64/fp32 reference with a tolerance tied to the dtype's own
error, measured the same way: the plain (unfused, unconverted) computation in the same dtype
is compared with the reference, and the checked path may be at most ``ERROR_FACTOR`` times
that error (plus a quarter of the dtype's epsilon). On CPU the same code runs (``make test``
does, at the same small shapes) with the CPU kernels; checks that need CUDA or an optional
package are reported as skipped with the reason, never replaced by another kernel.

``run_kernel_checks(device)`` returns ``[{"check", "case", "ok", "skipped"?, "detail"}, ...]``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from titan_upipe.attention import convert_attention
from titan_upipe.attention.backends import AUTO_ORDER, BACKENDS, choose_backend
from titan_upipe.contracts.backend import ERROR_FACTOR, check_contract, contract_cases
from titan_upipe.contracts.varlen import check_varlen, varlen_cases
from titan_upipe.spec.keep_attention import KeepAttentionPlan, kept_attention_bytes
from titan_upipe.torchtitan_0_2.compile_parts import compile_parts
from titan_upipe.torchtitan_0_2.flavors import llama3_model
from titan_upipe.torchtitan_0_2.loss import cross_entropy_loss
from titan_upipe.transforms.fused_ce import (
    ChunkedLinearCrossEntropy,
    _liger_sum,
    liger_available,
    resolve_backend,
)
from titan_upipe.transforms.model_forward import enable_fused_rope
from titan_upipe.transforms.offload import OFFLOAD_STATS, apply_offloaded_ac
from titan_upipe.transforms.surgery import fuse_cross_entropy, tile_feed_forwards, tile_rms_norms

Tensor = torch.Tensor
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Shapes:
    """Sizes of the checks: head_dim 64 (what every flash kernel supports) on the GPU; smaller on
    CPU, where ``make test`` runs the stage on a 2-core machine."""

    ce_tokens: int
    ce_dim: int
    ce_vocab: int
    model_dim: int
    seq_len: int


GPU_SHAPES = Shapes(ce_tokens=4096, ce_dim=1024, ce_vocab=8192, model_dim=512, seq_len=512)
CPU_SHAPES = Shapes(ce_tokens=256, ce_dim=128, ce_vocab=1024, model_dim=256, seq_len=128)


def shapes_for(device: str) -> Shapes:
    return GPU_SHAPES if device == "cuda" else CPU_SHAPES


def _result(check: str, case: str, ok: bool, detail: str, skipped: bool = False) -> dict:
    return {"check": check, "case": case, "ok": ok, "skipped": skipped, "detail": detail}


def _rel(got: Tensor, ref: Tensor) -> float:
    ref = ref.detach().double().cpu()
    return float((got.detach().double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _within(errors: dict[str, float], dtype_errors: dict[str, float], dtype: torch.dtype) -> tuple[bool, str]:
    floor = torch.finfo(dtype).eps / 4
    ratios = {n: errors[n] / (ERROR_FACTOR * dtype_errors[n] + floor) for n in errors}
    worst = max(ratios, key=ratios.get)
    return ratios[worst] <= 1.0, f"worst {worst}: {errors[worst]:.2e} (plain {dtype_errors[worst]:.2e})"


# --- the backend contract ------------------------------------------------------------------------


def contract_checks(device: str) -> list[dict]:
    results = []
    for name in AUTO_ORDER:
        cls = BACKENDS[name]
        # On a CPU run only sdpa takes CPU tensors, whatever this host has installed.
        reason = cls.unavailable_reason() if device == "cuda" or name == "sdpa" else "runs on CUDA tensors only"
        if reason is not None:
            results.append(_result("contract", name, True, reason, skipped=True))
            continue
        try:
            results += _backend_contract(cls, device)
        except Exception as exc:  # one backend's crash is its failed verdict; the others still run
            results.append(_result("contract", name, False, f"{type(exc).__name__}: {exc}"))
    return results


def _backend_contract(cls, device: str) -> list[dict]:
    results = []
    for case in contract_cases((torch.bfloat16, torch.float32)):
        if cls.dtype_problem(case.dtype) is not None:
            continue
        r = check_contract(cls(), case, device)
        worst = max(r.split, key=lambda n: max(r.whole[n], r.split[n]) / r.allowed[n])
        results.append(_result("contract", f"{cls.name} {case.id}", r.ok,
                               f"worst {worst}: whole {r.whole[worst]:.2e}, split {r.split[worst]:.2e}, "
                               f"allowed {r.allowed[worst]:.2e}"))
    return results


# --- the varlen kernels (packed documents) --------------------------------------------------------


def varlen_checks(device: str) -> list[dict]:
    """Every installed flash-attn backend's varlen call over packed documents (bf16, a 1-token
    document in each row) against its per-document dense calls and fp32 masked attention
    (``titan_upipe.contracts.varlen``); a backend that cannot run here is skipped with why."""
    results = []
    for name in AUTO_ORDER:
        cls = BACKENDS[name]
        if not cls.varlen:
            continue
        reason = cls.unavailable_reason() if device == "cuda" else "runs on CUDA tensors only"
        if reason is not None:
            results.append(_result("varlen", name, True, reason, skipped=True))
            continue
        results += varlen_backend_checks(cls(), device)
    return results


def varlen_backend_checks(backend, device: str) -> list[dict]:
    """One backend's varlen cases; a case that raises (a kernel without a varlen backward on this
    GPU, a release whose signature does not match) is a failed case, the others still run."""
    results = []
    for case in varlen_cases(torch.bfloat16):
        try:
            r = check_varlen(backend, case, device)
        except Exception as exc:
            results.append(_result("varlen", f"{backend.name} {case.id}", False, f"{type(exc).__name__}: {exc}"))
            continue
        worst = r.worst()
        results.append(_result("varlen", f"{backend.name} {case.id}", r.ok,
                               f"worst {worst}: varlen {r.varlen[worst]:.2e}, per-document {r.loop[worst]:.2e}, "
                               f"allowed {r.allowed[worst]:.2e}; documents {r.lengths}"))
    return results


# --- fused linear + cross-entropy --------------------------------------------------------------


def _ce_grads(loss_fn: Callable, hidden: Tensor, weight: Tensor, labels: Tensor, dtype: torch.dtype) -> dict:
    h = hidden.detach().to(dtype).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    loss = loss_fn(h, w, labels)
    dh, dw = torch.autograd.grad(loss, (h, w))
    return {"loss": loss.detach(), "dh": dh, "dw": dw}


def _stock_ce(h: Tensor, w: Tensor, labels: Tensor) -> Tensor:
    """TorchTitan's path: logits in the model dtype, then fp32 cross-entropy, summed."""
    return F.cross_entropy(F.linear(h, w).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def fused_ce_checks(device: str) -> list[dict]:
    shapes = shapes_for(device)
    tokens, dim, vocab = shapes.ce_tokens, shapes.ce_dim, shapes.ce_vocab
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=gen).to(device)
    weight = (torch.randn(vocab, dim, generator=gen) / dim**0.5).to(device)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[::7] = IGNORE_INDEX
    labels = labels.to(device)
    ref = _ce_grads(_stock_ce, hidden, weight, labels, torch.float64)
    plain = {n: _rel(t, ref[n]) for n, t in _ce_grads(_stock_ce, hidden, weight, labels, torch.bfloat16).items()}
    paths = {"torch (chunked)": lambda h, w, y: ChunkedLinearCrossEntropy.apply(h, w, y, tokens // 8)}
    results = []
    if device == "cuda" and liger_available():
        paths["liger"] = _liger_sum
    else:
        results.append(_result("fused_ce", "liger", True, "needs CUDA tensors and liger-kernel", skipped=True))
    for name, fn in paths.items():
        errors = {n: _rel(t, ref[n]) for n, t in _ce_grads(fn, hidden, weight, labels, torch.bfloat16).items()}
        ok, detail = _within(errors, plain, torch.bfloat16)
        results.append(_result("fused_ce", f"{name} bf16", ok, detail))
    return results


# --- offloaded checkpointing ---------------------------------------------------------------------


def _debug_llama3(device: str, n_layers: int = 2, n_heads: int = 8, n_kv_heads: int = 2,
                  vocab: int = 512) -> torch.nn.Module:
    shapes = shapes_for(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = llama3_model(dim=shapes.model_dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                             vocab_size=vocab, multiple_of=64, rope_theta=500000, max_seq_len=shapes.seq_len)
    with torch.no_grad():
        model.init_weights()
    return model


def offload_checks(device: str) -> list[dict]:
    """Block inputs to (pinned) host memory and back on the CUDA side streams: same gradients, bit
    for bit, as the plain model (same ops, same order), and every offloaded byte released."""
    plain = _debug_llama3(device, n_layers=3)
    offloaded = copy.deepcopy(plain)
    apply_offloaded_ac(offloaded, pin_memory=device == "cuda")
    tokens = torch.randint(0, 512, (2, shapes_for(device).seq_len),
                           generator=torch.Generator().manual_seed(1)).to(device)
    plain(tokens).float().square().mean().backward()
    before = OFFLOAD_STATS.host_bytes
    out = offloaded(tokens)
    held = OFFLOAD_STATS.host_bytes - before
    out.float().square().mean().backward()
    released = OFFLOAD_STATS.host_bytes == before
    mismatched = [n for (n, p), q in zip(plain.named_parameters(), offloaded.parameters(), strict=True)
                  if not torch.equal(p.grad, q.grad)]
    expected = 3 * tokens.numel() * plain.model_args.dim * 4
    ok = not mismatched and released and held == expected
    detail = (f"{held} B offloaded (expected {expected}), released: {released}, "
              f"gradients bit-exact: {not mismatched}" + (f" (differ: {mismatched[:3]})" if mismatched else ""))
    return [_result("offload_streams", "llama3 3 blocks, pinned" if device == "cuda" else "llama3 3 blocks", ok,
                    detail)]


def _kept_attention_step(device: str, mesh, backend: str, dtype: torch.dtype,
                         keep: KeepAttentionPlan) -> tuple[dict[str, Tensor], int, bool]:
    """(gradients, bytes kept on the host, every kept byte released) of one step of a 3-block UPipe
    model (1-rank ``mesh``) under offloaded AC with ``keep``; every call builds the same weights."""
    model = _debug_llama3(device, n_layers=3)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    for block in model.layers.values():
        block.attention = convert_attention(block.attention, "upipe", mesh, backend=backend, compute_dtype=dtype)
    apply_offloaded_ac(model, pin_memory=device == "cuda", keep=keep)
    tokens = torch.randint(0, 512, (2, shapes_for(device).seq_len),
                           generator=torch.Generator().manual_seed(1)).to(device)
    before = OFFLOAD_STATS.kept_attention_bytes
    out = model(tokens)
    held = OFFLOAD_STATS.kept_attention_bytes - before
    out.float().square().mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}, held, OFFLOAD_STATS.kept_attention_bytes == before


def kept_attention_checks(device: str) -> list[dict]:
    """Kept attention (``keep_attention``) on the CUDA side streams: UPipe on a 1-rank mesh, 3 blocks
    (the top one keeping on the device, the next in pinned host memory, the lowest recomputing)
    against the same model recomputing every block, with ``sdpa`` in fp32 and with the kernel
    ``auto`` picks in bf16: every kept byte released, and the gradients bit for bit those of full
    recomputation -- or, where the kernel's backward is not deterministic (flash kernels sum dQ with
    atomics), no further from them than a second full-recomputation run is."""
    cases = [("sdpa", torch.float32)]
    if device == "cuda":
        cases.append((choose_backend("auto", torch.bfloat16, head_dim=shapes_for(device).model_dim // 8).name,
                      torch.bfloat16))
    results = []
    started_group = not dist.is_initialized()
    try:
        mesh = _one_rank_cp_mesh(device)
        for backend, dtype in cases:
            plan = KeepAttentionPlan(device_blocks=1, host_blocks=1)
            reference, _, _ = _kept_attention_step(device, mesh, backend, dtype, KeepAttentionPlan())
            again, _, _ = _kept_attention_step(device, mesh, backend, dtype, KeepAttentionPlan())
            kept, held, released = _kept_attention_step(device, mesh, backend, dtype, plan)
            noise = max(_rel(again[n], reference[n]) for n in reference)
            worst = max(_rel(kept[n], reference[n]) for n in reference)
            shapes = shapes_for(device)  # _debug_llama3's 8 heads; the one block kept on the host
            expected = kept_attention_bytes(2 * shapes.seq_len, 8, shapes.model_dim // 8, dtype.itemsize)
            ok = released and held == expected and worst <= noise
            detail = (f"{held} B kept on the host (expected {expected}), released: {released}, largest gradient "
                      f"difference {worst:.2e} (full recomputation run twice: {noise:.2e})")
            host = "pinned host" if device == "cuda" else "host"
            results.append(_result("kept_attention", f"upipe 3 blocks ({backend}, {str(dtype).removeprefix('torch.')}): "
                                   f"device, {host}, recompute", ok, detail))
    finally:
        if started_group and dist.is_initialized():
            dist.destroy_process_group()
    return results


# --- one bf16 step with every converter --------------------------------------------------------


PLAIN_BF16_SANITY = 0.05
"""Largest error of the unconverted bf16 model against fp32 that still reads as bf16 rounding
(a few bf16 ulps of the largest element); above it the yardstick itself is broken."""


def _one_rank_cp_mesh(device: str):
    """A real 1-rank CP mesh (UPipe's all-to-alls over one rank), in a process group of its own."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    return init_device_mesh(device, (1,), mesh_dim_names=("cp",))


def _convert_everything(model: torch.nn.Module, mesh, device: str) -> dict[str, str]:
    backend = choose_backend("auto", torch.bfloat16) if device == "cuda" else choose_backend("sdpa")
    enable_fused_rope(model)
    for block in model.layers.values():
        block.attention = convert_attention(block.attention, "upipe", mesh, heads_per_stage=None,
                                            backend=backend.name, in_place_rope=True,
                                            compute_dtype=torch.bfloat16)
    tile_feed_forwards(model, 64)
    tile_rms_norms(model, 64)
    ce_backend = resolve_backend("auto") if device == "cuda" else "torch"
    fuse_cross_entropy(model, chunk_tokens=0, backend=ce_backend)
    apply_offloaded_ac(model, pin_memory=device == "cuda")
    return {"attention": backend.describe(), "ce": ce_backend}


def parity_checks(device: str) -> list[dict]:
    """UPipe (1-rank mesh, U = 1: one head per stage through the GQA schedule), tiled MLP and
    RMSNorm, fused RoPE and CE, offloaded AC, in bf16, against TorchTitan's unconverted model."""

    reference = _debug_llama3(device)
    plain = copy.deepcopy(reference)
    for param in plain.parameters():  # parameters only, as FSDP's bf16 policy: the RoPE table stays
        param.data = param.data.to(torch.bfloat16)
    converted = copy.deepcopy(plain)
    started_group = not dist.is_initialized()
    try:
        kernels = _convert_everything(converted, _one_rank_cp_mesh(device), device)
        gen = torch.Generator().manual_seed(2)
        seq_len = shapes_for(device).seq_len
        tokens = torch.randint(0, 512, (2, seq_len), generator=gen).to(device)
        labels = torch.randint(0, 512, (2, seq_len), generator=gen).to(device)

        def step(model, fused: bool) -> dict[str, Tensor]:
            loss = model(tokens).loss_sum(labels) if fused else cross_entropy_loss(model(tokens), labels)
            loss.backward()
            # The offload wrapper's module name is not part of the parameter names TorchTitan saves.
            return {"loss": loss.detach(), **{n.replace("_checkpoint_wrapped_module.", ""): p.grad
                                              for n, p in model.named_parameters()}}

        ref = step(reference, False)
        plain_errors = {n: _rel(t, ref[n]) for n, t in step(plain, False).items()}
        errors = {n: _rel(t, ref[n]) for n, t in step(converted, True).items()}
    finally:
        if started_group and dist.is_initialized():
            dist.destroy_process_group()
    ok, detail = _within(errors, plain_errors, torch.bfloat16)
    if max(plain_errors.values()) > PLAIN_BF16_SANITY:  # the yardstick itself must be bf16 rounding
        ok, detail = False, f"the unconverted bf16 model is off by {max(plain_errors.values()):.2e}: {detail}"
    return [_result("bf16_parity", f"llama3 debug, {kernels['attention']}, ce {kernels['ce']}", ok, detail)]


# --- compile.enable on a model with context-parallel attention ----------------------------------


def compile_checks(device: str) -> list[dict]:
    """``compile.enable``'s path for converted models (``compile_parts``: norms and feed-forwards
    compiled, UPipe attention eager on a 1-rank mesh), one bf16 step against the fp32 unconverted
    model, within the error of the same converted model run eagerly in bf16. Inductor on CUDA; on
    CPU ``aot_eager`` (inductor's first C++ build would dominate ``make test``)."""
    compiler = "inductor" if device == "cuda" else "aot_eager"
    reference = _debug_llama3(device)
    eager = copy.deepcopy(reference)
    for param in eager.parameters():  # parameters only, as FSDP's bf16 policy
        param.data = param.data.to(torch.bfloat16)
    compiled = copy.deepcopy(eager)
    started_group = not dist.is_initialized()
    try:
        mesh = _one_rank_cp_mesh(device)
        attention = choose_backend("auto", torch.bfloat16) if device == "cuda" else choose_backend("sdpa")
        for model in (eager, compiled):
            for block in model.layers.values():
                block.attention = convert_attention(block.attention, "upipe", mesh, backend=attention.name,
                                                    compute_dtype=torch.bfloat16)
        parts = compile_parts(compiled, compiler)
        gen = torch.Generator().manual_seed(2)
        tokens, labels = (torch.randint(0, 512, (2, shapes_for(device).seq_len), generator=gen).to(device)
                          for _ in range(2))

        def step(model) -> dict[str, Tensor]:
            loss = cross_entropy_loss(model(tokens), labels)
            loss.backward()
            return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}

        ref = step(reference)
        eager_errors = {n: _rel(t, ref[n]) for n, t in step(eager).items()}
        errors = {n: _rel(t, ref[n]) for n, t in step(compiled).items()}
    finally:
        if started_group and dist.is_initialized():
            dist.destroy_process_group()
    ok, detail = _within(errors, eager_errors, torch.bfloat16)
    expected_parts = 3 * len(reference.layers) + 1
    if len(parts) != expected_parts:
        ok, detail = False, f"{len(parts)} parts compiled, expected {expected_parts}: {detail}"
    return [_result("compile", f"llama3 debug, {compiler}, {len(parts)} parts, attention {attention.name} eager",
                    ok, detail)]


CHECKS = {"contract": contract_checks, "varlen": varlen_checks, "fused_ce": fused_ce_checks,
          "offload_streams": offload_checks, "kept_attention": kept_attention_checks, "bf16_parity": parity_checks,
          "compile": compile_checks}


def run_kernel_checks(device: str = "cuda", on_result: Callable[[list[dict]], None] | None = None,
                      only: tuple[str, ...] | None = None) -> list[dict]:
    """Every check in ``CHECKS`` order (``only``: these); ``on_result(results)`` after each, so a
    killed call keeps the report of the checks that finished."""
    results = []
    for name, check in CHECKS.items():
        if only is not None and name not in only:
            continue
        try:
            results += check(device)
        except Exception as exc:  # a crashing check is a failed check, reported with the others
            results.append(_result(name, "", False, f"{type(exc).__name__}: {exc}"))
        print(f"[kernels] {name}: {'ok' if all(r['ok'] for r in results if r['check'] == name) else 'FAILED'}",
              flush=True)
        if on_result:
            on_result(results)
    return results
