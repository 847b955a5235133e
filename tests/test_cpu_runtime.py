"""The CPU runtime: TorchTitan sees device "cpu" and gets CUDA-style memory statistics."""

import sys

import torch

from titan_upipe.torchtitan_common import cpu_runtime


def test_torchtitan_modules_see_cpu():
    assert cpu_runtime.is_active()
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as titan_utils

    for module in (titan_utils, metrics, parallel_dims, dist_utils):
        assert module.device_type == "cpu", module.__name__
    assert isinstance(titan_utils.device_module, cpu_runtime.CpuDeviceModule)
    # dual_pipe_v asks torch for the device itself; it serves pipeline parallelism only,
    # which the plugin's parallelize_fn rejects.
    stale = [name for name, m in sys.modules.items()
             if name.startswith("torchtitan") and getattr(m, "device_type", "cpu") == "cuda"]
    assert set(stale) <= {"torchtitan.distributed.dual_pipe_v"}


def test_activate_is_idempotent():
    assert cpu_runtime.activate() is True
    assert cpu_runtime.activate() is True
    import torchtitan.tools.utils as titan_utils

    assert titan_utils.device_type == "cpu"


def test_memory_stats_follow_rss():
    device = cpu_runtime.CpuDeviceModule()
    device.reset_peak_memory_stats()
    before = device.memory_stats()
    block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched so it is resident
    during = device.memory_stats()
    assert during["active_bytes.all.current"] >= before["active_bytes.all.current"] + 48 * 2**20
    assert during["reserved_bytes.all.peak"] >= during["active_bytes.all.current"]
    del block
    device.reset_peak_memory_stats()
    after = device.memory_stats()
    assert after["reserved_bytes.all.peak"] < during["reserved_bytes.all.peak"]
    assert after["num_alloc_retries"] == 0 and after["num_ooms"] == 0


def test_device_properties_report_host_memory():
    device = cpu_runtime.CpuDeviceModule()
    assert device.get_device_properties(torch.device("cpu")).total_memory > 2**30
    assert "CPU" in device.get_device_name()


def test_metrics_monitor_runs_on_cpu():
    from torchtitan.components.metrics import build_device_memory_monitor

    stats = build_device_memory_monitor().get_peak_stats()
    assert stats.max_reserved_gib > 0 and stats.num_alloc_retries == 0
