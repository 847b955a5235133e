"""Run TorchTitan on CPU with gloo when no CUDA device exists.

TorchTitan 0.2.2 picks its device at import time in ``torchtitan.tools.utils``
(``_get_available_device_type() or "cuda"``) and several modules copy that
choice into their own globals with ``from torchtitan.tools.utils import
device_type``. On a machine without an accelerator it therefore asks for
``cuda`` and fails. ``activate()`` points every one of those names at ``cpu``:

========================  ==============================================
TorchTitan expects        what this module provides on CPU
========================  ==============================================
``device_type``           ``"cpu"`` (so meshes and process groups use gloo)
``device_module``         :class:`CpuDeviceModule`, CUDA-style memory stats
                          backed by the process RSS (peak = ``VmHWM``,
                          reset through ``/proc/self/clear_refs``)
FSDP PREMUL_SUM           gloo has none: :func:`force_sum_reductions`
========================  ==============================================

It is inert where CUDA (or another accelerator) is available: ``activate()``
returns ``False`` and touches nothing. Only TorchTitan's module globals are
rebound; torch itself is never patched.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

import torch

_GIB = 1024**3


def accelerator_available() -> bool:
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is not None


def _read_status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (0 where procfs is missing)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class CpuDeviceProperties:
    name: str
    total_memory: int


class CpuDeviceModule:
    """The subset of ``torch.cuda``'s API that TorchTitan calls, answered for the host.

    Memory statistics are process-wide RSS: on CPU there is no caching allocator,
    so "allocated" and "reserved" are the same resident bytes. The peak is the
    kernel's high-water mark, which ``reset_peak_memory_stats`` clears.
    """

    def __init__(self) -> None:
        self._retries = 0

    # device selection: one host, nothing to select
    def set_device(self, device: torch.device | int | str) -> None:
        del device

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device: object = None) -> None:
        del device

    def get_device_name(self, device: object = None) -> str:
        del device
        return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"

    def get_device_properties(self, device: object = None) -> CpuDeviceProperties:
        del device
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return CpuDeviceProperties(self.get_device_name(), pages * page_size)

    # memory statistics
    def memory_allocated(self, device: object = None) -> int:
        del device
        return _read_status_kib("VmRSS") * 1024

    memory_reserved = memory_allocated

    def max_memory_allocated(self, device: object = None) -> int:
        del device
        return max(_read_status_kib("VmHWM"), _read_status_kib("VmRSS")) * 1024

    max_memory_reserved = max_memory_allocated

    def memory_stats(self, device: object = None) -> dict[str, int]:
        current, peak = self.memory_allocated(device), self.max_memory_allocated(device)
        return {
            "active_bytes.all.current": current,
            "active_bytes.all.peak": peak,
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": current,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": self._retries,
            "num_ooms": 0,
        }

    def reset_peak_memory_stats(self, device: object = None) -> None:
        del device
        try:
            # "5" resets the peak resident set size (VmHWM) to the current RSS.
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
        except OSError:
            pass  # the peak then covers the whole process lifetime

    def empty_cache(self) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)


_CPU_DEVICE_MODULE = CpuDeviceModule()


def activate() -> bool:
    """Point TorchTitan at the CPU when no accelerator exists; return whether it did.

    Safe to call more than once and at any time: modules already imported that
    copied TorchTitan's device globals are rebound too, so it also works when a
    user launches ``torchtitan.train`` with ``experimental.custom_import``.
    """
    if os.environ.get("TITAN_UPIPE_DEVICE", "auto") != "cpu" and accelerator_available():
        return False

    import torchtitan.tools.utils as titan_utils

    stale = {"device_type": titan_utils.device_type, "device_module": titan_utils.device_module}
    fresh = {"device_type": "cpu", "device_module": _CPU_DEVICE_MODULE}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torchtitan" or name.startswith("torchtitan.")):
            continue
        for attr, old in stale.items():
            if getattr(module, attr, None) is old:
                setattr(module, attr, fresh[attr])
    return True


def is_active() -> bool:
    import torchtitan.tools.utils as titan_utils

    return titan_utils.device_type == "cpu"


def force_sum_reductions(model: torch.nn.Module) -> None:
    """Make FSDP reduce gradients with plain sums, the only reduction gloo supports.

    TorchTitan sets a gradient divide factor of 1 (it normalises by the global token
    count itself); FSDP turns any divide factor into a PREMUL_SUM reduce-scatter,
    which gloo lacks. Forcing sum reductions keeps the same numbers.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
