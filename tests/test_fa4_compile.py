"""FlashAttention-4's binding compiled for Hopper (sm_90a) on a machine without a GPU.

Under torch's ``FakeTensorMode`` FA4 (``flash_attn.cute.interface``, flash-attn-4 4.0.0b36) does
every host-side step of a call: its shape, dtype and head_dim asserts, the kernel choice for
``FLASH_ATTENTION_ARCH`` and ``cute.compile`` of each kernel the call needs (CuTe DSL -> MLIR ->
PTX -> ptxas, a cubin for ``CUTE_DSL_ARCH``); it skips only the launch (``if not fake_mode``) and
returns fake tensors of the real shapes. Every call here goes through ``FlashAttn4Backend``'s own
``forward``/``backward``/``varlen_forward``/``varlen_backward`` on fake CUDA tensors, so what is
checked is our binding: the parameter names it binds, the layouts it hands over (``[B, S, H, D]``,
packed ``[T, H, D]`` with int32 ``cu_seqlens`` and a Python-int ``max_seqlen``), the LSE it feeds
back to the backward (``[B, Hq, S]``, ``[Hq, T]``) and how it unpacks and transposes the results,
against the shapes and dtypes the contract (``titan_upipe.attention.backends``) promises: out
``[B, Hq, S, D]`` in q's dtype, lse fp32 ``[B, Hq, S]`` (varlen ``[T, Hq, D]``, ``[Hq, T]``), dq/dk/dv
shaped like q/k/v. Each forward and backward must compile at least one kernel into an sm_90a cubin,
and the same calls at other lengths must reuse them (a length in the compile key would recompile
every step: flash-attention#2571, a tensor ``max_seqlen``).

The compile runs in a child process (this file run as a script): FA4 reads ``FLASH_ATTENTION_ARCH``
at its first call and the CuTe DSL ``CUTE_DSL_ARCH`` at import, so set in the pytest process they
would steer the real kernels of the GPU tests of the same run. The module skips where flash-attn-4
is not installed or ``flash_attn.cute.interface`` does not import (``make test`` without the
``[gpu]`` extra); ``make fa4-compile`` installs the extra and sets ``TITAN_UPIPE_REQUIRE_FA4=1``,
which turns those skips into failures. About 30 s for this test on 2 CPU cores, 25 s of it compiling 31
kernels; ``make fa4-compile`` (pytest start-up included) about 40 s.

Fake CUDA tensors on a CPU build of torch cannot be copied through Tensor methods (``.contiguous()``
enters a CUDA device guard: "PyTorch is not linked with support for cuda devices"), so the inputs
are contiguous ``[B, H, S, D]`` tensors, whose ``[B, S, H, D]`` views (last dim dense) the backend
hands FA4 without a copy, as on a GPU.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from titan_upipe.attention.flash_backends import FlashAttn4Backend

SM90A_FAKE_COMPILE_ENV = {
    "FLASH_ATTENTION_ARCH": "sm_90",  # FA4's kernel family (without it: the GPU's, i.e. a CUDA query)
    "CUTE_DSL_ARCH": "sm_90a",  # the CuTe DSL's compile target (without it: sm_100 where no GPU answers)
    "FLASH_ATTENTION_NUM_SMS": "132",  # the H100 SXM the forward's tile heuristics size for
    # Compile every kernel now: neither FA4's nor the DSL's on-disk cache may answer instead.
    "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "0",
    "CUTE_DSL_DISABLE_FILE_CACHING": "1",
    "CUTE_DSL_KEEP": "ptx,cubin",  # each kernel's PTX and cubin, via CUTE_DSL_DUMP_DIR into its artifacts
}
REQUIRED = os.environ.get("TITAN_UPIPE_REQUIRE_FA4") == "1"
BATCH = 2
DENSE_LENGTHS = (512, 1024)
"""Sequence lengths of the dense calls: the first compiles, the second must reuse its kernels (both
span several 64- and 128-row tiles; FA4 specializes a single-tile sequence)."""
VARLEN_DOCUMENTS = ((100, 500, 400), (300, 400, 400, 436))
"""Document lengths packed into the varlen calls, first compiling, then reusing (other ``T``,
document count and ``max_seqlen``)."""
SM90A_BUILD = {"ptx_target": "sm_90a", "cubin_machine": 190}
"""A kernel built for Hopper: its PTX's ``.target`` and its cubin an ELF for ``EM_CUDA`` (190)."""


