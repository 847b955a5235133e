"""Kernels this process has compiled at first use, counted where the compiler keeps a count.

A JIT-compiled kernel compiles on the first call of each compile key (dtype, head dim, GQA
ratio, causal, ...): a timed step during which one compiles times the compiler, not the step.
``compiled_kernels()`` samples every counter, ``compiles_between(before, after)`` is the
number compiled in between (None where a counter could not be read).

Counted (nothing is imported here: a package not imported yet has compiled nothing, 0):

``torch.compile``
    dynamo's ``unique_graphs`` counter: every graph it compiled, recompilations included
    (inductor's Triton kernels are compiled inside those graphs).
``flash_attn4``
    the entries of FlashAttention-4's in-process JIT caches: the ``compile_cache`` of each
    function of ``flash_attn.cute.interface`` (a ``JITCache``, one compiled kernel per compile
    key in its ``cache`` dict; a kernel loaded from the on-disk cache is new to the process and
    counts too). None where the module is imported but holds no such cache (another release).

Not counted, named by ``uncounted_compilers()`` where loaded: Liger's Triton kernels (the fused
cross-entropy), launched outside ``torch.compile``, whose caches live inside each kernel object.
``COMPILE_COUNTERS`` takes further counters (a backend of one's own, or a test's).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping

FA4_MODULE = "flash_attn.cute.interface"


def dynamo_graphs() -> int:
    """Graphs ``torch.compile`` compiled in this process (0 before dynamo is imported)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    if dynamo_utils is None:
        return 0
    return int(dynamo_utils.counters["stats"]["unique_graphs"])


def flash_attn4_kernels() -> int | None:
    """Kernels in FlashAttention-4's JIT caches (0 before it is imported; None when imported but
    its caches are not where 4.0.0b36 keeps them)."""
    module = sys.modules.get(FA4_MODULE)
    if module is None:
        return 0
    caches = [value.compile_cache for value in vars(module).values()
              if callable(value) and hasattr(value, "compile_cache")]
    entries = [getattr(cache, "cache", cache) for cache in caches]
    if not entries or not all(isinstance(e, Mapping) for e in entries):
        return None
    return sum(len(e) for e in entries)


COMPILE_COUNTERS: dict[str, Callable[[], int | None]] = {
    "torch.compile": dynamo_graphs,
    "flash_attn4": flash_attn4_kernels,
}
"""Counter name -> kernels compiled so far by this process (None: not readable)."""


def compiled_kernels() -> dict[str, int | None]:
    """One sample of every counter of ``COMPILE_COUNTERS``."""
    return {name: count() for name, count in COMPILE_COUNTERS.items()}


def compiles_between(before: Mapping[str, int | None], after: Mapping[str, int | None]) -> int | None:
    """Kernels compiled between two samples, summed over the counters; None when a counter was
    unreadable in either (a counter added in between counts from 0)."""
    total = 0
    for name, now in after.items():
        then = before.get(name, 0)
        if now is None or then is None:
            return None
        total += now - then
    return total


def uncounted_compilers() -> list[str]:
    """The loaded compilers whose kernels ``compiled_kernels`` does not count."""
    return ["Liger's Triton kernels"] if "liger_kernel" in sys.modules else []
