"""The contiguous sequence layout and shard_sequence / gather_sequence over real gloo ranks."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

from titan_upipe.parallel import ContiguousLayout
from titan_upipe.torchtitan_0_2.config import ConfigError


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


# --- zigzag (ring x ulysses) layout ---------------------------------------------------------

ZIGZAG_SHAPES = [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (2, 4), (4, 2), (3, 2)]


@pytest.mark.parametrize(("ring", "ulysses"), ZIGZAG_SHAPES)
def test_zigzag_maps_are_inverse_and_cover_every_token_once(ring: int, ulysses: int) -> None:
    from titan_upipe.parallel import ZigzagLayout

    seq = 2 * ring * ulysses * 3
    layout = ZigzagLayout(seq, ring, ulysses)
    assert layout.local_len * layout.world_size == seq
    held = [t for rank in range(layout.world_size) for t in layout.positions(rank).tolist()]
    assert sorted(held) == list(range(seq))  # every token exactly once
    for token in range(seq):
        rank, index = layout.owner(token)
        assert layout.global_index(rank, index) == token
        assert layout.positions(rank)[index].item() == token
    for rank in range(layout.world_size):
        for index in range(layout.local_len):
            assert layout.owner(layout.global_index(rank, index)) == (rank, index)


@pytest.mark.parametrize(("ring", "ulysses"), ZIGZAG_SHAPES)
def test_ulysses_all_to_all_yields_the_ring_ranks_zigzag_chunks(ring: int, ulysses: int) -> None:
    """The all-to-all joins the Ulysses ranks' shards in rank order: that must be exactly the
    ring rank's chunks (r, 2R-1-r) in order, which is what the ring step assumes."""
    from titan_upipe.attention.ring_plan import zigzag_chunks
    from titan_upipe.parallel import ZigzagLayout

    layout = ZigzagLayout(2 * ring * ulysses * 2, ring, ulysses)
    k = layout.chunk_len
    for r in range(ring):
        joined = torch.cat([layout.positions(r * ulysses + u) for u in range(ulysses)]).tolist()
        first, second = zigzag_chunks(r, ring)
        assert joined == list(range(first * k, (first + 1) * k)) + list(range(second * k, (second + 1) * k))


def _visibility(ring: int, chunk: int, rule=None) -> torch.Tensor:
    """How often each (query, key) pair of the global sequence is attended, summed over the
    ring ranks and steps of the plan; the exact causal mask means every visible pair once."""
    from titan_upipe.attention.ring_plan import causal_block_kind, kv_source, step_calls, zigzag_chunks

    seq = 2 * ring * chunk
    counts = torch.zeros(seq, seq, dtype=torch.long)

    def tokens(chunks, start, stop):
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunks[start:stop]])

    for r in range(ring):
        for step in range(ring):
            q_chunks, kv_chunks = zigzag_chunks(r, ring), zigzag_chunks(kv_source(r, ring, step), ring)
            for call in step_calls(r, ring, step, rule or causal_block_kind):
                q = tokens(q_chunks, call.q_start, call.q_stop)
                kv = tokens(kv_chunks, call.kv_start, call.kv_stop)
                block = torch.ones(len(q), len(kv), dtype=torch.long)
                if call.causal:
                    block = block.tril()
                counts[q.unsqueeze(1), kv.unsqueeze(0)] += block
    return counts


@pytest.mark.parametrize("ring", [1, 2, 3, 4, 5, 8])
def test_ring_plan_reproduces_the_global_causal_mask(ring: int) -> None:
    from titan_upipe.attention.ring_plan import step_calls

    counts = _visibility(ring, chunk=3)
    assert torch.equal(counts, torch.ones_like(counts).tril())
    # zigzag balance: after step 0 every rank runs one full chunk x chunk-pair block per step
    for r in range(ring):
        for step in range(1, ring):
            (call,) = step_calls(r, ring, step)
            assert not call.causal and (call.q_stop - call.q_start) * (call.kv_stop - call.kv_start) == 2


def test_a_wrong_block_rule_is_visible_in_the_mask() -> None:
    from titan_upipe.attention.ring_plan import BlockKind

    def diagonal_as_full(q_chunk: int, kv_chunk: int) -> BlockKind:
        return BlockKind.FULL if kv_chunk <= q_chunk else BlockKind.SKIP

    counts = _visibility(2, chunk=3, rule=diagonal_as_full)
    assert not torch.equal(counts, torch.ones_like(counts).tril())


def test_zigzag_shard_unshard_and_rejections() -> None:
    from titan_upipe.parallel import ZigzagLayout

    layout = ZigzagLayout(16, 2, 2)
    t = torch.randn(3, 16, 5)
    shards = [layout.shard(t, r, 1) for r in range(4)]
    assert shards[0].shape == (3, 4, 5)
    # chunks of 4 tokens: ring rank 0 holds chunks (0, 3), ring rank 1 chunks (1, 2); Ulysses splits each pair
    assert [s[0, :, 0].tolist() for s in shards] == [t[0, i:i + 4, 0].tolist() for i in (0, 12, 4, 8)]
    assert torch.equal(layout.unshard(shards, 1), t)
    assert not torch.equal(layout.unshard(shards[::-1], 1), t)
    with pytest.raises(ConfigError, match=r"2 x ring x ulysses = 2 x 2 x 2 = 8"):
        ZigzagLayout(12, 2, 2)
    with pytest.raises(ValueError):
        layout.owner(16)
    with pytest.raises(ValueError):
        layout.positions(4)


def zigzag_shard_and_gather(rank: int, world: int, mesh, ulysses: int) -> list[str]:
    from titan_upipe.parallel import context_parallel_mesh, gather_sequence, layout_for, shard_sequence

    cp_mesh = context_parallel_mesh(mesh, "usp" if 1 < ulysses < world else "ring", ulysses if ulysses > 1 else 0)
    problems = []
    torch.manual_seed(0)
    for shape, seq_dim in (((2, 32, 3), 1), ((16, 5), 0)):
        full = torch.randn(shape)
        local, positions = shard_sequence(full, cp_mesh, seq_dim)
        layout = layout_for(cp_mesh, shape[seq_dim])
        if not torch.equal(positions, layout.positions(rank)):  # CP rank = ring_rank * U + ulysses_rank = rank
            problems.append(f"positions {shape}")
        if not torch.equal(local, full.index_select(seq_dim, positions)):
            problems.append(f"shard {shape}")
        if not torch.equal(gather_sequence(local, cp_mesh, seq_dim), full):
            problems.append(f"gather {shape}")
    return problems


@pytest.mark.parametrize("ulysses", [1, 2])
def test_zigzag_shard_and_gather_on_gloo(ulysses: int) -> None:
    assert run_distributed(4, zigzag_shard_and_gather, ulysses) == [[]] * 4
