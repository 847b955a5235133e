"""The valid values of the job settings the planner and the runtime both read, as plain names.

The runtime classes behind them (``attention.backends.BACKENDS``, ``parallel.BatchDocumentLayout``,
``attention.keep``) sit above torch; the names live here so that the planner and the command
lines' ``--help`` read them without loading it (``tests/test_job_spec.py`` checks the names agree).
"""

from __future__ import annotations

ATTENTION_BACKEND_NAMES = ("sdpa", "math", "cudnn", "flash_attn", "flash_attn3", "flash_attn4")
"""``[upipe] attention_backend`` besides ``auto``: the local kernels (``attention.backends.BACKENDS``)."""

CE_BACKEND_NAMES = ("auto", "torch", "liger")
"""``[transforms] ce_backend``: the fused cross-entropy kernels (``transforms.fused_ce``)."""

DOCUMENT_BALANCES = ("zigzag", "documents")
"""``[upipe] document_balance``: the fixed zigzag (``ZigzagLayout``) or each batch's own layout
(``parallel.BatchDocumentLayout``)."""

DEFAULT_MIN_SPLIT = 16384
"""Documents of at least this many tokens are zigzagged inside themselves; shorter ones are dealt
whole unless the balance needs them split (``docs/benchmarks/document_balance.md`` measured the
balance with this value)."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the training and export dtypes, by torch's names."""
DTYPES = tuple(DTYPE_BYTES)
"""The training dtypes (``training.mixed_precision_param`` / ``_reduce``)."""

KEEP_ATTENTION = ("off", "device", "host", "auto")
"""``[activation_checkpoint] keep_attention``: where blocks keep their attention output (``auto``:
on the device as many as fit, then on the host)."""
