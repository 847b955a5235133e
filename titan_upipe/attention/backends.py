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

Backends with ``varlen`` (the flash-attn ones) also run ``varlen_forward``/``varlen_backward``:
causal attention inside each of many sequences packed end to end (``cu_seqlens``) in one kernel
call, on packed ``[T, H, D]`` tensors with lse ``[Hq, T]`` (flash-attn's varlen layout), under the
same merged out/lse contract. Packed documents on CUDA run on them (``documents.py``).

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
cudnn       cuDNN attention through torch's aten ops       CUDA sm80-sm121,    fp16, bf16
            (``cudnn_backend.py``; no extra wheel),        cuDNN >= 9.15.1
            native GQA, backward from the given out/lse;
            head_dim a multiple of 8, <= 128
flash_attn  flash-attn 2 (``flash_attn``)                  CUDA sm80+          fp16, bf16
flash_attn3 flash-attn 3 (``flash_attn_interface``)        Hopper (sm90)       fp16, bf16
flash_attn4 FlashAttention-4 (``flash-attn-4``:            Hopper, Blackwell   fp16, bf16
            ``flash_attn.cute``)
auto        at conversion, the fastest backend usable      --                  --
            here for the compute dtype and head_dim:
            the order measured on GPUs of this one's
            architecture merged into its default order
            (``kernel_speed.py``; sm90+: flash_attn4 >
            flash_attn3 > cudnn > flash_attn > sdpa)
=========== ============================================== =================== ==========

The flash-attn packages are imported lazily; a missing one (or, for ``cudnn``, a torch without
cuDNN 9.15.1+, a GPU or head_dim it does not run) raises a ConfigError at conversion time, it is
never replaced by another kernel silently (``auto`` is a choice the user made, logged with the
reasons the faster backends were passed over).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from titan_upipe.attention.backend_base import (  # noqa: F401  (re-exported: the backends' home)
    HALF_DTYPES,
    LocalAttentionBackend,
    Tensor,
    expand_kv,
    fold_kv_grad,
)
from titan_upipe.attention.cudnn_backend import CudnnBackend
from titan_upipe.attention.flash_backends import (  # noqa: F401
    FlashAttn2Backend,
    FlashAttn3Backend,
    FlashAttn4Backend,
)
from titan_upipe.costs.kernel_speed import DEFAULT_ORDER, arch_of_capability, measured_order
from titan_upipe.errors import ConfigError


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


def current_arch() -> str | None:
    """The architecture of this process's CUDA device as ``smXY`` (None without one)."""
    return arch_of_capability(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


BACKENDS: dict[str, type[LocalAttentionBackend]] = {
    cls.name: cls for cls in (SdpaBackend, MathBackend, CudnnBackend, FlashAttn2Backend, FlashAttn3Backend,
                              FlashAttn4Backend)
}

AUTO = "auto"
BACKEND_SETTINGS = (AUTO, *BACKENDS)
"""Values of ``[upipe] attention_backend``: ``auto`` and every backend name."""
AUTO_ORDER = DEFAULT_ORDER
"""``auto``'s candidates: ("flash_attn4", "flash_attn3", "flash_attn", "sdpa", "cudnn"), also their
order where the GPU's architecture is not known (``probe=False``: no CUDA query) or older than Hopper.
On a GPU ``auto_order`` ranks them for its architecture (``kernel_speed.measured_order``): the
speeds measured on that architecture (``titan_upipe/resources/kernel_speed.csv``) merged into its
default order, on sm90 and newer flash_attn4 > flash_attn3 > cudnn > flash_attn > sdpa (cuDNN
measured 1.7x SDPA's flash kernel on an H200, 2026-11-27, after passing the contract there). Before
Hopper nothing is measured, and ``cudnn`` stays behind torch's own kernel until a GPU there ranks it."""


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


def _problem(cls: type[LocalAttentionBackend], dtype: torch.dtype | None, ring: bool, probe: bool,
             head_dim: int | None = None, varlen: bool = False) -> str | None:
    if ring and not cls.merged_backward:
        return (f"attention backend {cls.name!r} recomputes its block's softmax in backward instead of "
                "using the merged out/lse, which ring attention needs: its ring/USP gradients would be wrong")
    if varlen and not cls.varlen:
        return (f"{cls.name} has no varlen (cu_seqlens) kernel, which packed documents on CUDA need "
                "(one kernel call per document otherwise)")
    return cls.dtype_problem(dtype) or cls.head_dim_problem(head_dim) or cls.unavailable_reason(probe)


def auto_order(probe: bool = True, head_dim: int | None = None, dtype: torch.dtype | None = None) -> tuple[str, ...]:
    """``auto``'s candidates for a job of ``head_dim`` and ``dtype``, fastest first: on this GPU, the
    order of its architecture (``kernel_speed.measured_order``: the rows of every GPU of that compute
    capability, a backend that failed its contract there left out, unmeasured ones placed by the
    architecture's default order); without one, or with ``probe=False`` (no CUDA query), ``AUTO_ORDER``."""
    if not (probe and torch.cuda.is_available()):
        return AUTO_ORDER
    return measured_order(arch_of_capability(torch.cuda.get_device_capability()), AUTO_ORDER,
                          head_dim=head_dim, dtype=dtype)


def choose_backend(setting: str, dtype: torch.dtype | None = None, ring: bool = False,
                   probe: bool = True, head_dim: int | None = None, varlen: bool = False) -> BackendChoice:
    """Resolve ``[upipe] attention_backend`` for inputs of ``dtype`` and heads of ``head_dim``
    (None: not known yet), with ``ring`` for ring/USP and, for ``auto``, with ``varlen`` for packed
    documents on CUDA. ``auto`` takes the first usable name of ``auto_order`` (measured on this GPU's
    architecture, else its default order); a named backend that cannot run here raises ConfigError naming why and the
    valid choices. ``probe=False``: no import, no CUDA query (see ``unavailable_reason``)."""
    if setting == AUTO:
        passed_over = []
        for name in auto_order(probe, head_dim, dtype):
            why = _problem(BACKENDS[name], dtype, ring, probe, head_dim, varlen)
            if why is None:
                return BackendChoice(setting, name, tuple(passed_over))
            passed_over.append((name, why))
        raise ConfigError("attention_backend = 'auto' found no usable backend: "
                          + "; ".join(f"{n}: {w}" for n, w in passed_over))
    if setting not in BACKENDS:
        raise ConfigError(f"unknown attention backend {setting!r}: valid backends are "
                          f"{', '.join(BACKEND_SETTINGS)}")
    # (a named backend without varlen for packed documents: refused by the document check, which
    # names the backends that have one, attention.documents.document_kernel_problem)
    why = _problem(BACKENDS[setting], dtype, ring, probe, head_dim)
    if why is not None:
        raise ConfigError(f"attention backend {setting!r} is not usable here: {why}")
    return BackendChoice(setting, setting)


def get_backend(name: str, dtype: torch.dtype | None = None, ring: bool = False,
                head_dim: int | None = None) -> LocalAttentionBackend:
    """Instantiate a backend by name (or ``auto``); unknown or unusable here (for ``dtype`` and
    ``head_dim`` where given) raises ConfigError."""
    return BACKENDS[choose_backend(name, dtype, ring, head_dim=head_dim).name]()


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
