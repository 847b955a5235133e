"""Fused RoPE: rotary tables for the positions a rank holds, never for the whole context.

TorchTitan keeps one model buffer with a row per position up to ``max_seq_len`` (Llama3:
complex64 ``[S, D/2]``, 4·D bytes per token; Qwen3: fp32 ``cos‖sin`` ``[S, 2D]``, 8·D bytes
per token): 0.5 GiB / 1 GiB per rank at 1M tokens, whatever the context parallelism. With
the ``fused_rope`` converter the buffer holds only the ``D/2`` fp32 inverse frequencies
(:func:`inverse_frequencies`, Llama-3.1 scaling included) and every forward builds the rows of
the positions present in the batch (:func:`table_for_positions`), in the model's own table
format so TorchTitan's attention and the context-parallel attention read them unchanged.
The angles are the same fp32 products ``position * inv_freq`` TorchTitan's tables hold.
"""

from __future__ import annotations

import math

import torch

from titan_upipe.attention.projection import RotaryKind

Tensor = torch.Tensor


def inverse_frequencies(kind: RotaryKind, head_dim: int, theta: float, scaling=None) -> Tensor:
    """fp32 ``[head_dim/2]`` rotation frequencies; Llama3's (3.1) long-context scaling when
    ``scaling`` (a ``RoPEScalingArgs``) is given, as TorchTitan's Llama3 always applies it."""
    exponents = torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim
    freqs = 1.0 / (theta**exponents)
    if kind is RotaryKind.COS_SIN or scaling is None:
        return freqs
    # Llama 3.1: wavelengths longer than the original context / low_freq_factor are divided
    # by the scaling factor, shorter than context / high_freq_factor kept, the band between
    # interpolated linearly in (context / wavelength).
    factor, low, high = scaling.scaling_factor, scaling.low_freq_factor, scaling.high_freq_factor
    context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / freqs
    freqs = torch.where(wavelen > context / low, freqs / factor, freqs)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * freqs / factor + smooth * freqs
    in_band = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(in_band, smoothed, freqs)


def table_for_positions(inv_freq: Tensor, kind: RotaryKind, positions: Tensor) -> Tensor:
    """The model-format RoPE rows of ``positions`` (1-D): complex64 ``[N, D/2]`` (Llama3) or
    fp32 ``cos‖sin`` ``[N, 2D]`` (Qwen3)."""
    angles = positions.to(device=inv_freq.device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    if kind is RotaryKind.COMPLEX:
        return torch.polar(torch.ones_like(angles), angles)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def local_rope_inputs(inv_freq: Tensor, kind: RotaryKind, tokens: Tensor,
                      positions: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """(table, positions) to hand to the blocks in place of (full table, positions).

    ``positions`` ``None`` (no CP): rows ``0..L-1``, positions stay ``None``. ``[1, L]`` or
    ``[L]``: the rows of those positions, re-indexed ``0..L-1``. ``[B, L]``: one row per token,
    re-indexed ``0..B·L-1``. Re-indexing keeps every consumer's ``table[positions]`` lookup.
    """
    seq_len = tokens.shape[-1]
    if positions is None:
        return table_for_positions(inv_freq, kind, torch.arange(seq_len, device=inv_freq.device)), None
    positions = positions.reshape(-1, seq_len)
    table = table_for_positions(inv_freq, kind, positions.reshape(-1))
    local = torch.arange(positions.numel(), device=positions.device).view(positions.shape)
    return table, local
