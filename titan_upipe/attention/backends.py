"""Local (single-rank) attention kernels, causal or full, behind one contract returning (out, lse).

The contract every backend honours (``tests/test_backend_contract.py`` checks it, on CPU in
``make test`` and on CUDA for every installed backend):

* ``forward(q, k, v, scale, causal) -> (out, lse)``: ``out = softmax(scale q k^T + mask) v``
  in q's dtype and ``lse_i = log sum_j exp(scale q_i . k_j)`` in fp32 ``[B, Hq, S]``.
* ``backward(dout, q, k, v, out, lse, scale, causal) -> (dq, dk, dv)``: this block's share of
  the gradient *given the merged* ``out``/``lse`` of a larger attention the block is part of
  (flash-attention's definition). With ``P = exp(scale q k^T - lse)`` and
  ``delta_i = sum_d dout_id out_id``::

      dS = P * (dout v^T - delta),  dq = scale dS k,  dk = scale dS^T q,  dv = P^T dout

  Summed over the key blocks of a query row this is the gradient of the whole attention;
  ring attention (``ring.py``) relies on it. A backward that recomputes its own block's
  softmax instead is right only for a block that is the whole attention (1-D Ulysses/UPipe)
  and wrong for ring/USP: such a backend sets ``merged_backward = False`` and is refused
  for ring modes at conversion.

Every call is either causal (``causal=True``: a diagonal block, ``q`` and ``k`` of the same
length, query ``i`` sees keys ``[0, i]``) or full (``causal=False``: every query sees every
key, the off-diagonal blocks of ring attention).

Tensors use the torch SDPA convention: ``q`` is ``[B, Hq, S, D]`` and ``k``/``v`` are
``[B, Hkv, S, D]`` with ``Hq`` a multiple of ``Hkv`` (GQA: query head ``i`` uses KV head
``i // (Hq/Hkv)``). Inputs may be strided views. The returned ``dk``/``dv`` are already summed
over the query heads sharing a KV head.

Backends:

=========== ============================================== =================== ==========
name        kernel                                         where               dtypes
=========== ============================================== =================== ==========
sdpa        aten flash-for-CPU (CPU); aten flash (native   CPU and CUDA        any float
            GQA) for fp16/bf16, memory-efficient (K/V
            expanded: no GQA in that kernel) for fp32
            (CUDA); backward from the given out/lse
math        explicit fp32 softmax, chunked over queries    anywhere (tests)    any float
flash_attn  flash-attn 2 (``flash_attn``)                  CUDA sm80+          fp16, bf16
flash_attn3 flash-attn 3 (``flash_attn_interface``)        Hopper (sm90)       fp16, bf16
flash_attn4 FlashAttention-4 (``flash-attn-4``:            Hopper, Blackwell   fp16, bf16
            ``flash_attn.cute``)
auto        at conversion, the first of flash_attn4 >      --                  --
            flash_attn3 > flash_attn > sdpa usable here
            for the compute dtype (``choose_backend``)
=========== ============================================== =================== ==========

The flash-attn packages are imported lazily; a missing one raises a ConfigError at
conversion time, it is never replaced by another kernel silently (``auto`` is a choice the
user made, logged with the reasons the faster backends were passed over).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from titan_upipe.errors import ConfigError

Tensor = torch.Tensor

HALF_DTYPES = (torch.float16, torch.bfloat16)


class LocalAttentionBackend(ABC):
    """Causal (or full, for ring blocks) attention on head-sharded tensors."""

    name: ClassVar[str]
    dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None
    """Input dtypes the kernel runs; None: every floating dtype."""
    merged_backward: ClassVar[bool] = True
    """True when ``backward`` honours a merged ``out``/``lse`` (the module docstring's contract);
    ring/USP conversion refuses a backend without it."""

    @classmethod
    def unavailable_reason(cls, probe: bool = True) -> str | None:
        """None when usable here, else why not. ``probe=False`` imports nothing and asks CUDA
        nothing (the check before process groups start, which may run on a machine without a
        GPU); conversion probes fully."""
        return None

    @classmethod
    def dtype_problem(cls, dtype: torch.dtype | None) -> str | None:
        """None when the kernel runs ``dtype`` (or it is not known yet), else why not."""
        if dtype is None or cls.dtypes is None or dtype in cls.dtypes:
            return None
        valid = ", ".join(str(d).removeprefix("torch.") for d in cls.dtypes)
        return (f"{cls.name} runs {valid} inputs, not {str(dtype).removeprefix('torch.')}: "
                "train in bf16 (training.mixed_precision_param = 'bfloat16') or use attention_backend 'sdpa'")

    def check_inputs(self, q: Tensor) -> None:
        problem = self.dtype_problem(q.dtype)
        if problem is not None:
            raise ConfigError(problem)

    @abstractmethod
    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True) -> tuple[Tensor, Tensor]:
        """Return ``out`` ``[B, Hq, S, D]`` (dtype of q) and ``lse`` fp32 ``[B, Hq, S]``."""

    @abstractmethod
    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
        causal: bool = True,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Return ``dq, dk, dv`` shaped like ``q, k, v``: this block's share of the gradient
        given the merged ``out``/``lse`` (module docstring)."""


def expand_kv(t: Tensor, n_rep: int) -> Tensor:
    """``[B, Hkv, S, D] -> [B, Hkv * n_rep, S, D]``, KV head ``h`` serving query heads ``h*n_rep ...``."""
    return t if n_rep == 1 else t.repeat_interleave(n_rep, dim=1)


def fold_kv_grad(grad: Tensor, n_rep: int) -> Tensor:
    """The inverse of ``expand_kv`` for gradients: sum each KV head's ``n_rep`` copies (fp32)."""
    if n_rep == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // n_rep, n_rep, s, d).sum(dim=2, dtype=torch.float32).to(grad.dtype)


class MathBackend(LocalAttentionBackend):
    """Explicit fp32 attention, query rows in chunks so the score matrix stays bounded.

    The reference path: slow, but every step is visible and it runs on any device.
    """

    name = "math"

    def __init__(self, chunk_rows: int = 1024) -> None:
        self.chunk_rows = chunk_rows

    @staticmethod
    def _grouped(q: Tensor, k: Tensor) -> tuple[Tensor, int]:
        b, hq, s, d = q.shape
        hkv = k.shape[1]
        return q.float().reshape(b, hkv, hq // hkv, s, d), hq // hkv

    @staticmethod
    def _key_stop(stop: int, n_keys: int, causal: bool) -> int:
        # Causal: query row i attends keys [0, i], so rows [start, stop) need keys [0, stop).
        return stop if causal else n_keys

    def _probabilities(self, qg: Tensor, kf: Tensor, start: int, stop: int, scale: float, lse: Tensor | None,
                       causal: bool):
        key_stop = self._key_stop(stop, kf.shape[-2], causal)
        scores = torch.matmul(qg[..., start:stop, :], kf[..., :key_stop, :].transpose(-1, -2)) * scale
        if causal:
            rows = torch.arange(start, stop, device=qg.device).unsqueeze(1)
            cols = torch.arange(stop, device=qg.device).unsqueeze(0)
            scores.masked_fill_(cols > rows, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
        return torch.exp(scores - lse.unsqueeze(-1)), lse

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True) -> tuple[Tensor, Tensor]:
        qg, n_rep = self._grouped(q, k)
        b, hkv, _, s, d = qg.shape
        kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)
        out = torch.empty(b, hkv, n_rep, s, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, hkv, n_rep, s, dtype=torch.float32, device=q.device)
        for start in range(0, s, self.chunk_rows):
            stop = min(start + self.chunk_rows, s)
            probs, chunk_lse = self._probabilities(qg, kf, start, stop, scale, None, causal)
            lse[..., start:stop] = chunk_lse
            key_stop = self._key_stop(stop, kf.shape[-2], causal)
            out[..., start:stop, :] = torch.matmul(probs, vf[..., :key_stop, :])
        return out.view(b, hkv * n_rep, s, d).to(q.dtype), lse.view(b, hkv * n_rep, s)

    def backward(self, dout, q, k, v, out, lse, scale, causal=True):
        qg, n_rep = self._grouped(q, k)
        b, hkv, _, s, d = qg.shape
        n_keys = k.shape[2]
        kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)
        do = dout.float().reshape(b, hkv, n_rep, s, d)
        lse_g = lse.reshape(b, hkv, n_rep, s)
        # D_i = sum_j P_ij dP_ij = rowsum(dO * O): the softmax-backward correction term.
        delta = (do * out.float().reshape(b, hkv, n_rep, s, d)).sum(dim=-1)
        dq = torch.empty_like(qg)
        dk = torch.zeros(b, hkv, n_keys, d, dtype=torch.float32, device=q.device)
        dv = torch.zeros_like(dk)
        for start in range(0, s, self.chunk_rows):
            stop = min(start + self.chunk_rows, s)
            ks = self._key_stop(stop, n_keys, causal)
            probs, _ = self._probabilities(qg, kf, start, stop, scale, lse_g[..., start:stop], causal)
            dprobs = torch.matmul(do[..., start:stop, :], vf[..., :ks, :].transpose(-1, -2))
            dscores = probs * (dprobs - delta[..., start:stop].unsqueeze(-1))
            dq[..., start:stop, :] = torch.matmul(dscores, kf[..., :ks, :]) * scale
            dk[..., :ks, :] += torch.matmul(dscores.transpose(-1, -2), qg[..., start:stop, :]).sum(dim=2) * scale
            dv[..., :ks, :] += torch.matmul(probs.transpose(-1, -2), do[..., start:stop, :]).sum(dim=2)
        return dq.view(b, hkv * n_rep, s, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class SdpaCpuKernels(LocalAttentionBackend):
    """The CPU flash kernel TorchTitan's SDPA runs on CPU; native GQA, backward from out/lse."""

    name = "sdpa"

    def forward(self, q, k, v, scale, causal=True):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, scale, causal=True):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)


