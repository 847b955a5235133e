"""Memory transforms for multi-million-token training (paper sections 2.3 and 4).

Model converters (``[model] converters``): ``tiled_mlp``, ``tiled_rmsnorm``, ``fused_rope``,
``fused_ce``; settings in ``[transforms]``. Offloaded activation checkpointing:
``[activation_checkpoint] mode = "full"``, ``cpu_offload = true``. See docs/transforms.md.
"""

from titan_upipe.transforms.converters import CONVERTERS
from titan_upipe.transforms.offload import OFFLOAD_STATS, offloaded_host_bytes

__all__ = ["CONVERTERS", "OFFLOAD_STATS", "offloaded_host_bytes"]
