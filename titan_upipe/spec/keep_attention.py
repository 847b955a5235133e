"""Which blocks keep their attention output from forward to backward, and what that costs.

A kept block holds, per rank, ``T x H x (D x a + 4)`` bytes: the attention output before ``wo``
(``T`` tokens of this rank, ``H`` query heads, ``D`` head dim, ``a`` bytes per activation) and the
fp32 log-sum-exp of every query head and token. The runtime that records and replays it is
``titan_upipe.attention.keep``; the planner sizes the plan from these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titan_upipe.errors import ConfigError
from titan_upipe.spec.settings import KEEP_ATTENTION

Placement = Literal["device", "host"]
"""Where a block's kept attention waits for its backward."""


@dataclass(frozen=True)
class KeepAttentionPlan:
    """Which blocks keep their attention, and where: the last ``device_blocks`` blocks on the device
    (their backward comes first, so they give the memory back first), the ``host_blocks`` below
    them in host memory, the rest recompute it. Every rank of a job holds the same plan."""

    device_blocks: int = 0
    host_blocks: int = 0

    def __post_init__(self) -> None:
        if self.device_blocks < 0 or self.host_blocks < 0:
            raise ValueError(f"block counts must be >= 0, got {self.device_blocks} and {self.host_blocks}")

    @property
    def blocks(self) -> int:
        return self.device_blocks + self.host_blocks

    def placement(self, index: int, n_blocks: int) -> Placement | None:
        """Where block ``index`` of ``n_blocks`` keeps its attention (None: it does not)."""
        from_top = n_blocks - 1 - index
        if from_top < self.device_blocks:
            return "device"
        if from_top < self.blocks:
            return "host"
        return None

    def describe(self, n_blocks: int) -> str:
        """``"32 of 32 blocks keep their attention on the device"`` and the like."""
        if not self.blocks:
            return f"no block of {n_blocks} keeps its attention (every block recomputes it)"
        parts = [f"{n} on the {where}" for n, where in ((self.device_blocks, "device"), (self.host_blocks, "host")) if n]
        return f"{min(self.blocks, n_blocks)} of {n_blocks} blocks keep their attention ({', '.join(parts)})"


NO_KEEP = KeepAttentionPlan()
"""Every block recomputes its attention (full activation checkpointing as before)."""


def kept_attention_bytes(tokens: int, n_heads: int, head_dim: int, activation_bytes: int) -> int:
    """``T H (D a + 4)``: the bytes one block keeps on one rank (module docstring)."""
    return tokens * n_heads * (head_dim * activation_bytes + 4)


AUTO = "auto"


def keep_setting_of(where: str, blocks: object, n_layers: int, flavor: str) -> tuple[str, int | None]:
    """``[activation_checkpoint] keep_attention`` and ``keep_attention_blocks`` as written, read into
    ``(where, blocks)``: blocks None for ``auto``, else a count from 0 to ``n_layers`` (an int, or a
    string of digits as TOML and flags may give it). Raises ConfigError for a bad value, naming the
    valid ones (``flavor``: the model.flavor the count is bounded by)."""
    if where not in KEEP_ATTENTION:
        raise ConfigError(f"invalid activation_checkpoint.keep_attention = {where!r}: valid values are "
                          f"{', '.join(KEEP_ATTENTION)}")
    if isinstance(blocks, str) and blocks.strip() == AUTO:
        return where, None
    count = blocks if isinstance(blocks, int) and not isinstance(blocks, bool) else None
    if isinstance(blocks, str) and blocks.strip().isdigit():
        count = int(blocks.strip())
    if count is None or not 0 <= count <= n_layers:
        raise ConfigError(f"invalid activation_checkpoint.keep_attention_blocks = {blocks!r}: valid values are "
                          f"\"auto\" (as many as fit) or a number of blocks from 0 to the {n_layers} of model.flavor "
                          f"{flavor!r}")
    return where, count


def needs_planner_for(where: str, blocks: int | None) -> bool:
    """Whether a keep setting's plan depends on the machine's memory (``auto`` in either key)."""
    return where != "off" and (where == AUTO or blocks is None)


def stated_plan(where: str, blocks: int | None) -> KeepAttentionPlan | None:
    """The plan a keep setting states on its own (None where the planner must size it)."""
    if where == "off" or blocks == 0:
        return NO_KEEP
    if needs_planner_for(where, blocks):
        return None
    return KeepAttentionPlan(device_blocks=blocks) if where == "device" else KeepAttentionPlan(host_blocks=blocks)
