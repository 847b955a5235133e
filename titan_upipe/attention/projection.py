"""Per-head projection, qk-norm and RoPE for any contiguous run of heads, and its backward.

The math is the unconverted TorchTitan modules', op for op: ``F.linear`` on a row slice
of ``wq``/``wk``/``wv`` (rows ``h*D:(h+1)*D`` are head ``h``), ``F.rms_norm`` per head as
``nn.RMSNorm`` does (Qwen3 applies it before RoPE), and RoPE (:func:`rotate`) in the dtypes and
op order TorchTitan 0.2.2's Llama3 and Qwen3 use, so Q/K are bit for bit theirs
(tests/test_model_protocol.py compares them):

* ``COMPLEX`` (Llama3): ``freqs_cis`` complex64 ``[max_seq, D/2]`` of ``e^{i·p·θ_j}``; the pairs
  ``(x_2j, x_2j+1)`` of x, in fp32, are the complex ``z_j``, rotated as ``z_j · e^{i·p·θ_j}``.
* ``COS_SIN`` (Qwen3): ``rope_cache`` fp32 ``[max_seq, 2D]`` = cos || sin of the angles of both
  halves; with the halves ``(a, b)`` of x, ``x·cos + (-b, a)·sin`` in x's dtype, cos and sin
  rounded to it first.

With ``in_place_rope`` (set by the ``fused_rope`` transform) and no gradient recorded (UPipe's
forward and recompute run inside an autograd Function; Ulysses under activation
checkpointing), RoPE is applied in place (:func:`rotate_`): one head at a time in fp32,
written back in x's dtype, so no fp32 copy of the projected heads exists (paper section 2.3,
"fused RoPE"). Without it the attention keeps TorchTitan's RoPE op order exactly, bf16
rounding included. The table may be the model's full table or only the rows of this rank's
positions (the ``fused_rope`` converter); ``positions`` index it either way.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


class RotaryKind(enum.Enum):
    COMPLEX = "llama3"  # complex freqs_cis, interleaved pairs
    COS_SIN = "qwen3"  # real cos||sin cache, rotate_half


def table_rows(table: Tensor, positions: Tensor) -> Tensor:
    """The rows of ``table`` ``[max_seq, W]`` at ``positions`` ``[P, L]`` (P = 1 or B), as
    ``[P, L, 1, W]``: one row per token, broadcast over the heads of ``[B, L, h, ·]``.

    A gather, contiguous, so the products in :func:`rotate` run on operands of the shape and
    strides TorchTitan's RoPE gives them (the same elementwise kernels, the same bits)."""
    return table[positions].unsqueeze(2)


def rotate_half(x: Tensor) -> Tensor:
    """``(a, b) -> (-b, a)`` for the halves ``a``, ``b`` of the last dim: the product by ``i`` of
    the complex numbers ``a_j + i·b_j``, so ``x·cos + rotate_half(x)·sin`` rotates each pair
    ``(a_j, b_j)`` by its angle. The halves are sliced in order, first then second: autograd
    sums their gradients into x's as it does TorchTitan's."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat((-second, first), dim=-1)


def rotate(x: Tensor, table: Tensor, positions: Tensor, kind: RotaryKind) -> Tensor:
    """RoPE of ``x`` ``[B, L, h, D]`` at ``positions`` ``[1 or B, L]`` (global token positions).

    ``COMPLEX``: ``z_j · e^{i·p·θ_j}`` in complex64 (the complex product's kernel, whose fp32 real
    and imaginary parts ``ac - bd``, ``ad + bc`` :func:`rotate_` reproduces), rounded once to x's
    dtype. ``COS_SIN``: ``x·cos + rotate_half(x)·sin``, every product and the sum in x's dtype, in
    that order (``x·cos`` first)."""
    rows = table_rows(table, positions)
    if kind is RotaryKind.COMPLEX:
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [B, L, h, D/2]
        return torch.view_as_real(pairs * rows).flatten(3).type_as(x)
    head_dim = x.shape[-1]
    cos = rows[..., :head_dim].to(dtype=x.dtype, device=x.device)
    sin = rows[..., head_dim:].to(dtype=x.dtype, device=x.device)
    del rows  # the gathered fp32 rows (twice cos and sin in bf16): not live through the products
    return (x * cos + rotate_half(x) * sin).type_as(x)


def _table_rows(table: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(cos, sin) ``[P, L, D/2]`` of ``positions`` ``[P, L]`` (P = 1 or B): fp32 from the complex
    table; from the real ``cos||sin`` one rounded to ``dtype`` (x's), as :func:`rotate` and
    TorchTitan's Qwen3 RoPE round them (the table itself stays fp32: FSDP does not cast it)."""
    if table.is_complex():
        rows = table[positions]
        return rows.real, rows.imag
    quarter = table.shape[-1] // 4  # cos(D) || sin(D), each half of D repeated
    return (table[:, :quarter][positions].to(dtype),
            table[:, 2 * quarter : 3 * quarter][positions].to(dtype))


ROTATE_CHUNKS = 8
"""Token chunks per head in :func:`rotate_`: fp32 temporaries are 2.5/8 of one head."""


