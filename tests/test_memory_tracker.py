"""The live-tensor tracker counts exactly the storages created under it, once each."""

from __future__ import annotations

import gc

import torch

from titan_upipe.toolkit.memory_tracker import LiveTensorTracker

F32 = 4


def test_counts_allocations_and_frees() -> None:
    with LiveTensorTracker() as mem:
        a = torch.empty(1000)
        assert mem.current_bytes == 1000 * F32
        b = torch.empty(500)
        assert mem.current_bytes == 1500 * F32
        del a
        assert mem.current_bytes == 500 * F32
        assert mem.peak_bytes == 1500 * F32
        del b
    assert mem.current_bytes == 0
    assert mem.peak_bytes == 1500 * F32


def test_views_and_inplace_are_not_double_counted() -> None:
    with LiveTensorTracker() as mem:
        a = torch.zeros(64, 64)
        views = [a.view(-1), a.t(), a[3:10], a.reshape(32, 128), a.unsqueeze(0)]
        a.add_(1)
        torch.mul(a, 2, out=a)
        assert mem.current_bytes == 64 * 64 * F32
        del a
        assert mem.current_bytes == 64 * 64 * F32  # the views keep the storage alive
        del views
        gc.collect()
        assert mem.current_bytes == 0


def test_preexisting_tensors_are_baseline_unless_tracked() -> None:
    x = torch.randn(100)
    with LiveTensorTracker() as mem:
        y = x.view(10, 10)  # a view of baseline memory allocates nothing
        x.mul_(2)
        assert mem.current_bytes == 0
        mem.track(x)
        assert mem.current_bytes == 100 * F32
        z = x + 1
        assert mem.current_bytes == 200 * F32
    del y, z


def test_reset_peak_and_peak_op() -> None:
    with LiveTensorTracker() as mem:
        big = torch.ones(1000)
        del big
        mem.reset_peak()
        assert mem.peak_bytes == 0
        small = torch.ones(10) * 3  # the ones and the product are briefly both alive
        assert mem.peak_bytes == 2 * 10 * F32
        assert mem.peak.op == "mul"
        assert mem.current_bytes == 10 * F32
    del small


def test_backward_is_tracked() -> None:
    w = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(8, 64, requires_grad=True)
    with LiveTensorTracker() as mem:
        y = (x @ w).relu().sum()
        # relu keeps its output for backward; the matmul result is freed.
        assert mem.current_bytes == 8 * 32 * F32 + F32
        mem.reset_peak()
        y.backward()
        # After backward: y (a scalar) and the two leaf gradients.
        assert mem.current_bytes == F32 + w.numel() * F32 + x.numel() * F32
        assert mem.peak_bytes >= mem.current_bytes


def test_resized_outputs_follow_the_storage() -> None:
    with LiveTensorTracker() as mem:
        out = torch.empty(0)
        torch.add(torch.ones(256), 1, out=out)  # out= resizes its storage
        assert mem.current_bytes == 256 * F32
        assert mem.peak_bytes == 2 * 256 * F32
    del out


def _dtensor_bytes(rank: int, world: int, mesh) -> tuple[int, int]:
    from torch.distributed.tensor import DTensor, Shard

    local = torch.ones(16, 8)  # this rank's shard of a [32, 8] tensor
    sharded = DTensor.from_local(local, mesh, [Shard(0)])
    with LiveTensorTracker() as mem:
        doubled = sharded * 2
    assert doubled.to_local().shape == (16, 8) and doubled.shape == (32, 8)
    return mem.current_bytes, doubled.to_local().untyped_storage().nbytes()


def test_dtensors_are_counted_by_their_local_shard():
    from dist_utils import run_distributed

    for counted, local_bytes in run_distributed(2, _dtensor_bytes):
        assert counted == local_bytes == 16 * 8 * 4  # not the global 32 x 8
