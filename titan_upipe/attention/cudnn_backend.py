"""``cudnn``: cuDNN's fused attention through torch's own aten ops (no extra wheel).

Forward, ``aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, scale=s)``::

    out = softmax(s q k^T + mask) v            [B, Hq, S, D], q's dtype
    logsumexp_i = log sum_j exp(s q_i . k_j)   [B, Hq, S, 1], fp32 (natural log)

with ``q [B, Hq, S, D]`` and ``k``/``v [B, Hkv, S_kv, D]``, ``Hkv`` dividing ``Hq`` (GQA native:
no expanded K/V copies). The backward op takes ``out`` and ``logsumexp`` as inputs and computes
``P = exp(s q k^T - lse)`` and ``dS = P * (dout v^T - rowsum(dout * out))`` from them (flash-
attention's definition), so it honours the merged out/lse of the backend contract
(``backends.py``); ``dk``/``dv`` come back with ``Hkv`` heads, summed over each GQA group.

What the ops need, and what this module does about it:

* out and dout with the same strides (cuDNN builds that assert ``same_strides(o, dO)``,
  pytorch#176915, ring attention's merged out): both made contiguous before the backward;
* the LSE as ``[B, H, S, 1]`` fp32 and contiguous, as the forward returns it: the contract's
  ``[B, H, S]`` is made contiguous and unsqueezed;
* max_q/max_k as Python ints, dropout 0, no cumulative lengths (a defined ``cum_seq`` makes the
  kernel treat the batch as packed sequences), the RNG placeholders of a dense forward of this
  torch (taken once per device, dtype and head_dim from a tiny forward);
* no attention mask: every call passes ``attn_bias`` through ``_checked_bias``, which refuses a
  mask where a cuDNN release is known to compute NaN gradients with one (``masked_call_problem``).

``ops`` is ``torch.ops.aten``; tests pass a CPU emulation of the two ops' documented behaviour
(``tests/aten_cudnn_emulation.py``) to run this class's Python without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from titan_upipe.attention.backend_base import HALF_DTYPES, LocalAttentionBackend
from titan_upipe.attention.flash_backends import FA4_HEAD_DIMS
from titan_upipe.errors import ConfigError

Tensor = torch.Tensor

MIN_CUDNN_VERSION = 9_15_01
"""cuDNN 9.15.1. torch builds its cuDNN attention only against cuDNN 9+, and its own dispatch
prefers it only from 9.15.1 on, the release that fixed query lengths not a multiple of 128
(``check_prefer_cudnn_attention`` in torch's ``aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp``, pytorch#169849); the local blocks of a context-parallel split often are such."""

CAPABILITY_RANGE = ((8, 0), (12, 1))
"""Compute capabilities torch runs cuDNN attention on (``check_cudnn_hardware_support`` in
``sdp_utils.cpp``: sm80 to sm121; the cuDNN frontend's SDPA support matrix: SM80 or newer)."""

HEAD_DIM_MULTIPLE, MAX_HEAD_DIM = 8, 128
"""Heads the backward runs on every supported GPU: torch's ``check_cudnn_tensor_shapes`` wants a
multiple of 8 and at most 128 (256 only on sm90/sm100 with cuDNN newer than 9.22 and a recent
frontend, whose backward then runs 128, 192/128 and 256 only: ``check_cudnn_d256_bprop_head_dim``);
the cuDNN frontend's support matrix (9.18.1) lists Ampere/Ada backward at d <= 128."""

MASKED_NAN_FIXED_VERSION = 9_26_00
"""cuDNN 9.26.0 fixes pytorch#196678: on sm90 with an explicit mask and a key length % 128 == 64,
the padded half of the last 128-key tile is scored 0 instead of -inf and dQ comes out NaN for a
query row whose logsumexp is below ln(FLT_MAX) ~ -88.7."""


def cudnn_version_text(version: int) -> str:
    """``91900 -> "9.19.0"`` (cuDNN 9's ``major * 10000 + minor * 100 + patch``)."""
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def masked_call_problem(capability: tuple[int, int], cudnn_version: int, s_kv: int) -> str | None:
    """None when a call with an explicit attention mask (``attn_bias``) is safe on a GPU of
    ``capability`` with cuDNN ``cudnn_version`` for ``s_kv`` keys, else why not (pytorch#196678)."""
    if capability[0] == 9 and cudnn_version < MASKED_NAN_FIXED_VERSION and s_kv % 128 == 64:
        return (f"cudnn with an attention mask on compute capability {capability[0]}.{capability[1]} and cuDNN "
                f"{cudnn_version_text(cudnn_version)} computes NaN dQ for a key length % 128 == 64 (here {s_kv}; "
                f"pytorch#196678, fixed in cuDNN {cudnn_version_text(MASKED_NAN_FIXED_VERSION)}): use a torch "
                "with cuDNN >= 9.26 or attention_backend 'flash_attn4' or 'sdpa'")
    return None


def cuda_device_facts(device: torch.device) -> tuple[tuple[int, int], int]:
    """The compute capability of ``device`` and the cuDNN version torch loaded."""
    return torch.cuda.get_device_capability(device), torch.backends.cudnn.version() or 0


class CudnnBackend(LocalAttentionBackend):
    """cuDNN attention, causal or full, native GQA, backward from the given out/lse."""

    name = "cudnn"
    dtypes = HALF_DTYPES

    def __init__(self, ops: Any = None,
                 device_facts: Callable[[torch.device], tuple[tuple[int, int], int]] = cuda_device_facts) -> None:
        self.ops = torch.ops.aten if ops is None else ops
        self.device_facts = device_facts
        self._rng: dict[tuple[str, torch.dtype, int], tuple[Tensor, Tensor]] = {}

    @classmethod
    def unavailable_reason(cls, probe: bool = True) -> str | None:
        # Without probing only torch's build flag is read (no library load, no CUDA query);
        # the cuDNN version and the GPU are probed at conversion.
        if probe and not torch.cuda.is_available():
            return f"{cls.name} needs a CUDA device"
        if not torch.backends.cudnn.is_available():
            return (f"{cls.name} needs a torch built with cuDNN (torch {torch.__version__} has none): install a "
                    "CUDA build of torch or use attention_backend 'sdpa'")
        if not probe:
            return None
        version = torch.backends.cudnn.version() or 0
        if version < MIN_CUDNN_VERSION:
            return (f"{cls.name} needs cuDNN >= {cudnn_version_text(MIN_CUDNN_VERSION)} (the release that fixed query "
                    f"lengths not a multiple of 128, pytorch#169849), torch loaded cuDNN "
                    f"{cudnn_version_text(version) if version else 'none'}: install a torch built with a newer "
                    "cuDNN or use attention_backend 'flash_attn4' or 'sdpa'")
        capability = torch.cuda.get_device_capability()
        low, high = CAPABILITY_RANGE
        if not low <= capability <= high:
            return (f"{cls.name} supports compute capability {low[0]}.{low[1]} to {high[0]}.{high[1]} (torch's cuDNN "
                    f"attention), this GPU is {capability[0]}.{capability[1]}: use attention_backend 'sdpa'")
        return None

    @classmethod
    def head_dim_problem(cls, head_dim: int | None) -> str | None:
        if head_dim is None or (head_dim % HEAD_DIM_MULTIPLE == 0 and head_dim <= MAX_HEAD_DIM):
            return None
        others = ["flash_attn4"] if head_dim in FA4_HEAD_DIMS else []
        return (f"{cls.name} runs head_dim a multiple of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM} (cuDNN's attention "
                f"backward through torch), not {head_dim}: use attention_backend "
                + " or ".join(repr(b) for b in [*others, "sdpa"]))

    @staticmethod
    def _unit_last_stride(t: Tensor) -> Tensor:
        # The kernels take any layout whose last dim is dense (torch's own dispatch requires it).
        return t if t.stride(-1) == 1 else t.contiguous()

    def forward(self, q, k, v, scale, causal=True):
        self.check_inputs(q)
        q, k, v = (self._unit_last_stride(t) for t in (q, k, v))
        res = self._kernel_forward(q, k, v, scale, causal)
        return res[0], res[1][..., 0]

    def backward(self, dout, q, k, v, out, lse, scale, causal=True):
        q, k, v = (self._unit_last_stride(t) for t in (q, k, v))
        seed, offset = self._rng_placeholders(q)
        # Same strides for out and dout (pytorch#176915): the merged out of ring attention and
        # autograd's dout are laid out independently.
        return self._kernel_backward(dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous().unsqueeze(-1),
                                     seed, offset, scale, causal)

    # --- the only two places that call the kernels ----------------------------------------

    def _kernel_forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool,
                        attn_bias: Tensor | None = None) -> tuple:
        return self.ops._scaled_dot_product_cudnn_attention(
            q, k, v, self._checked_bias(attn_bias, k), True, 0.0, causal, False, scale=scale)

    def _kernel_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         seed: Tensor, offset: Tensor, scale: float, causal: bool,
                         attn_bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = self.ops._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, self._checked_bias(attn_bias, k), None, None,
            int(q.shape[2]), int(k.shape[2]), 0.0, causal, scale=scale)
        return dq, dk, dv

    def _checked_bias(self, attn_bias: Tensor | None, k: Tensor) -> Tensor | None:
        """``attn_bias`` for a kernel call: a mask is refused where the GPU and cuDNN release
        compute NaN gradients with one (``masked_call_problem``). This backend passes none."""
        if attn_bias is not None:
            capability, version = self.device_facts(k.device)
            problem = masked_call_problem(capability, version, k.shape[2])
            if problem is not None:
                raise ConfigError(problem)
        return attn_bias

    def _rng_placeholders(self, q: Tensor) -> tuple[Tensor, Tensor]:
        """The philox seed and offset a dense, dropout-free forward of this torch returns
        (unused by the kernels without dropout, but read: sm100 converts them to int64)."""
        key = (str(q.device), q.dtype, q.shape[-1])
        if key not in self._rng:
            tiny = torch.zeros(1, 1, 8, q.shape[-1], dtype=q.dtype, device=q.device)
            res = self._kernel_forward(tiny, tiny, tiny, 1.0, True)
            self._rng[key] = (res[6], res[7])
        return self._rng[key]
