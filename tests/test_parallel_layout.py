"""The contiguous sequence layout and shard_sequence / gather_sequence over real gloo ranks."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

from titan_upipe.config import ConfigError
from titan_upipe.parallel import ContiguousLayout


def test_positions_and_owner_roundtrip() -> None:
    layout = ContiguousLayout(seq_len=24, world_size=4)
    assert layout.local_len == 6
    assert layout.positions(2).tolist() == list(range(12, 18))
    seen = []
    for token in range(24):
        rank, index = layout.owner(token)
        assert layout.global_index(rank, index) == token
        assert layout.positions(rank)[index].item() == token
        seen.append(rank)
    assert seen == sorted(seen)  # contiguous: rank r holds [r*S/C, (r+1)*S/C)


@pytest.mark.parametrize("seq_dim", [0, 1, 2])
def test_shard_unshard_is_exact_inverse(seq_dim: int) -> None:
    t = torch.randn(3, 8, 5) if seq_dim == 1 else torch.randn(8, 4, 8)
    layout = ContiguousLayout(t.shape[seq_dim], 4)
    shards = [layout.shard(t, r, seq_dim) for r in range(4)]
    assert all(s.shape[seq_dim] == t.shape[seq_dim] // 4 for s in shards)
    assert torch.equal(layout.unshard(shards, seq_dim), t)
    # a wrong order is not the inverse
    assert not torch.equal(layout.unshard(shards[::-1], seq_dim), t)


def test_rejects_bad_splits_and_indices() -> None:
    with pytest.raises(ConfigError, match="not divisible"):
        ContiguousLayout(30, 4)
    layout = ContiguousLayout(8, 2)
    with pytest.raises(ValueError):
        layout.owner(8)
    with pytest.raises(ValueError):
        layout.positions(2)
    with pytest.raises(ValueError):
        layout.global_index(0, 4)
    with pytest.raises(ConfigError, match="tokens"):
        layout.shard(torch.zeros(1, 6), 0, seq_dim=1)


def shard_and_gather(rank: int, world: int, mesh) -> list[str]:
    from titan_upipe.parallel import gather_sequence, shard_sequence

    problems = []
    torch.manual_seed(0)  # the same full tensors on every rank
    for shape, seq_dim in (((2, 16, 3), 1), ((8, 5), 0), ((2, 3, 4, 8), 3), ((1, 32, 4), 1)):
        full = torch.randn(shape)
        local, positions = shard_sequence(full, mesh, seq_dim)
        n = shape[seq_dim] // world
        if not torch.equal(local, full.narrow(seq_dim, rank * n, n)) or not local.is_contiguous():
            problems.append(f"shard {shape} dim {seq_dim}")
        if positions.tolist() != list(range(rank * n, (rank + 1) * n)):
            problems.append(f"positions {shape}")
        if not torch.equal(gather_sequence(local, mesh, seq_dim), full):
            problems.append(f"gather {shape} dim {seq_dim}")
    ids = torch.arange(32).unsqueeze(0)  # integer tensors (token ids, positions) too
    local_ids, _ = shard_sequence(ids, mesh, 1)
    if not torch.equal(gather_sequence(local_ids, mesh, 1), ids):
        problems.append("int gather")
    return problems


@pytest.mark.parametrize("world", [2, 4])
def test_shard_and_gather_on_gloo(world: int) -> None:
    assert run_distributed(world, shard_and_gather) == [[]] * world