@dataclass(frozen=True)
class Case:
    """A forward and the backward of its out/lse, at the first of the lengths and then the rest."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    causal: bool = True
    varlen: bool = False

    def lengths(self) -> tuple[Any, ...]:
        return VARLEN_DOCUMENTS if self.varlen else DENSE_LENGTHS


CASES = (
    Case("gqa-causal", 32, 8, 128, torch.bfloat16),
    Case("gqa-full", 32, 8, 128, torch.bfloat16, causal=False),
    Case("mha-causal-fp16", 8, 8, 128, torch.float16),
    Case("mha-full-fp16", 8, 8, 128, torch.float16, causal=False),
    Case("gqa-varlen", 32, 8, 128, torch.bfloat16, varlen=True),
    # The smallest and largest head_dim FlashAttn4Backend.head_dim_problem accepts.
    Case("gqa-causal-d8", 32, 8, 8, torch.bfloat16),
    Case("gqa-causal-d256", 32, 8, 256, torch.bfloat16),
)


# --- the child process: every call of every case under FakeTensorMode ------------------------------


def _described(**tensors: torch.Tensor) -> dict[str, list]:
    return {name: [list(t.shape), str(t.dtype)] for name, t in tensors.items()}


def _kernels(interface) -> dict[tuple[str, Any], Any]:
    """Every kernel FA4 compiled so far: ``(function, compile key) -> compiled function``. Each
    compiling function of the interface keeps its kernels in its ``compile_cache`` (a dict in
    ``.cache``, in memory: the persistent cache is off)."""
    return {(name, key): kernel for name, fn in vars(interface).items() if hasattr(fn, "compile_cache")
            for key, kernel in fn.compile_cache.cache.items()}


def _build(kernel) -> dict[str, Any]:
    """What a compiled kernel was built into: its PTX's ``.target`` and its cubin's ELF machine
    (the DSL reads both back from the dump folder into ``artifacts``; a path where it wrote none)."""
    ptx, cubin = kernel.artifacts.PTX, kernel.artifacts.CUBIN
    target = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE) if isinstance(ptx, str) else None
    elf = isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"
    return {"ptx_target": target and target.group(1),
            "cubin_machine": int.from_bytes(cubin[18:20], "little") if elf else None}


def _timed_call(interface, call, *args) -> tuple[dict[str, Any], Any]:
    """``call(*args)``; the builds of the kernels it compiled, its seconds and what it returned."""
    before = _kernels(interface)
    start = time.perf_counter()
    returned = call(*args)
    seconds = time.perf_counter() - start
    new = [kernel for key, kernel in _kernels(interface).items() if key not in before]
    return {"seconds": round(seconds, 2), "kernels": [_build(kernel) for kernel in new]}, returned


def _inputs(case: Case, length: Any) -> dict[str, Any]:
    """Fake CUDA q, k, v as the backend takes them: ``[B, H, S, D]``, or packed ``[T, H, D]`` with
    ``cu_seqlens`` (int32 ``[N + 1]``) and ``max_seqlen`` (a Python int) for varlen."""
    def tensor(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=case.dtype, device="cuda")

    if not case.varlen:
        return {"q": tensor(BATCH, case.q_heads, length, case.head_dim),
                "k": tensor(BATCH, case.kv_heads, length, case.head_dim),
                "v": tensor(BATCH, case.kv_heads, length, case.head_dim)}
    tokens = sum(length)
    return {"q": tensor(tokens, case.q_heads, case.head_dim), "k": tensor(tokens, case.kv_heads, case.head_dim),
            "v": tensor(tokens, case.kv_heads, case.head_dim),
            "cu_seqlens": torch.tensor([0, *itertools.accumulate(length)], dtype=torch.int32, device="cuda"),
            "max_seqlen": max(length)}


def _forward(backend: FlashAttn4Backend, case: Case, x: dict[str, Any]):
    scale = case.head_dim ** -0.5
    if case.varlen:
        return backend.varlen_forward(x["q"], x["k"], x["v"], scale, x["cu_seqlens"], x["max_seqlen"])
    return backend.forward(x["q"], x["k"], x["v"], scale, case.causal)


def _backward(backend: FlashAttn4Backend, case: Case, x: dict[str, Any], out: torch.Tensor, lse: torch.Tensor):
    scale, dout = case.head_dim ** -0.5, torch.empty_like(out)
    if case.varlen:
        return backend.varlen_backward(dout, x["q"], x["k"], x["v"], out, lse, scale, x["cu_seqlens"],
                                       x["max_seqlen"])
    return backend.backward(dout, x["q"], x["k"], x["v"], out, lse, scale, case.causal)


def _compile_case(case: Case, interface) -> dict[str, Any]:
    backend, runs = FlashAttn4Backend(), []
    for length in case.lengths():
        x = _inputs(case, length)
        forward, (out, lse) = _timed_call(interface, _forward, backend, case, x)
        forward["outputs"] = _described(out=out, lse=lse)
        backward, (dq, dk, dv) = _timed_call(interface, _backward, backend, case, x, out, lse)
        backward["outputs"] = _described(dq=dq, dk=dk, dv=dv)
        runs.append({"forward": forward, "backward": backward})
    return {"runs": runs}


def _compile_all(results_path: Path) -> None:
    try:
        import flash_attn.cute.interface as interface
    except Exception as exc:  # a missing libs-core (cutlass.cute), a DSL that does not load, ...
        results_path.write_text(json.dumps({"unimportable": f"{type(exc).__name__}: {exc}"}))
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    results: dict[str, Any] = {}
    start = time.perf_counter()
    with FakeTensorMode():
        for case in CASES:
            try:
                results[case.name] = _compile_case(case, interface)
            except Exception:  # reported per case: one broken call does not hide the others
                results[case.name] = {"error": traceback.format_exc()}
    results["seconds"] = round(time.perf_counter() - start, 1)
    results_path.write_text(json.dumps(results))


# --- the tests ------------------------------------------------------------------------------------


def _skip_or_fail(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"{reason} (TITAN_UPIPE_REQUIRE_FA4=1)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, Any]:
    """The child process's results: per case, per length, the forward's and backward's outputs
    (shape, dtype) and the builds of the kernels each compiled."""
    if not FlashAttn4Backend.installed():
        _skip_or_fail("flash-attn-4 is not installed (make fa4-compile installs the [gpu] extra)")
    folder = tmp_path_factory.mktemp("fa4_compile")
    dumps = folder / "dumps"
    dumps.mkdir()  # the DSL writes no PTX or cubin into a missing folder
    results_path = folder / "results.json"
    env = {**os.environ, **SM90A_FAKE_COMPILE_ENV, "CUTE_DSL_DUMP_DIR": str(dumps)}
    done = subprocess.run([sys.executable, __file__, str(results_path)], env=env, capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0 or not results_path.exists():
        pytest.fail(f"the compile process failed (exit {done.returncode}):\n{done.stderr[-6000:]}")
    results = json.loads(results_path.read_text())
    if "unimportable" in results:
        _skip_or_fail(f"flash_attn.cute.interface does not import: {results['unimportable']}")
    return results


def _expected_outputs(case: Case, length: Any) -> dict[str, dict[str, list]]:
    """The contract's shapes: dense out ``[B, Hq, S, D]`` and lse ``[B, Hq, S]``; varlen
    ``[T, Hq, D]`` and ``[Hq, T]``; gradients shaped like their inputs, in q's dtype."""
    dtype, lse_dtype = str(case.dtype), str(torch.float32)
    if case.varlen:
        tokens = sum(length)
        q, kv = [tokens, case.q_heads, case.head_dim], [tokens, case.kv_heads, case.head_dim]
        lse = [case.q_heads, tokens]
    else:
        q, kv = [BATCH, case.q_heads, length, case.head_dim], [BATCH, case.kv_heads, length, case.head_dim]
        lse = [BATCH, case.q_heads, length]
    return {"forward": {"out": [q, dtype], "lse": [lse, lse_dtype]},
            "backward": {"dq": [q, dtype], "dk": [kv, dtype], "dv": [kv, dtype]}}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_backward_compile_for_sm90a_with_the_contracts_shapes(compiled, case):
    result = compiled[case.name]
    assert "error" not in result, f"{case}:\n{result['error']}"
    first = result["runs"][0]
    expected = _expected_outputs(case, case.lengths()[0])
    for call in ("forward", "backward"):
        assert first[call]["outputs"] == expected[call], call
        # Of its own: none an earlier case compiled (a backward that dropped ``causal`` would run
        # the causal kernel in the full cases, compiled by the causal ones).
        assert first[call]["kernels"], f"the {call} compiled no kernel of its own"
        assert all(build == SM90A_BUILD for build in first[call]["kernels"]), first[call]["kernels"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_other_lengths_reuse_the_compiled_kernels(compiled, case):
    result = compiled[case.name]
    assert "error" not in result, f"{case}:\n{result['error']}"
    for length, run in zip(case.lengths()[1:], result["runs"][1:], strict=True):
        expected = _expected_outputs(case, length)
        for call in ("forward", "backward"):
            assert run[call]["outputs"] == expected[call], (call, length)
            assert run[call]["kernels"] == [], f"the {call} at {length} compiled again"


if __name__ == "__main__":
    _compile_all(Path(sys.argv[1]))
