"""Job check of the device the job trains on: ``TITAN_UPIPE_DEVICE`` names one this machine has
(``cpu_runtime.device_problem``). A launch meets it first, when TorchTitan picks its device."""

from __future__ import annotations

from titan_upipe.errors import ConfigError
from titan_upipe.torchtitan_common.cpu_runtime import device_problem


def check_device(job_config, world_size: int) -> None:
    if problem := device_problem():
        raise ConfigError(problem)