LSE_ALIGN = 32
"""The memory-efficient kernel keeps its LSE rows padded to a multiple of 32."""


class SdpaCudaKernels(LocalAttentionBackend):
    """torch's fused CUDA kernels through their aten ops, the backward fed the given out/lse.

    fp16/bf16 run the flash kernel, which takes GQA natively (``Hkv < Hq``, dK/dV summed by the
    kernel). fp32 runs the memory-efficient kernel, which has no GQA: K/V are expanded to the
    query heads for the call and dK/dV folded back (fp32 sum). Neither recomputes a forward.

    The aten ops' extra outputs (cumulative lengths, RNG state) changed layout between torch
    releases; the backward gets exactly what this torch's own forward returns for a dense,
    dropout-free call, taken once per device and dtype from a tiny forward.
    ``ops`` is ``torch.ops.aten``; tests pass a CPU emulation of the four ops' documented
    semantics to run this class's Python without a GPU.
    """

    name = "sdpa"

    def __init__(self, ops: Any = None) -> None:
        self.ops = torch.ops.aten if ops is None else ops
        self._aux: dict[tuple[str, torch.dtype, int], tuple] = {}

    @staticmethod
    def uses_flash(dtype: torch.dtype) -> bool:
        return dtype in HALF_DTYPES

    def forward(self, q, k, v, scale, causal=True):
        if self.uses_flash(q.dtype):
            res = self.ops._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            return res[0], res[1]
        n_rep = q.shape[1] // k.shape[1]
        out, lse, _, _ = self.ops._scaled_dot_product_efficient_attention(
            q, expand_kv(k, n_rep), expand_kv(v, n_rep), None, True, 0.0, causal, scale=scale)
        return out, lse[..., : q.shape[2]]

    def backward(self, dout, q, k, v, out, lse, scale, causal=True):
        aux = self._dense_aux(q)
        if self.uses_flash(q.dtype):
            # aux: the cumulative lengths (None: dense batch) and the RNG placeholders.
            cum_seq_q, cum_seq_k, rng_a, rng_b = aux
            dq, dk, dv = self.ops._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse.contiguous(), cum_seq_q, cum_seq_k, q.shape[2], k.shape[2], 0.0,
                causal, rng_a, rng_b, scale=scale)
            return dq, dk, dv
        n_rep = q.shape[1] // k.shape[1]
        seed, offset = aux
        dq, dk, dv, _ = self.ops._scaled_dot_product_efficient_attention_backward(
            dout, q, expand_kv(k, n_rep), expand_kv(v, n_rep), None, out, pad_lse(lse), seed, offset, 0.0,
            [True, True, True, False], causal, scale=scale)
        return dq, fold_kv_grad(dk, n_rep), fold_kv_grad(dv, n_rep)

    def _dense_aux(self, q: Tensor) -> tuple:
        """The extra outputs of a tiny dense, dropout-free forward of the kernel ``q`` runs."""
        key = (str(q.device), q.dtype, q.shape[-1])
        if key not in self._aux:
            tiny = torch.zeros(1, 1, 8, q.shape[-1], dtype=q.dtype, device=q.device)
            if self.uses_flash(q.dtype):
                res = self.ops._scaled_dot_product_flash_attention(tiny, tiny, tiny, 0.0, True, False, scale=1.0)
                self._aux[key] = (res[2], res[3], res[6], res[7])
            else:
                res = self.ops._scaled_dot_product_efficient_attention(tiny, tiny, tiny, None, True, 0.0, True,
                                                                       scale=1.0)
                self._aux[key] = (res[2], res[3])
        return self._aux[key]


