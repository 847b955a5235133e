"""Where the GPU suite's compiled kernels persist between the calls of one machine.

A GPU machine lent for minutes keeps ``/tmp`` from one call to the next while it stays warm, and
every process of a call (each queue item and each emulator run is one) compiles its kernels again
unless a compiler finds them on disk. Each compiler has its own cache and its own switch:

================= ======================================================================================
compiler          its cache (read from source, flash-attn-4 4.0.0b36, nvidia-cutlass-dsl 4.8.1, torch 2.11)
================= ======================================================================================
FlashAttention-4  in memory only by default: ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` makes
                  ``flash_attn/cute/cache_utils.py`` export each kernel it compiles (``cute.compile``
                  with TVM-FFI, an object file per compile key) under ``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``
                  (default ``/tmp/$USER/flash_attention_cute_dsl_cache``) and load it in the next process;
                  entries sit under a fingerprint of FA4's sources, the Python minor version and the
                  cutlass and tvm_ffi versions (a new wheel starts afresh), behind file locks (processes
                  at once are safe); an entry that does not load is compiled again and replaced. Both
                  variables are read when ``flash_attn.cute`` is imported: they must be in the process's
                  environment from its start
CuTe DSL          ``CUTE_DSL_CACHE_DIR`` (default ``$TMPDIR/$USER/cutlass_python_cache``): the DSL's
                  own file cache of ``@cute.jit`` functions and its parse facts. ``cute.compile``
                  (FA4's path) compiles with ``compile_only``, which bypasses it: here for the
                  DSL's parse cache and one place for everything
Triton            ``TRITON_CACHE_DIR`` (default ``~/.triton/cache``): Liger's fused CE and norms
torch inductor    ``TORCHINDUCTOR_CACHE_DIR`` (default ``/tmp/torchinductor_$USER``): the compiled
                  norms and feed-forwards (``compile.enable``) and their FX graph cache
================= ======================================================================================

``compile_cache_env`` puts every one under ``COMPILE_CACHE_ROOT`` in ``/tmp`` (a variable already set
is left as it is); ``scripts/gpu_suite.sh`` exports them (``python3 titan_upipe/tools/compile_caches.py``
prints the ``export`` lines: no package import, it runs before the wheels are installed) and the
suite's child processes get them (``gpu_runs.child_env``).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping

COMPILE_CACHE_ROOT = "/tmp/titan_upipe_compile_cache"
CACHE_DIRS = {
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "flash_attn_cute",
    "CUTE_DSL_CACHE_DIR": "cute_dsl",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
}
"""Each compiler's cache variable and its folder under ``COMPILE_CACHE_ROOT``."""
SWITCHES = {"FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1"}
"""FlashAttention-4 keeps kernels in memory only unless this is set."""


def compile_cache_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The compile-cache variables a suite process runs with: those of ``CACHE_DIRS`` and
    ``SWITCHES`` that ``environ`` (default ``os.environ``) does not already set."""
    environ = os.environ if environ is None else environ
    wanted = {**{name: f"{COMPILE_CACHE_ROOT}/{folder}" for name, folder in CACHE_DIRS.items()}, **SWITCHES}
    return {name: value for name, value in wanted.items() if name not in environ}


def export_lines(environ: Mapping[str, str] | None = None) -> list[str]:
    """``export NAME=value`` for each variable of ``compile_cache_env`` (for ``eval`` in a shell)."""
    return [f"export {name}={shlex.quote(value)}" for name, value in compile_cache_env(environ).items()]


if __name__ == "__main__":
    print("\n".join(export_lines()))
    sys.exit(0)
