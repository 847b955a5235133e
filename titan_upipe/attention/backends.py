"""Local (single-rank) attention kernels, causal or full, behind one interface returning (out, lse).

UPipe saves only the log-sum-exp of each stage and recomputes the rest, so every
backend must (a) return the LSE from its forward and (b) run its backward from
``(dout, q, k, v, out, lse)`` without an autograd graph.

Every call is either causal (``causal=True``: a diagonal block, ``q`` and ``k`` of the same
length, query ``i`` sees keys ``[0, i]``) or full (``causal=False``: every query sees every
key, the off-diagonal blocks of ring attention).

Tensors use the torch SDPA convention: ``q`` is ``[B, Hq, S, D]`` and ``k``/``v`` are
``[B, Hkv, S, D]`` with ``Hq`` a multiple of ``Hkv`` (GQA: query head ``i`` uses KV head
``i // (Hq/Hkv)``). Inputs may be strided views; ``lse`` is fp32 ``[B, Hq, S]``.
The returned ``dk``/``dv`` are already summed over the query heads sharing a KV head.

Backends:

========== ============================================ ===========================
name       kernel                                       where
========== ============================================ ===========================
sdpa       aten flash-for-CPU (CPU); aten flash (fp16/  CPU and CUDA (default)
           bf16) or memory-efficient (fp32) (CUDA)
math       explicit fp32 softmax, chunked over queries  anywhere (reference/tests)
flash_attn flash-attn 2 (``flash_attn``)                CUDA, when installed
flash_attn3 flash-attn 3 (``flash_attn_interface``)     Hopper CUDA, when installed
flash_attn4 FA4 (``flash_attn.cute``)                   Hopper/Blackwell, when installed
========== ============================================ ===========================

The flash-attn packages are imported lazily; a missing one raises a ConfigError at
conversion time, it is never replaced by another kernel silently.
"""

from __future__ import annotations

import importlib
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from titan_upipe.config import ConfigError

Tensor = torch.Tensor


class LocalAttentionBackend(ABC):
    """Causal (or full, for ring blocks) attention on head-sharded tensors."""

    name: ClassVar[str]

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when usable here, else why not (checked at conversion, before any communication)."""
        return None

    @abstractmethod
    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True) -> tuple[Tensor, Tensor]:
        """Return ``out`` ``[B, Hq, S, D]`` (dtype of q) and ``lse`` fp32 ``[B, Hq, S]``."""

    @abstractmethod
    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
        causal: bool = True,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Return ``dq, dk, dv`` shaped like ``q, k, v``. ``out``/``lse`` may be those of a larger
        attention this block is part of (ring attention): the gradients are then this block's
        share, exactly as flash-attention's backward defines them."""


def _expand_kv(t: Tensor, n_rep: int) -> Tensor:
    return t if n_rep == 1 else t.repeat_interleave(n_rep, dim=1)


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


class SdpaBackend(LocalAttentionBackend):
    """The kernels behind ``F.scaled_dot_product_attention``, called through their aten ops
    because only those return the LSE and accept it back in backward."""

    name = "sdpa"

    def forward(self, q, k, v, scale, causal=True):
        if q.device.type == "cpu":
            # The same kernel TorchTitan's SDPA wrapper runs on CPU; GQA is native.
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
            return out, lse
        n_rep = q.shape[1] // k.shape[1]
        ke, ve = _expand_kv(k, n_rep), _expand_kv(v, n_rep)
        if q.dtype in (torch.float16, torch.bfloat16):
            res = torch.ops.aten._scaled_dot_product_flash_attention(q, ke, ve, 0.0, causal, False, scale=scale)
            return res[0], res[1]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, ke, ve, None, True, 0.0, causal, scale=scale)
        # The memory-efficient kernel pads the LSE rows to a multiple of 32.
        return out, lse[..., : q.shape[2]]

    def backward(self, dout, q, k, v, out, lse, scale, causal=True):
        if q.device.type == "cpu":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, causal, scale=scale
            )
        # CUDA: the aten backward ops want the forward's RNG/cu_seqlens bookkeeping, whose
        # layout changes between torch releases; recompute the forward under autograd instead
        # (one extra attention forward per stage; use a flash_attn* backend for speed).
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            recomputed = F.scaled_dot_product_attention(
                *leaves, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )
            dq, dk, dv = torch.autograd.grad(recomputed, leaves, dout)
        return dq, dk, dv


def _call_by_name(fn: Callable[..., Any], values: dict[str, Any]) -> Any:
    """Call a flash-attn internal whose positional signature changes between releases,
    binding our arguments by parameter name and leaving the rest at their defaults."""
    params = inspect.signature(fn).parameters
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in values
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing:
        raise ConfigError(f"{fn.__module__}.{fn.__name__} needs arguments {missing} this backend does not know")
    return fn(**{n: v for n, v in values.items() if n in params})


class _FlashAttnFamily(LocalAttentionBackend):
    """flash-attn kernels: ``[B, S, H, D]`` layout, native GQA, LSE ``[B, H, S]`` fp32."""

    module_name: ClassVar[str]

    @classmethod
    def _module(cls):
        return importlib.import_module(cls.module_name)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.cuda.is_available():
            return f"{cls.name} needs a CUDA device"
        try:
            cls._module()
        except Exception as exc:  # an ImportError, or a CUDA build that does not match torch
            return f"{cls.name} needs the {cls.module_name!r} package ({type(exc).__name__}: {exc})"
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

    def forward(self, q, k, v, scale, causal=True):
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

    def forward(self, q, k, v, scale, causal=True):
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
    name = "flash_attn4"
    module_name = "flash_attn.cute.interface"

    def forward(self, q, k, v, scale, causal=True):
        fa = self._module()
        out, lse = _call_by_name(fa._flash_attn_fwd, {
            "q": self._bshd(q), "k": self._bshd(k), "v": self._bshd(v), "softmax_scale": scale,
            "causal": causal, "return_lse": True})[:2]
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, scale, causal=True):
        fa = self._module()
        dq, dk, dv = _call_by_name(fa._flash_attn_bwd, {
            "q": self._bshd(q), "k": self._bshd(k), "v": self._bshd(v), "out": self._bshd(out),
            "dout": self._bshd(dout), "lse": lse, "softmax_scale": scale, "causal": causal})[:3]
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


BACKENDS: dict[str, type[LocalAttentionBackend]] = {
    cls.name: cls for cls in (SdpaBackend, MathBackend, FlashAttn2Backend, FlashAttn3Backend, FlashAttn4Backend)
}


def get_backend(name: str) -> LocalAttentionBackend:
    """Instantiate a backend by name; unknown or unusable here raises ConfigError."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}: valid backends are {', '.join(BACKENDS)}")
    reason = BACKENDS[name].unavailable_reason()
    if reason is not None:
        raise ConfigError(f"attention backend {name!r} is not usable here: {reason}")
    return BACKENDS[name]()


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
