"""The UPipe head schedule: which query and KV heads each rank attends in each stage.

Pure functions of (H, KV, C, U), no torch. Heads keep the model's standard order:
query head ``h`` uses KV head ``h // (H / KV)`` and the rows ``h*D:(h+1)*D`` of ``wq``.

Construction (paper section 4.1, Figure 4, restated for the standard head order):
rank ``r`` owns the same contiguous block of ``H / C`` query heads it owns under plain
Ulysses, ``[r*H/C, (r+1)*H/C)``, and walks through that block ``U / C`` heads per stage.
Because the block is ordered by KV group, consecutive stages of a rank reuse the same
KV head(s): K/V are exchanged only when a rank's KV set changes, and then for every rank
at once (the sets change in lockstep, see ``verify_schedule``). Globally each stage
therefore takes its queries "out of order", one run per rank, e.g. H=16, KV=4, C=U=4::

    stage 0: Q0  Q4  Q8  Q12   (+ K/V 0 1 2 3 sent)
    stage 1: Q1  Q5  Q9  Q13   (K/V reused)
    stage 2: Q2  Q6  Q10 Q14
    stage 3: Q3  Q7  Q11 Q15

When C > KV the ranks of one KV group all hold that group's KV head: its activations are
replicated into several all-to-all chunks (never the weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from titan_upipe.spec.cp_layout import check_cp_degree, resolve_heads_per_stage

HeadRun = tuple[int, ...]


@dataclass(frozen=True)
class Stage:
    """One UPipe stage: per destination rank, the global query heads it attends and the
    KV heads it holds while doing so."""

    index: int
    query_heads_per_rank: tuple[HeadRun, ...]
    kv_heads_per_rank: tuple[HeadRun, ...]
    sends_kv: bool
    """K/V are projected and exchanged at the start of this stage; otherwise each rank
    reuses the K/V it received in an earlier stage."""

    @property
    def query_heads(self) -> HeadRun:
        """All U query heads of the stage, in destination-rank order."""
        return tuple(h for run in self.query_heads_per_rank for h in run)

    @property
    def kv_heads_sent(self) -> HeadRun:
        """Distinct KV heads each rank projects from its tokens in this stage (empty when reused)."""
        if not self.sends_kv:
            return ()
        return tuple(sorted({h for run in self.kv_heads_per_rank for h in run}))

    def local_kv_index(self, rank: int, n_rep: int) -> HeadRun | None:
        """For each of ``rank``'s query heads, the position of its KV head among those the rank
        holds; None when that is the kernels' own GQA mapping ``i // (h_q / h_kv)`` (equal,
        contiguous groups). Otherwise (U/C and H/KV not multiples of one another) K/V must
        be expanded per query head for the kernel."""
        queries, kvs = self.query_heads_per_rank[rank], self.kv_heads_per_rank[rank]
        index = tuple(q // n_rep - kvs[0] for q in queries)
        if len(queries) % len(kvs) == 0:
            group = len(queries) // len(kvs)
            if index == tuple(i // group for i in range(len(queries))):
                return None
        return index

    def kv_destinations(self) -> list[tuple[HeadRun, list[int]]]:
        """Each distinct per-rank KV run with the ranks that receive it (>1 rank = replication)."""
        groups: dict[HeadRun, list[int]] = {}
        for rank, run in enumerate(self.kv_heads_per_rank):
            groups.setdefault(run, []).append(rank)
        return list(groups.items())


@dataclass(frozen=True)
class HeadSchedule:
    n_heads: int
    n_kv_heads: int
    cp_degree: int
    heads_per_stage: int
    stages: tuple[Stage, ...]

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def query_heads_per_rank(self) -> int:
        return self.heads_per_stage // self.cp_degree

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def max_kv_heads_per_rank(self) -> int:
        return max(len(stage.kv_heads_per_rank[0]) for stage in self.stages)

    @property
    def kv_exchanges(self) -> int:
        return sum(stage.sends_kv for stage in self.stages)


def build_schedule(n_heads: int, n_kv_heads: int, cp_degree: int, heads_per_stage: int | None = None) -> HeadSchedule:
    """The GQA-aware stage schedule; ``heads_per_stage`` None/0 means U = C, U = H is plain Ulysses."""
    return _verified_schedule(n_heads, n_kv_heads, cp_degree,
                              resolve_heads_per_stage(n_heads, n_kv_heads, cp_degree, heads_per_stage))


@lru_cache(maxsize=512)
def _verified_schedule(n_heads: int, n_kv_heads: int, cp_degree: int, u: int) -> HeadSchedule:
    # Memoized: a schedule is a frozen value of (H, KV, C, U), and the memory planner's length search
    # asks for the same few hundreds of times per answer (each verification walks every head).
    n_rep = n_heads // n_kv_heads
    block = n_heads // cp_degree
    per_rank = u // cp_degree
    stages: list[Stage] = []
    previous_kv: tuple[HeadRun, ...] | None = None
    for index in range(n_heads // u):
        queries = tuple(
            tuple(range(rank * block + index * per_rank, rank * block + (index + 1) * per_rank))
            for rank in range(cp_degree)
        )
        kv = tuple(tuple(sorted({h // n_rep for h in run})) for run in queries)
        # Reuse is all-or-nothing per stage: partial overlaps (possible when U/C and H/KV do
        # not divide each other) resend the whole set, which keeps one resident K/V buffer.
        stages.append(Stage(index, queries, kv, sends_kv=kv != previous_kv))
        previous_kv = kv
    schedule = HeadSchedule(n_heads, n_kv_heads, cp_degree, u, tuple(stages))
    verify_schedule(schedule)
    return schedule


class ScheduleError(AssertionError):
    """A schedule that would compute wrong attention (a bug, not a user setting)."""


def verify_schedule(schedule: HeadSchedule) -> None:
    """Check every property the attention relies on; raise ScheduleError naming the first violation."""
    h, kv, c = schedule.n_heads, schedule.n_kv_heads, schedule.cp_degree
    check_cp_degree(h, kv, c)
    n_rep = h // kv
    per_rank = schedule.query_heads_per_rank
    if schedule.heads_per_stage % c or h % schedule.heads_per_stage:
        raise ScheduleError(f"U={schedule.heads_per_stage} must be a multiple of C={c} dividing H={h}")
    if schedule.n_stages != h // schedule.heads_per_stage:
        raise ScheduleError(f"{schedule.n_stages} stages, expected H/U = {h // schedule.heads_per_stage}")
    seen: list[int] = []
    previous_kv: Sequence[HeadRun] | None = None
    for stage in schedule.stages:
        if len(stage.query_heads_per_rank) != c or len(stage.kv_heads_per_rank) != c:
            raise ScheduleError(f"stage {stage.index}: needs one query run and one KV run per rank")
        kv_counts = {len(run) for run in stage.kv_heads_per_rank}
        if len(kv_counts) != 1:
            raise ScheduleError(f"stage {stage.index}: ranks hold different numbers of KV heads {kv_counts}")
        for rank, (queries, kvs) in enumerate(zip(stage.query_heads_per_rank, stage.kv_heads_per_rank, strict=True)):
            if len(queries) != per_rank:
                raise ScheduleError(f"stage {stage.index} rank {rank}: {len(queries)} query heads, expected U/C={per_rank}")
            if list(queries) != list(range(queries[0], queries[0] + per_rank)):
                raise ScheduleError(f"stage {stage.index} rank {rank}: query heads {queries} are not contiguous rows")
            if list(kvs) != list(range(kvs[0], kvs[0] + len(kvs))):
                raise ScheduleError(f"stage {stage.index} rank {rank}: KV heads {kvs} are not contiguous rows")
            needed = sorted({q // n_rep for q in queries})
            if needed != list(kvs):
                raise ScheduleError(
                    f"stage {stage.index} rank {rank}: query heads {queries} need KV heads {needed}, "
                    f"the rank holds {kvs}"
                )
            if any(not 0 <= q < h for q in queries) or any(not 0 <= k < kv for k in kvs):
                raise ScheduleError(f"stage {stage.index} rank {rank}: head index out of range")
        if stage.index == 0 and not stage.sends_kv:
            raise ScheduleError("stage 0 must send K/V")
        if not stage.sends_kv and tuple(stage.kv_heads_per_rank) != tuple(previous_kv or ()):
            raise ScheduleError(f"stage {stage.index} reuses K/V but its KV heads differ from the previous stage")
        previous_kv = stage.kv_heads_per_rank
        seen.extend(stage.query_heads)
    if sorted(seen) != list(range(h)):
        raise ScheduleError(f"query heads are not covered exactly once: {sorted(seen)}")


INPUT_GRAD_TILES = 8
"""Token tiles of the final dX GEMM (``ProjectionGrads.input_grad``): its concatenated operand is
1/8 of ``[tokens, (H+2KV)*D]`` at a time (the memory model, ``costs.attention_memory``, counts it)."""
