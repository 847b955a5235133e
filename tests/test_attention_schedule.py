"""The GQA stage schedule (paper section 4.1, Figure 4) in the model's standard head order."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_upipe.spec.cp_layout import valid_cp_degrees, valid_heads_per_stage
from titan_upipe.spec.head_schedule import HeadSchedule, ScheduleError, Stage, build_schedule, verify_schedule


def test_figure_4_example() -> None:
    """H=16, KV=4 (group size 4), C=U=4: all four KV heads go out in stage 0 with
    Q0, Q4, Q8, Q12; later stages send only the next query of each group."""
    schedule = build_schedule(16, 4, 4, 4)
    assert [s.query_heads for s in schedule.stages] == [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]
    assert [s.sends_kv for s in schedule.stages] == [True, False, False, False]
    assert all(s.kv_heads_per_rank == ((0,), (1,), (2,), (3,)) for s in schedule.stages)
    assert schedule.stages[0].kv_heads_sent == (0, 1, 2, 3) and schedule.stages[1].kv_heads_sent == ()


def test_qwen3_32b_layout_sends_kv_once() -> None:
    schedule = build_schedule(64, 8, 8, 8)
    assert schedule.n_stages == 8 and schedule.kv_exchanges == 1
    assert schedule.stages[3].query_heads == tuple(8 * r + 3 for r in range(8))
    assert schedule.stages[3].kv_heads_per_rank == tuple((r,) for r in range(8))


def test_u_equals_h_is_plain_ulysses() -> None:
    schedule = build_schedule(32, 8, 4, 32)
    (stage,) = schedule.stages
    assert stage.query_heads_per_rank == tuple(tuple(range(8 * r, 8 * r + 8)) for r in range(4))
    assert stage.kv_heads_per_rank == tuple((2 * r, 2 * r + 1) for r in range(4))


def test_u_defaults_to_c() -> None:
    assert build_schedule(32, 8, 4).heads_per_stage == 4
    assert build_schedule(32, 8, 4, 0).heads_per_stage == 4


def test_mha_sends_kv_every_stage() -> None:
    schedule = build_schedule(8, 8, 2, 2)
    assert schedule.kv_exchanges == schedule.n_stages == 4
    assert [s.query_heads for s in schedule.stages] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [s.kv_heads_per_rank for s in schedule.stages] == [((0,), (4,)), ((1,), (5,)), ((2,), (6,)), ((3,), (7,))]


@pytest.mark.parametrize(("cp", "expected"), [
    (4, [((0,), [0, 1]), ((1,), [2, 3])]),
    (8, [((0,), [0, 1, 2, 3]), ((1,), [4, 5, 6, 7])]),
])
def test_cp_larger_than_kv_replicates_activations(cp: int, expected) -> None:
    """8 query / 2 KV heads: ranks of one group all receive that group's KV head."""
    schedule = build_schedule(8, 2, cp, cp)
    assert schedule.kv_exchanges == 1  # every later stage reuses the replicated K/V
    for stage in schedule.stages:
        assert stage.kv_destinations() == expected
        for rank, queries in enumerate(stage.query_heads_per_rank):
            assert all(q // 4 == stage.kv_heads_per_rank[rank][0] for q in queries)


def test_partial_group_overlap_resends_the_whole_set() -> None:
    """U/C = 3 query heads per rank with groups of 4: a stage whose KV set changes resends it."""
    schedule = build_schedule(24, 6, 2, 6)
    per_rank = [s.kv_heads_per_rank[0] for s in schedule.stages]
    assert per_rank == [(0,), (0, 1), (1, 2), (2,)]
    assert [s.sends_kv for s in schedule.stages] == [True, True, True, True]
    assert schedule.max_kv_heads_per_rank == 2


def _all_valid_configs():
    for n_heads in (8, 16, 24, 32, 64):
        for n_kv in (d for d in range(1, n_heads + 1) if n_heads % d == 0):
            for cp in valid_cp_degrees(n_heads, n_kv):
                for u in valid_heads_per_stage(n_heads, cp):
                    yield n_heads, n_kv, cp, u


def test_every_valid_config_builds_a_verified_schedule() -> None:
    configs = list(_all_valid_configs())
    assert len(configs) > 200
    for n_heads, n_kv, cp, u in configs:
        schedule = build_schedule(n_heads, n_kv, cp, u)  # verify_schedule runs inside
        per_rank, n_rep = u // cp, n_heads // n_kv
        if n_rep % per_rank == 0:
            # The paper's GQA property: each KV head is sent once, in the first stage that needs it.
            sent = [k for s in schedule.stages for k in s.kv_heads_sent]
            assert sorted(sent) == list(range(n_kv)), (n_heads, n_kv, cp, u)
            assert schedule.kv_exchanges == max(1, (n_heads // cp) // n_rep)


def communicated_heads(schedule: HeadSchedule) -> int:
    """Heads' worth of local-sequence tensors each rank sends in a forward (Q plus K and V)."""
    return sum(len(stage.query_heads_per_rank) * schedule.query_heads_per_rank
               + (2 * schedule.cp_degree * len(stage.kv_heads_per_rank[0]) if stage.sends_kv else 0)
               for stage in schedule.stages)


def _naive_schedule(n_heads: int, n_kv: int, cp: int, u: int) -> HeadSchedule:
    """Stage s takes query heads s*U .. (s+1)*U-1 in order (no GQA reordering)."""
    n_rep, per_rank = n_heads // n_kv, u // cp
    stages = []
    for index in range(n_heads // u):
        queries = tuple(tuple(range(index * u + r * per_rank, index * u + (r + 1) * per_rank)) for r in range(cp))
        kv = tuple(tuple(sorted({q // n_rep for q in run})) for run in queries)
        stages.append(Stage(index, queries, kv, sends_kv=True))
    return HeadSchedule(n_heads, n_kv, cp, u, tuple(stages))


def test_gqa_schedule_communicates_less_than_naive_order() -> None:
    """Paper: (3 + G - 1) H/(C G) (C - 1) against 3 H/C (C - 1) for the naive order."""
    n_heads, n_kv, cp = 16, 4, 4
    ours, naive = build_schedule(n_heads, n_kv, cp, cp), _naive_schedule(n_heads, n_kv, cp, cp)
    verify_schedule(naive)  # valid, just wasteful
    group = n_heads // n_kv
    assert communicated_heads(ours) == (3 + group - 1) * n_heads // (cp * group) * cp
    assert communicated_heads(naive) == 3 * n_heads // cp * cp
    assert communicated_heads(ours) < communicated_heads(naive)


# --- a wrong schedule must be caught -------------------------------------------------------


def _with_stage(schedule: HeadSchedule, index: int, **changes) -> HeadSchedule:
    stages = list(schedule.stages)
    stages[index] = dataclasses.replace(stages[index], **changes)
    return dataclasses.replace(schedule, stages=tuple(stages))


def test_verify_rejects_wrong_kv_head() -> None:
    schedule = build_schedule(16, 4, 4, 4)
    kv = schedule.stages[0].kv_heads_per_rank
    with pytest.raises(ScheduleError, match="need KV heads"):
        verify_schedule(_with_stage(schedule, 0, kv_heads_per_rank=kv[1:] + kv[:1]))


def test_verify_rejects_missing_or_duplicated_query_head() -> None:
    schedule = build_schedule(16, 4, 4, 4)
    queries = schedule.stages[1].query_heads_per_rank
    duplicated = (schedule.stages[0].query_heads_per_rank[0],) + queries[1:]
    with pytest.raises(ScheduleError, match="exactly once"):
        verify_schedule(_with_stage(schedule, 1, query_heads_per_rank=duplicated))


def test_verify_rejects_reuse_of_stale_kv() -> None:
    schedule = build_schedule(16, 4, 2, 2)  # KV changes at stage 4
    assert schedule.stages[4].sends_kv
    with pytest.raises(ScheduleError, match="reuses K/V"):
        verify_schedule(_with_stage(schedule, 4, sends_kv=False))


def test_verify_rejects_non_contiguous_rows() -> None:
    schedule = build_schedule(16, 16, 2, 4)
    with pytest.raises(ScheduleError, match="not contiguous"):
        verify_schedule(_with_stage(schedule, 0, query_heads_per_rank=((0, 2), (8, 9)),
                                    kv_heads_per_rank=((0, 2), (8, 9))))


# --- the schedule computes the right attention (single process, ranks emulated) -------------


def _emulate(schedule: HeadSchedule, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Run the schedule's head assignment on full-sequence tensors [H or KV, S, D]: each
    rank attends its query heads with the KV heads it holds; outputs land by head."""
    out = torch.full_like(q, float("nan"))
    n_rep = schedule.n_rep
    for stage in schedule.stages:
        for queries, kvs in zip(stage.query_heads_per_rank, stage.kv_heads_per_rank, strict=True):
            for head in queries:
                # The rank attends with a KV head it actually holds: the one the standard
                # mapping names if present, else (a broken schedule) the first it has.
                kv = head // n_rep if head // n_rep in kvs else kvs[0]
                out[head] = torch.nn.functional.scaled_dot_product_attention(
                    q[head : head + 1], k[kv : kv + 1], v[kv : kv + 1], is_causal=True)[0]
    return out


@pytest.mark.parametrize(("n_heads", "n_kv", "cp", "u"), [(16, 4, 4, 4), (8, 2, 8, 8), (32, 8, 2, 4), (24, 6, 2, 6)])
def test_schedule_reproduces_gqa_attention(n_heads: int, n_kv: int, cp: int, u: int) -> None:
    torch.manual_seed(0)
    s, d = 12, 8
    q, k, v = torch.randn(n_heads, s, d), torch.randn(n_kv, s, d), torch.randn(n_kv, s, d)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True, enable_gqa=True)[0]
    schedule = build_schedule(n_heads, n_kv, cp, u)
    torch.testing.assert_close(_emulate(schedule, q, k, v), reference)
    # Shifting the KV heads between ranks (a wrong schedule) must change the result.
    wrong = dataclasses.replace(schedule, stages=tuple(
        dataclasses.replace(st, kv_heads_per_rank=st.kv_heads_per_rank[1:] + st.kv_heads_per_rank[:1])
        for st in schedule.stages))
    assert not torch.allclose(_emulate(wrong, q, k, v), reference, atol=1e-3)


def test_stage_count_and_heads_per_rank() -> None:
    for n_heads, n_kv, cp, u in _all_valid_configs():
        schedule = build_schedule(n_heads, n_kv, cp, u)
        assert schedule.n_stages == n_heads // u
        assert all(len(run) == u // cp for st in schedule.stages for run in st.query_heads_per_rank)
