"""TorchTitan 0.3.0 on the torch builds the plugin runs on (2.11 on the GPU machines, 2.13 on CI).

After the first step, 0.3's trainer shortens every process group's timeout to
``comm.train_timeout_seconds`` through ``torchtitan.distributed.utils.set_pg_timeouts``, which calls
``torch.distributed.set_timeout(timeout, group)``: a function newer torch adds, and 2.11 and 2.13
lack. Their groups have the method the function wraps, ``ProcessGroup.set_timeout``.
:func:`activate` points TorchTitan's ``set_pg_timeouts`` at :func:`set_pg_timeouts`, the same steps
through that method, where torch lacks the function; it is inert elsewhere. Only TorchTitan's module
global is rebound (as ``torchtitan_common.cpu_runtime`` rebinds its device); torch is never patched.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torchtitan.distributed import utils as titan_dist_utils
from torchtitan.tools import utils as titan_utils


def set_pg_timeouts(timeout: timedelta, parallel_dims) -> None:
    """Every group of ``parallel_dims``' meshes and the default group wait up to ``timeout`` from
    now on, once every rank got here (TorchTitan's steps: a barrier first, so that no rank runs a
    collective under the short timeout while another still initialises)."""
    dist.barrier(device_ids=[titan_utils.device_module.current_device()] if torch.cuda.is_available()
                 and titan_utils.device_type == "cuda" else None)
    titan_utils.device_module.synchronize()
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()]
    for group in [*groups, dist.group.WORLD]:
        group.set_timeout(timeout)


def activate() -> bool:
    """Rebind TorchTitan's ``set_pg_timeouts`` where torch has no ``distributed.set_timeout``; return
    whether it did."""
    if hasattr(dist, "set_timeout"):
        return False
    titan_dist_utils.set_pg_timeouts = set_pg_timeouts
    return True
