"""Units of the planner: bytes (``GIB``) and sequence lengths as the configs write them
(``K`` = 1024 tokens, ``M`` = 1024² tokens: ``5M`` = 5242880; parsed by the command lines' one
length parser, ``tools.cli_args.parse_length``)."""

from __future__ import annotations

from titan_upipe.tools.cli_args import LENGTH_FORMAT, K, parse_length

__all__ = ["GIB", "K", "LENGTH_FORMAT", "format_bytes", "format_length", "parse_length", "pow2_ceil"]

GIB = 2**30


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