def pad_lse(lse: Tensor) -> Tensor:
    """``[B, H, S]`` -> ``[B, H, ceil(S/32)*32]`` as the memory-efficient forward lays it out;
    the padded rows hold +inf (no query there: their probabilities are exp(-inf) = 0)."""
    s = lse.shape[-1]
    padded = -(-s // LSE_ALIGN) * LSE_ALIGN
    if padded == s and lse.is_contiguous():
        return lse
    out = lse.new_full((*lse.shape[:-1], padded), float("inf"))
    out[..., :s] = lse
    return out


class SdpaBackend(LocalAttentionBackend):
    """``sdpa``: torch's own fused kernels, on the device the tensors are on (CPU or CUDA)."""

    name = "sdpa"

    def __init__(self) -> None:
        self.cpu, self.cuda = SdpaCpuKernels(), SdpaCudaKernels()

    def _kernels(self, q: Tensor) -> LocalAttentionBackend:
        return self.cpu if q.device.type == "cpu" else self.cuda

    def forward(self, q, k, v, scale, causal=True):
        return self._kernels(q).forward(q, k, v, scale, causal)

    def backward(self, dout, q, k, v, out, lse, scale, causal=True):
        return self._kernels(q).backward(dout, q, k, v, out, lse, scale, causal)


ESSENTIAL_ARGUMENTS = ("softmax_scale", "causal")
"""Arguments a flash-attn internal must accept by these names: dropped silently (a release that
renamed one), the kernel would run with its default scale or mask."""


def _call_by_name(fn: Callable[..., Any], values: dict[str, Any]) -> Any:
    """Call a flash-attn internal whose positional signature changes between releases,
    binding our arguments by parameter name and leaving the rest at their defaults (``values``
    may name alternatives a release does not have, e.g. ``window_size`` or its two halves)."""
    params = inspect.signature(fn).parameters
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in values
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = [n for n in ESSENTIAL_ARGUMENTS if n in values and n not in params]
    if missing or unknown:
        raise ConfigError(f"{fn.__module__}.{fn.__name__} needs arguments {missing} this backend does not know"
                          if missing else f"{fn.__module__}.{fn.__name__} takes no {unknown}: this release of the "
                          "package does not match the backend (a scale or mask would be dropped)")
    return fn(**{n: v for n, v in values.items() if n in params})


class _FlashAttnFamily(LocalAttentionBackend):
    """flash-attn kernels: ``[B, S, H, D]`` layout, native GQA, LSE ``[B, H, S]`` fp32."""

    module_name: ClassVar[str]
    distribution: ClassVar[str]
    """The PyPI distribution that provides ``module_name`` (looked up without importing it)."""
    capabilities: ClassVar[tuple[int, ...]]
    """CUDA compute-capability majors the forward *and* backward kernels support."""
    dtypes = HALF_DTYPES

    @classmethod
    def _module(cls):
        return importlib.import_module(cls.module_name)

    @classmethod
    def installed(cls) -> bool:
        """The package is installed (metadata only: nothing imported, no CUDA touched)."""
        try:
            importlib.metadata.distribution(cls.distribution)
        except importlib.metadata.PackageNotFoundError:
            return False
        return True

    @classmethod
    def unavailable_reason(cls, probe: bool = True) -> str | None:
        # Without probing (before process groups, possibly on a login node without a GPU) only
        # the package's metadata is read; the device is probed at conversion.
        if probe and not torch.cuda.is_available():
            return f"{cls.name} needs a CUDA device"
        if not cls.installed():
            return f"{cls.name} needs the {cls.distribution!r} package (pip install {cls.distribution})"
        if not probe:
            return None
        major = torch.cuda.get_device_capability()[0]
        if major not in cls.capabilities:
            return (f"{cls.name} supports compute capability {'/'.join(f'{m}.x' for m in cls.capabilities)}, "
                    f"this GPU is {major}.x")
        try:
            cls._module()
        except Exception as exc:  # an ImportError, or a CUDA build that does not match torch
            return (f"{cls.name} needs the {cls.distribution!r} package importable as {cls.module_name!r} "
                    f"({type(exc).__name__}: {exc})")
        return None

    @staticmethod
    def _bshd(t: Tensor) -> Tensor:
        t = t.transpose(1, 2)
        return t if t.stride(-1) == 1 else t.contiguous()

    @staticmethod
    def _window() -> dict[str, Any]:
        return {"window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1}


class FlashAttn2Backend(_FlashAttnFamily):
    name = "flash_attn"
    module_name = "flash_attn.flash_attn_interface"
    distribution = "flash-attn"
    capabilities = (8, 9)

    def forward(self, q, k, v, scale, causal=True):
        self.check_inputs(q)
        fa = self._module()
        qb, kb, vb = self._bshd(q), self._bshd(k), self._bshd(v)
        res = _call_by_name(fa._flash_attn_forward, {
            "q": qb, "k": kb, "v": vb, "dropout_p": 0.0, "softmax_scale": scale, "causal": causal,
            "softcap": 0.0, "alibi_slopes": None, "return_softmax": False, **self._window()})
        return res[0].transpose(1, 2), res[1]

    def backward(self, dout, q, k, v, out, lse, scale, causal=True):
        fa = self._module()
        qb, kb, vb = self._bshd(q), self._bshd(k), self._bshd(v)
        dq, dk, dv = torch.empty_like(qb), torch.empty_like(kb), torch.empty_like(vb)
        _call_by_name(fa._flash_attn_backward, {
            "dout": self._bshd(dout), "q": qb, "k": kb, "v": vb, "out": self._bshd(out), "softmax_lse": lse,
            "dq": dq, "dk": dk, "dv": dv, "dropout_p": 0.0, "softmax_scale": scale, "causal": causal,
            "softcap": 0.0, "alibi_slopes": None, "deterministic": False, "rng_state": None, **self._window()})
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class FlashAttn3Backend(_FlashAttnFamily):
    name = "flash_attn3"
    module_name = "flash_attn_interface"
    distribution = "flash_attn_3"
    capabilities = (9,)

    def forward(self, q, k, v, scale, causal=True):
        self.check_inputs(q)
        fa = self._module()
        res = _call_by_name(fa._flash_attn_forward, {
            "q": self._bshd(q), "k": self._bshd(k), "v": self._bshd(v), "softmax_scale": scale,
            "causal": causal, **self._window()})
        return res[0].transpose(1, 2), res[1]

    def backward(self, dout, q, k, v, out, lse, scale, causal=True):
        fa = self._module()
        qb, kb, vb = self._bshd(q), self._bshd(k), self._bshd(v)
        dq, dk, dv = torch.empty_like(qb), torch.empty_like(kb), torch.empty_like(vb)
        _call_by_name(fa._flash_attn_backward, {
            "dout": self._bshd(dout), "q": qb, "k": kb, "v": vb, "out": self._bshd(out), "softmax_lse": lse,
            "dq": dq, "dk": dk, "dv": dv, "softmax_scale": scale, "causal": causal, "deterministic": False,
            **self._window()})
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class FlashAttn4Backend(_FlashAttnFamily):
    """FlashAttention-4 (``pip install flash-attn-4``, CuTe DSL, kernels compiled at first use).

    ``flash_attn.cute.interface._flash_attn_fwd(q, k, v, softmax_scale=, causal=, return_lse=True)``
    returns ``(out [B, S, H, D], lse [B, H, S] fp32, ...)``; ``_flash_attn_bwd(q, k, v, out, dout,
    lse, softmax_scale=, causal=)`` returns ``(dq, dk, dv)`` with dK/dV already summed over a GQA
    group. Its backward runs on compute capability 9.x-12.x, fp16/bf16 only.
    """

    name = "flash_attn4"
    module_name = "flash_attn.cute.interface"
    distribution = "flash-attn-4"
    capabilities = (9, 10, 11, 12)

    def forward(self, q, k, v, scale, causal=True):
        self.check_inputs(q)
        fa = self._module()
        out, lse = _call_by_name(fa._flash_attn_fwd, {
            "q": self._bshd(q), "k": self._bshd(k), "v": self._bshd(v), "softmax_scale": scale,
            "causal": causal, "return_lse": True})[:2]
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, scale, causal=True):
        fa = self._module()
        dq, dk, dv = _call_by_name(fa._flash_attn_bwd, {
            "q": self._bshd(q), "k": self._bshd(k), "v": self._bshd(v), "out": self._bshd(out),
            "dout": self._bshd(dout), "lse": lse.contiguous(), "softmax_scale": scale, "causal": causal})[:3]
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


BACKENDS: dict[str, type[LocalAttentionBackend]] = {
    cls.name: cls for cls in (SdpaBackend, MathBackend, FlashAttn2Backend, FlashAttn3Backend, FlashAttn4Backend)
}

AUTO = "auto"
BACKEND_SETTINGS = (AUTO, *BACKENDS)
"""Values of ``[upipe] attention_backend``: ``auto`` and every backend name."""
AUTO_ORDER = ("flash_attn4", "flash_attn3", "flash_attn", "sdpa")
"""``auto`` takes the first of these usable here: fastest first (FA4 and FA3 on Hopper, FA2,
then torch's own kernels, which run everywhere)."""


@dataclass(frozen=True)
class BackendChoice:
    """The backend a setting resolves to, and why faster ones were passed over (for ``auto``)."""

    setting: str
    name: str
    passed_over: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        if self.setting != AUTO:
            return f"attention backend {self.name}"
        skipped = "; ".join(f"{name}: {why}" for name, why in self.passed_over)
        return f"attention backend auto -> {self.name}" + (f" (passed over {skipped})" if skipped else "")


def _problem(cls: type[LocalAttentionBackend], dtype: torch.dtype | None, ring: bool, probe: bool) -> str | None:
    if ring and not cls.merged_backward:
        return (f"attention backend {cls.name!r} recomputes its block's softmax in backward instead of "
                "using the merged out/lse, which ring attention needs: its ring/USP gradients would be wrong")
    return cls.dtype_problem(dtype) or cls.unavailable_reason(probe)


def choose_backend(setting: str, dtype: torch.dtype | None = None, ring: bool = False,
                   probe: bool = True) -> BackendChoice:
    """Resolve ``[upipe] attention_backend`` for inputs of ``dtype`` (None: not known yet) and,
    with ``ring``, for ring/USP. ``auto`` takes the first usable name of ``AUTO_ORDER``; a
    named backend that cannot run here raises ConfigError naming why and the valid choices.
    ``probe=False``: no import, no CUDA query (see ``unavailable_reason``)."""
    if setting == AUTO:
        passed_over = []
        for name in AUTO_ORDER:
            why = _problem(BACKENDS[name], dtype, ring, probe)
            if why is None:
                return BackendChoice(setting, name, tuple(passed_over))
            passed_over.append((name, why))
        raise ConfigError("attention_backend = 'auto' found no usable backend: "
                          + "; ".join(f"{n}: {w}" for n, w in passed_over))
    if setting not in BACKENDS:
        raise ConfigError(f"unknown attention backend {setting!r}: valid backends are "
                          f"{', '.join(BACKEND_SETTINGS)}")
    why = _problem(BACKENDS[setting], dtype, ring, probe)
    if why is not None:
        raise ConfigError(f"attention backend {setting!r} is not usable here: {why}")
    return BackendChoice(setting, setting)


def get_backend(name: str, dtype: torch.dtype | None = None, ring: bool = False) -> LocalAttentionBackend:
    """Instantiate a backend by name (or ``auto``); unknown or unusable here raises ConfigError."""
    return BACKENDS[choose_backend(name, dtype, ring).name]()


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
