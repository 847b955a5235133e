"""Units of the planner: bytes (``GIB``) and sequence lengths as the configs write them
(``K`` = 1024 tokens, ``M`` = 1024² tokens: ``5M`` = 5242880)."""

from __future__ import annotations

GIB = 2**30
K = 1024


def parse_length(text: str) -> int:
    """``131072``, ``128K`` (x1024), ``5M`` (x1024^2), ``1.5M``."""
    t = str(text).strip().upper()
    scale = 1
    if t.endswith("K"):
        scale, t = K, t[:-1]
    elif t.endswith("M"):
        scale, t = K * K, t[:-1]
    value = float(t) * scale
    if value != int(value) or value <= 0:
        raise ValueError(f"invalid length {text!r}")
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
