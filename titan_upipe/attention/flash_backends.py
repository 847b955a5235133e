"""flash-attn 2, 3 and FlashAttention-4 as local attention backends (imported lazily).

Each backend calls the package's internal forward/backward (dense and varlen) by parameter name
(``_call_by_name``): the positional signatures change between releases, and a release that
renamed an argument we must pass is refused, never run with that argument dropped. The contract
they honour is in ``titan_upipe.attention.backends``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from titan_upipe.attention.backend_base import HALF_DTYPES, LocalAttentionBackend
from titan_upipe.errors import ConfigError

Tensor = torch.Tensor


ESSENTIAL_ARGUMENTS = (("softmax_scale",), ("causal", "is_causal"), ("cu_seqlens_q",), ("cu_seqlens_k",),
                       ("dq",), ("dk",), ("dv",))
"""Arguments a flash-attn internal must accept under one of these names when we pass them: dropped
silently (a release that renamed one), the kernel would run with its default scale or mask, take
the packed sequences for one, or write the gradients into buffers of its own."""


def _python_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    # torch.library.custom_op (flash-attn 2.6+ and 3 on torch >= 2.4) wraps the function in an
    # object whose own signature is (*args, **kwargs); the wrapped function has the real one.
    return getattr(fn, "_init_fn", fn)


def _call_by_name(fn: Callable[..., Any], values: dict[str, Any]) -> Any:
    """Call a flash-attn internal whose positional signature changes between releases,
    binding our arguments by parameter name and leaving the rest at their defaults (``values``
    may name alternatives a release does not have, e.g. ``window_size`` or its two halves,
    ``causal`` or ``is_causal``)."""
    target = _python_function(fn)
    params = inspect.signature(target).parameters
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in values
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = [names[0] for names in ESSENTIAL_ARGUMENTS
               if any(n in values for n in names) and not any(n in params for n in names)]
    if missing or unknown:
        where = f"{target.__module__}.{getattr(target, '__name__', type(target).__name__)}"
        raise ConfigError(f"{where} needs arguments {missing} this backend does not know"
                          if missing else f"{where} takes no {unknown}: this release of the package does "
                          "not match the backend (a scale, mask, sequence boundary or gradient buffer would be "
                          "dropped)")
    return fn(**{n: v for n, v in values.items() if n in params})


class _FlashAttnFamily(LocalAttentionBackend):
    """flash-attn kernels: ``[B, S, H, D]`` layout, native GQA, LSE ``[B, H, S]`` fp32; varlen
    calls on packed ``[T, H, D]`` with LSE ``[H, T]``."""

    module_name: ClassVar[str]
    distribution: ClassVar[str]
    """The PyPI distribution that provides ``module_name`` (looked up without importing it)."""
    capabilities: ClassVar[tuple[int, ...]]
    """CUDA compute-capability majors the forward *and* backward kernels support."""
    dtypes = HALF_DTYPES
    varlen = True

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

    def _varlen_inputs(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> dict[str, Any]:
        """The arguments every flash-attn varlen call shares: packed q/k/v (last dim contiguous)
        and the same boundaries for queries and keys (a diagonal block)."""
        if q.dim() != 3 or k.dim() != 3 or cu_seqlens.dtype != torch.int32:
            raise ValueError(f"varlen kernels take packed [tokens, heads, head_dim] tensors and int32 cu_seqlens, got "
                             f"q {tuple(q.shape)}, k {tuple(k.shape)}, cu_seqlens {cu_seqlens.dtype}")
        packed = [t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v)]
        return {"q": packed[0], "k": packed[1], "v": packed[2], "cu_seqlens_q": cu_seqlens,
                "cu_seqlens_k": cu_seqlens, "max_seqlen_q": max_seqlen, "max_seqlen_k": max_seqlen}

    def _packed_lse(self, lse: Tensor, q: Tensor) -> Tensor:
        """The varlen LSE as ``[Hq, T]``. flash-attn 2 before 2.6 padded it per sequence
        (``[N, Hq, max_seqlen]``) and its backward wants it back so: refused, not reshaped."""
        expected = (q.shape[1], q.shape[0])
        if tuple(lse.shape) != expected:
            raise ConfigError(f"{self.name}'s varlen forward returned lse of shape {tuple(lse.shape)}, expected "
                              f"[heads, tokens] = {expected}: this release lays the varlen LSE out differently "
                              f"(flash-attn before 2.6 padded it per sequence); upgrade {self.distribution}")
        return lse


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

    def varlen_forward(self, q, k, v, scale, cu_seqlens, max_seqlen):
        """``_flash_attn_varlen_forward -> (out [T, Hq, D], lse [Hq, T], S_dmask, rng_state)`` (2.6+)."""
        self.check_inputs(q)
        res = _call_by_name(self._module()._flash_attn_varlen_forward, {
            **self._varlen_inputs(q, k, v, cu_seqlens, max_seqlen), "dropout_p": 0.0, "softmax_scale": scale,
            "causal": True, "softcap": 0.0, "alibi_slopes": None, "return_softmax": False, "block_table": None,
            **self._window()})
        return res[0], self._packed_lse(res[1], q)

    def varlen_backward(self, dout, q, k, v, out, lse, scale, cu_seqlens, max_seqlen):
        """``_flash_attn_varlen_backward`` writes dq/dk/dv into the buffers it is given."""
        inputs = self._varlen_inputs(q, k, v, cu_seqlens, max_seqlen)
        dq, dk, dv = (torch.empty_like(inputs[n]) for n in ("q", "k", "v"))
        _call_by_name(self._module()._flash_attn_varlen_backward, {
            **inputs, "dout": dout.contiguous(), "out": out.contiguous(), "softmax_lse": lse.contiguous(),
            "dq": dq, "dk": dk, "dv": dv, "dropout_p": 0.0, "softmax_scale": scale, "causal": True, "softcap": 0.0,
            "alibi_slopes": None, "deterministic": False, "rng_state": None, **self._window()})
        return dq, dk, dv


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
            "dq": dq, "dk": dk, "dv": dv, "softmax_scale": scale, "causal": causal, "is_causal": causal,
            "deterministic": False, **self._window()})
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def varlen_forward(self, q, k, v, scale, cu_seqlens, max_seqlen):
        """The same ``_flash_attn_forward`` with ``cu_seqlens_q/k``: ``(out [T, Hq, D], lse [Hq, T], ...)``."""
        self.check_inputs(q)
        res = _call_by_name(self._module()._flash_attn_forward, {
            **self._varlen_inputs(q, k, v, cu_seqlens, max_seqlen), "softmax_scale": scale, "causal": True,
            **self._window()})
        return res[0], self._packed_lse(res[1], q)

    def varlen_backward(self, dout, q, k, v, out, lse, scale, cu_seqlens, max_seqlen):
        """``_flash_attn_backward`` with ``cu_seqlens_q/k`` (its causal flag is ``is_causal`` in
        recent releases), writing dq/dk/dv into the buffers it is given."""
        inputs = self._varlen_inputs(q, k, v, cu_seqlens, max_seqlen)
        dq, dk, dv = (torch.empty_like(inputs[n]) for n in ("q", "k", "v"))
        _call_by_name(self._module()._flash_attn_backward, {
            **inputs, "dout": dout.contiguous(), "out": out.contiguous(), "softmax_lse": lse.contiguous(),
            "dq": dq, "dk": dk, "dv": dv, "softmax_scale": scale, "causal": True, "is_causal": True,
            "deterministic": False, **self._window()})
        return dq, dk, dv


FA4_HEAD_DIMS = (*range(8, 129, 8), 256)
"""Head dims FlashAttention-4 4.0.0b36 runs forward *and* backward on every GPU this backend
takes: ``_validate_head_dims`` in ``flash_attn/cute/interface.py``, which ``_flash_attn_fwd`` and
``_flash_attn_bwd`` both call, wants a multiple of 16 bytes / element size (8 for fp16/bf16) and
on sm90 8 <= d <= 256, on sm100/sm110 8 <= d <= 128 or d = 256 (192 only with a 128 value head);
sm120 is not checked there (FakeTensorMode compiles its kernels for d = 128 and 256). The backend
is chosen before the GPU is known, so Hopper's 136..248 are refused with Blackwell's."""


class FlashAttn4Backend(_FlashAttnFamily):
    """FlashAttention-4 (``pip install flash-attn-4``, CuTe DSL, kernels compiled at first use).

    ``flash_attn.cute.interface._flash_attn_fwd(q, k, v, softmax_scale=, causal=, return_lse=True)``
    returns ``(out [B, S, H, D], lse [B, H, S] fp32, ...)``; ``_flash_attn_bwd(q, k, v, out, dout,
    lse, softmax_scale=, causal=)`` returns ``(dq, dk, dv)`` with dK/dV already summed over a GQA
    group. Its backward runs on compute capability 9.x-12.x, fp16/bf16 only, heads of ``FA4_HEAD_DIMS``.
    ``tests/test_fa4_compile.py`` compiles every call below for sm_90a without a GPU.
    """

    name = "flash_attn4"
    module_name = "flash_attn.cute.interface"
    distribution = "flash-attn-4"
    capabilities = (9, 10, 11, 12)

    @classmethod
    def head_dim_problem(cls, head_dim: int | None) -> str | None:
        # At conversion, not at the first call: there FA4 fails an assert mid-step.
        if head_dim is None or head_dim in FA4_HEAD_DIMS:
            return None
        return (f"{cls.name} (FlashAttention-4 4.0.0b36) runs head_dim a multiple of 8 from 8 to 128, or 256, "
                f"forward and backward on every GPU it supports (Hopper alone also runs 136-248, Blackwell "
                f"does not), not {head_dim}: use attention_backend 'sdpa'")

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

    def varlen_forward(self, q, k, v, scale, cu_seqlens, max_seqlen):
        """``_flash_attn_fwd`` with ``cu_seqlens_q/k``: ``(out [T, Hq, D], lse [Hq, T], ...)``."""
        self.check_inputs(q)
        out, lse = _call_by_name(self._module()._flash_attn_fwd, {
            **self._varlen_inputs(q, k, v, cu_seqlens, max_seqlen), "softmax_scale": scale, "causal": True,
            "return_lse": True})[:2]
        return out, self._packed_lse(lse, q)

    def varlen_backward(self, dout, q, k, v, out, lse, scale, cu_seqlens, max_seqlen):
        """``_flash_attn_bwd`` with ``cu_seqlens_q/k`` returns ``(dq, dk, dv)``."""
        dq, dk, dv = _call_by_name(self._module()._flash_attn_bwd, {
            **self._varlen_inputs(q, k, v, cu_seqlens, max_seqlen), "out": out.contiguous(),
            "dout": dout.contiguous(), "lse": lse.contiguous(), "softmax_scale": scale, "causal": True})[:3]
        return dq, dk, dv
