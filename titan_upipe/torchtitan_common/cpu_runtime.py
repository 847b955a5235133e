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

``TITAN_UPIPE_DEVICE`` overrides the choice: ``cpu`` trains on the CPU even on a
GPU node; ``cuda`` asks for a CUDA GPU and leaves TorchTitan's device alone, so
that a machine without one is refused before launch (:func:`device_problem`)
instead of training on the CPU. The job checks read the device a job trains on
from :func:`job_device`.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

import torch

_GIB = 1024**3

DEVICE_ENV = "TITAN_UPIPE_DEVICE"
DEVICE_SETTINGS = ("auto", "cpu", "cuda")
"""Values of ``TITAN_UPIPE_DEVICE``: ``auto`` (the default: the accelerator where there is one, else
the CPU), ``cpu`` (the CPU, with gloo, even on a GPU node), ``cuda`` (a CUDA GPU, or no launch)."""
JOB_DEVICE_ATTRIBUTE = "_titan_upipe_device"
"""Where ``set_job_device`` keeps the device a job is checked for on its job config."""


def device_setting() -> str:
    """``TITAN_UPIPE_DEVICE`` as set (``auto`` when unset or empty)."""
    return os.environ.get(DEVICE_ENV, "").strip() or "auto"


def accelerator_available() -> bool:
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is not None


def _no_cuda_reason() -> str:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "no GPU is visible" + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")


def device_problem() -> str | None:
    """What is wrong with ``TITAN_UPIPE_DEVICE`` on this machine, or None: a value it does not know,
    or ``cuda`` where torch finds no CUDA device (the job would otherwise train on the CPU, slowly
    and silently)."""
    setting = device_setting()
    if setting not in DEVICE_SETTINGS:
        return (f"{DEVICE_ENV}={setting} is invalid: valid values are {', '.join(DEVICE_SETTINGS)} (auto: the GPU "
                f"where there is one, else the CPU; cuda: a CUDA GPU); set one of them or unset {DEVICE_ENV}")
    if setting == "cuda" and not torch.cuda.is_available():
        return (f"{DEVICE_ENV}=cuda but torch finds no CUDA device on this machine ({_no_cuda_reason()}): run the job "
                f"on a GPU node with a CUDA build of torch, or set {DEVICE_ENV}=cpu to train on the CPU")
    return None


def set_job_device(job_config, device: str) -> None:
    """Check ``job_config`` for ``device`` (``cpu``, ``cuda``) rather than this process's: ``validate``
    on a login node checks a GPU job for its compute nodes."""
    vars(job_config)[JOB_DEVICE_ATTRIBUTE] = device


def job_device(job_config) -> str:
    """The device type the job trains on: the one ``set_job_device`` named, else this process's
    (TorchTitan's ``device_type``: ``cpu`` once :func:`activate` found no accelerator)."""
    import torchtitan.tools.utils as titan_utils

    return vars(job_config).get(JOB_DEVICE_ATTRIBUTE) or titan_utils.device_type


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


def compute_device():
    """This process's compute device where TorchTitan's device globals now point (after :func:`activate`):
    ``cuda:LOCAL_RANK`` on CUDA, else the CPU."""
    import torchtitan.tools.utils as titan_utils

    if titan_utils.device_type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def activate() -> bool:
    """Point TorchTitan at the CPU when no accelerator exists; return whether it did.

    Safe to call more than once and at any time: modules already imported that
    copied TorchTitan's device globals are rebound too, so it also works when a
    user launches ``torchtitan.train`` with ``experimental.custom_import``.
    ``TITAN_UPIPE_DEVICE=cpu`` activates it anywhere; ``cuda`` never does (where
    there is no GPU, the job checks refuse the launch: :func:`device_problem`).
    """
    setting = device_setting()
    if setting == "cuda" or (setting != "cpu" and accelerator_available()):
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