def rotate_(x: Tensor, table: Tensor, positions: Tensor, kind: RotaryKind) -> Tensor:
    """In-place RoPE of ``x`` ``[B, L, h, D]``, one head at a time, bit for bit :func:`rotate`
    (TorchTitan's formulas) in every dtype.

    The same products and sums as TorchTitan's complex multiply (Llama3) and ``rotate_half``
    (Qwen3) formulas, each product rounded on its own (no fused multiply-add), in the dtype
    TorchTitan computes them in: fp32 for Llama3's complex multiply (rounded once to x's dtype),
    x's dtype for Qwen3 (every product and sum rounded to it, from cos/sin rounded to it). So a
    no-grad forward (this function) and its recomputation under autograd (:func:`rotate`) see the
    same Q/K, which a block keeping its attention (``attention.keep``) relies on. Temporaries:
    2.5/ROTATE_CHUNKS of one head in fp32 (Llama3) or x's dtype (Qwen3).
    """
    cos, sin = _table_rows(table, positions, x.dtype)
    math_dtype = torch.float32 if kind is RotaryKind.COMPLEX else x.dtype  # as rotate computes
    if kind is RotaryKind.COMPLEX:  # interleaved (re, im) pairs
        pairs = x.unflatten(-1, (-1, 2))
        first, second = pairs[..., 0], pairs[..., 1]
    else:  # halves
        half = x.shape[-1] // 2
        first, second = x[..., :half], x[..., half:]
    seq = x.shape[1]
    chunk = -(-seq // ROTATE_CHUNKS)
    for head in range(x.shape[2]):
        for start in range(0, seq, chunk):
            tokens = slice(start, start + chunk)
            c, s = cos[:, tokens], sin[:, tokens]
            # Copies (never aliases, even in fp32) so x can be overwritten in place.
            a = first[:, tokens, head].to(math_dtype, copy=True)
            b = second[:, tokens, head].to(math_dtype, copy=True)
            # Separate products, not addcmul_: its fused multiply-add rounds differently
            # from the reference formulas.
            first[:, tokens, head].copy_(a * c - b * s)
            second[:, tokens, head].copy_(b * c + a * s)
            del a, b
    return x


@dataclass
class HeadProjection:
    """Turns a rank's tokens ``x`` ``[B, L, dim]`` into ready-to-attend heads, any run at a time."""

    head_dim: int
    rotary: RotaryKind
    rope_table: Tensor
    positions: Tensor
    """``[1, L]`` or ``[B, L]`` int64: global positions of this rank's tokens."""
    norm_eps: float | None = None
    in_place_rope: bool = False
    """Rotate in place (:func:`rotate_`) where no gradient is recorded: the ``fused_rope`` transform."""

    def rows(self, weight: Tensor, heads: tuple[int, ...]) -> Tensor:
        """The rows of ``weight`` (``wq``/``wk``/``wv``) that project ``heads`` (a contiguous run)."""
        return weight[heads[0] * self.head_dim : (heads[-1] + 1) * self.head_dim]

    def _transform(self, p: Tensor, norm_weight: Tensor | None, use_rope: bool, use_norm: bool) -> Tensor:
        if use_norm:
            p = F.rms_norm(p, (self.head_dim,), norm_weight, self.norm_eps)
        if use_rope:
            if self.in_place_rope and not (torch.is_grad_enabled() and p.requires_grad):
                p = rotate_(p, self.rope_table, self.positions, self.rotary)
            else:  # autograd, or no fused_rope: TorchTitan's op order
                p = rotate(p, self.rope_table, self.positions, self.rotary)
        return p

    def project(
        self, x: Tensor, weight: Tensor, heads: tuple[int, ...], norm_weight: Tensor | None = None,
        use_rope: bool = True, use_norm: bool = False,
    ) -> Tensor:
        """Heads ``heads`` (a contiguous run) of ``x @ weight.T``, normed and rotated: ``[B, L, h, D]``."""
        b, seq = x.shape[:2]
        p = F.linear(x, self.rows(weight, heads)).view(b, seq, len(heads), self.head_dim)
        return self._transform(p, norm_weight, use_rope, use_norm)

    def backprop(
        self, x: Tensor, weight: Tensor, heads: tuple[int, ...], grad_heads: Tensor, *,
        grad_projection: Tensor | None, grad_weight: Tensor | None, norm_weight: Tensor | None = None,
        grad_norm_weight: Tensor | None = None, use_rope: bool = True, use_norm: bool = False,
    ) -> None:
        """Backpropagate ``grad_heads`` ``[B, L, h, D]`` through ``project``'s RoPE and norm.

        Norm and RoPE are recomputed from a fresh projection and differentiated by autograd on
        this small local graph. The weight gradient is one matmul into the full-size fp32
        accumulator ``grad_weight`` (rows of these heads only); the gradient of the projection
        itself (``x @ rows.T``) is written into ``grad_projection`` ``[B, L, h, D]``: the caller
        multiplies the projections of every head by their weights in one GEMM (see
        ``upipe.ProjectionGrads.input_grad``), which sums them in fp32.
        """
        b, seq, dim = x.shape
        rows = self.rows(weight, heads)
        width = rows.shape[0]
        if use_rope or use_norm:
            with torch.no_grad():
                p = F.linear(x, rows).view(b, seq, len(heads), self.head_dim)
            with torch.enable_grad():
                p = p.detach().requires_grad_(True)
                leaves = [p]
                w_norm = None
                if use_norm:
                    w_norm = norm_weight.detach().requires_grad_(grad_norm_weight is not None)
                    if grad_norm_weight is not None:
                        leaves.append(w_norm)
                out = self._transform(p, w_norm, use_rope, use_norm)
                grads = torch.autograd.grad(out, leaves, grad_heads)
            grad_p = grads[0]
            if grad_norm_weight is not None:
                grad_norm_weight.add_(grads[1])
            del grads, out, p
        else:
            grad_p = grad_heads
        if grad_weight is not None:
            start = heads[0] * self.head_dim
            accumulate_matmul(grad_weight[start : start + width], grad_p.reshape(b * seq, width).t(),
                              x.reshape(b * seq, dim))
        if grad_projection is not None:
            grad_projection.copy_(grad_p)


def accumulate_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32: in place when the operands are fp32 too, else the
    low-precision product (fp32-accumulated by the GEMM) is summed into fp32."""
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(torch.mm(a, b))
