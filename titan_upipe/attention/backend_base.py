"""The local attention kernels' base class, ``LocalAttentionBackend``, and the GQA helpers.

The contract every backend honours (dense ``forward``/``backward`` and packed ``varlen_*`` calls,
the merged out/lse backward) is written down in ``titan_upipe.attention.backends``, which also
holds the backends and the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

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
    varlen: ClassVar[bool] = False
    """True when ``varlen_forward``/``varlen_backward`` run many packed sequences in one kernel call
    (flash-attn's ``cu_seqlens`` entry points); packed documents on CUDA need it."""

    @classmethod
    def unavailable_reason(cls, probe: bool = True) -> str | None:
        """None when usable here, else why not. ``probe=False`` imports nothing and asks CUDA
        nothing (the check before process groups start, which may run on a machine without a
        GPU); conversion probes fully."""
        return None

    @classmethod
    def head_dim_problem(cls, head_dim: int | None) -> str | None:
        """None when the kernel runs heads of ``head_dim`` (or it is not known yet), else why not
        (checked at conversion and before process groups, never first at a kernel call)."""
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

    def varlen_forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, cu_seqlens: Tensor,
                       max_seqlen: int) -> tuple[Tensor, Tensor]:
        """Causal attention inside each of ``N`` sequences packed end to end, one kernel call.

        Sequence ``n`` is tokens ``[c_n, c_{n+1})`` with ``c = cu_seqlens`` (int32 ``[N + 1]`` on
        q's device, ``c_0 = 0``, ``c_N = T``, ``max_seqlen = max_n c_{n+1} - c_n``); token ``i``
        of it sees tokens ``[c_n, i]``. Packed layout (flash-attn's): ``q [T, Hq, D]``, ``k``/``v``
        ``[T, Hkv, D]`` with the last dim contiguous. Returns ``out [T, Hq, D]`` (q's dtype) and
        ``lse`` fp32 ``[Hq, T]``, whatever layout the kernel itself uses."""
        raise ConfigError(f"attention backend {self.name!r} has no varlen (cu_seqlens) kernel")

    def varlen_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        scale: float, cu_seqlens: Tensor, max_seqlen: int) -> tuple[Tensor, Tensor, Tensor]:
        """``dq [T, Hq, D], dk, dv [T, Hkv, D]`` of ``varlen_forward`` given the *merged*
        ``out [T, Hq, D]`` / ``lse [Hq, T]`` (the module docstring's contract, per sequence)."""
        raise ConfigError(f"attention backend {self.name!r} has no varlen (cu_seqlens) kernel")


def expand_kv(t: Tensor, n_rep: int) -> Tensor:
    """``[B, Hkv, S, D] -> [B, Hkv * n_rep, S, D]``, KV head ``h`` serving query heads ``h*n_rep ...``."""
    return t if n_rep == 1 else t.repeat_interleave(n_rep, dim=1)


def fold_kv_grad(grad: Tensor, n_rep: int) -> Tensor:
    """The inverse of ``expand_kv`` for gradients: sum each KV head's ``n_rep`` copies (fp32)."""
    if n_rep == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // n_rep, n_rep, s, d).sum(dim=2, dtype=torch.float32).to(grad.dtype)
