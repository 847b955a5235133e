"""Memory transforms for multi-million-token training (paper sections 2.3 and 4), core layer.

Tiled MLP (``tiled_mlp``), tiled RMSNorm (``tiled_rmsnorm``), fused RoPE (``model_forward``,
``rope``), fused linear cross-entropy (``fused_ce``), host-offloaded activation checkpointing
(``offload``) and the model surgery that installs them (``surgery``). The TorchTitan converters
named ``tiled_mlp``, ``tiled_rmsnorm``, ``fused_rope``, ``fused_ce`` (``titan_upipe.torchtitan_0_2.converters``)
call into here; settings are ``[transforms]`` and ``[activation_checkpoint]``. See
docs/transforms.md.
"""

from titan_upipe.transforms.offload import OFFLOAD_STATS, offloaded_host_bytes

TRANSFORM_NAMES = ("tiled_mlp", "tiled_rmsnorm", "fused_rope", "fused_ce")
"""The memory transforms' model-converter names (``titan_upipe.torchtitan_0_2.converters`` maps each to its class)."""

__all__ = ["OFFLOAD_STATS", "TRANSFORM_NAMES", "offloaded_host_bytes"]
