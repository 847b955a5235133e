"""Units of the planner: bytes (``GIB``) and sequence lengths as the configs write them
(``K`` = 1024 tokens, ``M`` = 1024² tokens: ``5M`` = 5242880; parsed by the command lines' one
length parser, ``parse_length``). Pure arithmetic: the planner and the command lines share it."""

from __future__ import annotations

import math

__all__ = ["GIB", "K", "LENGTH_FORMAT", "format_bytes", "format_length", "parse_length", "pow2_ceil"]

GIB = 2**30

K = 1024
"""Tokens per ``K`` in a length (``M`` = K x K)."""
LENGTH_FORMAT = "a token count like 4096, 128K, 1M or 2.5M (K = 1024 tokens, M = 1024^2)"
"""What :func:`parse_length` accepts, in words (its error message)."""


def parse_length(text: str) -> int:
    """``131072``, ``128K`` (x1024), ``5M`` (x1024^2), ``1.5M``: the one parser of a sequence length
    written on a command line or in the planner's tables (the planner, ``check``, ``emulate``, the
    GPU suite); a ValueError saying what it accepts for anything else (``5X``, ``0``, ``-1K``, ``0.3K``)."""
    t = str(text).strip().upper()
    scale = {"K": K, "M": K * K}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise ValueError(f"{text}: expected {LENGTH_FORMAT}")
    return int(value)


def format_length(n: int) -> str:
    """The shortest of ``5M``, ``1.25M``, ``128K``, ``2.37M`` or the plain count that names ``n``."""
    if n >= K * K and n % (K * K // 4) == 0:
        return f"{n / (K * K):g}M"
    if n >= K and n % K == 0 and n < K * K:
        return f"{n // K}K"
    if n >= K * K:
        return f"{n / (K * K):.2f}M"
    return str(n)


def format_bytes(n: float) -> str:
    """GiB from a tenth of a GiB up, MiB below (term labels)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.2f} MiB"


def pow2_ceil(n: int) -> int:
    """The smallest power of two >= n (PyTorch's pinned host allocator, Liger's chunk size)."""
    return 1 << (n - 1).bit_length() if n > 1 else n
