"""Advice that is verified (issue 42): every fix a layout problem proposes (rank counts, degrees, the
values a layout rule lists) passes the same job checks before it is printed, and losing a node on a
USP recipe is told the layout that fits."""

from __future__ import annotations

import re

import pytest
from trainer_utils import REPO

from titan_upipe.tools import preflight as validate
from titan_upipe.torchtitan_0_2 import checks
from titan_upipe.torchtitan_0_2.checks import check_job, layout_fixes
from titan_upipe.torchtitan_0_2.config import ConfigError
from titan_upipe.torchtitan_0_2.config_parse import parse_config

UPIPE = "configs/debug/llama3_upipe.toml"  # llama3 debug: 8 query heads, 2 KV heads, seq_len 512, CP 2
USP = "configs/debug/llama3_usp.toml"  # CP 4, ulysses 2
USP_1M = "configs/llama3_8b/usp_1m.toml"  # 8B (32 / 8 heads), 1M tokens: usp, CP 16, ulysses 8, 16 ranks
UPIPE_USP_1M = "configs/llama3_8b/upipe_usp_1m.toml"  # the same with UPipe stages


def job(config: str, *overrides: str):
    return parse_config(["--job.config_file", str(REPO / config), *overrides])


# (id, config, overrides, world size, the message as a regex, advice it must not give)
CASES = [
    # losing a node: the 16-rank USP recipe on 8 ranks is told the layouts that fit 8 ranks
    ("usp-recipe-on-one-node", USP_1M, (), 8,
     r"^8 ranks are not a multiple of context_parallel_degree 16: launch 16 ranks, or set context_parallel_degree and "
     r"upipe.ulysses_degree to 8 and 4 \(or 8 and 2, or 4 and 2\)$", None),
    # UPipe inside USP with 8 Ulysses ranks: on 8 ranks that is plain UPipe, one setting changed
    ("upipe-usp-recipe-on-one-node", UPIPE_USP_1M, (), 8,
     r"^8 ranks are not a multiple of context_parallel_degree 16: launch 16 ranks, or set context_parallel_degree to "
     r"8$", None),
    # dp_shard pinned to 1: CP 2 alone would need 2 ranks, not 6
    ("pinned-shard-on-6", UPIPE, ("--parallelism.context_parallel_degree", "4",
                                  "--parallelism.data_parallel_shard_degree", "1"), 6,
     r"^context_parallel_degree 4 x data_parallel_shard_degree 1 need 4 ranks, but 6 are launched: launch 4 ranks, or "
     r"set context_parallel_degree and data_parallel_shard_degree to 2 and 3 \(or -1: the ranks the other degrees "
     r"leave\)$", r"set context_parallel_degree to 2$"),
    # CP 3 splits no heads and no CP degree fits 3 ranks: not "valid CP degrees are [2, 4, 8]"
    ("cp3-on-3", UPIPE, ("--parallelism.context_parallel_degree", "3"), 3,
     r"^context-parallel degree 3 cannot split n_heads=8, n_kv_heads=2 exactly: launch 2 ranks with "
     r"context_parallel_degree 2, or 4 ranks with context_parallel_degree 4$", r"\[2, 4, 8\]"),
    # ... and on 4 ranks only the degrees that fit 4 ranks are listed
    ("cp3-on-4", UPIPE, ("--parallelism.context_parallel_degree", "3"), 4,
     r"^4 ranks are not a multiple of context_parallel_degree 3: set context_parallel_degree to one of 2, 4$", None),
    # a Ulysses degree the heads allow, but seq_len 512 does not split 2 x 3 x 2 ways on 6 ranks
    ("ulysses-for-heads-not-seq-len", USP, ("--parallelism.context_parallel_degree", "6",
                                            "--upipe.ulysses_degree", "3"), 6,
     r"^upipe.ulysses_degree 3 cannot split n_heads=8, n_kv_heads=2 exactly: launch 4 ranks with "
     r"context_parallel_degree 4 and upipe.ulysses_degree 2, or 8 ranks with", r"use upipe.ulysses_degree in \[2\]"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_layout_advice_names_what_fits(case, capsys):
    _, config, overrides, world, message, wrong = case
    with pytest.raises(ConfigError) as refused:  # the trainer's pre-launch check: the first problem
        check_job(job(config, *overrides), world)
    assert re.search(message, str(refused.value)), str(refused.value)
    assert validate.main([str(REPO / config), "--world-size", str(world), "--no-assets", *overrides]) == 1
    reported = [line.removeprefix("  - ") for line in capsys.readouterr().out.splitlines()]
    assert any(re.search(message, line) for line in reported), reported
    assert wrong is None or not any(re.search(wrong, line) for line in reported), reported


# (config, overrides, the rank counts launched): jobs whose layout does not fit some of them
SWEEP = [
    (USP_1M, (), (6, 8, 24)),
    ("configs/llama3_8b/upipe_1m.toml", ("--upipe.heads_per_stage", "2"), (12,)),
    (UPIPE, ("--parallelism.context_parallel_degree", "3"), (2, 3, 4)),
    (UPIPE, ("--parallelism.context_parallel_degree", "4", "--parallelism.data_parallel_shard_degree", "1"), (3, 6)),
    (UPIPE, ("--upipe.heads_per_stage", "3"), (2,)),
    (UPIPE, ("--parallelism.context_parallel_degree", "1"), (2,)),
    (USP, ("--upipe.ulysses_degree", "0"), (4, 6)),
    ("configs/debug/llama3_upipe_usp.toml", (), (3, 6)),
    ("configs/debug/tsp.toml", (), (6,)),
]


@pytest.mark.parametrize("config, overrides, worlds", SWEEP, ids=[f"{c}{' '.join(o)}" for c, o, _ in SWEEP])
def test_no_fix_is_shown_that_the_checks_refuse(config, overrides, worlds):
    """Each proposal of each layout problem (``find_fix``: what the message names) passes
    ``check_job`` on the ranks it names; and each problem has one."""
    for world in worlds:
        job_config = job(config, *overrides)
        unfit = [err for err in checks.refusals(job_config, world) if isinstance(err, layout_fixes.UnfitLayout)]
        assert unfit, (config, overrides, world)
        for problem in unfit:
            fix = layout_fixes.find_fix(problem, job_config, world, checks.refusals)
            assert fix.proposals(), (problem.problem, world)
            for ranks, changes in fix.proposals():
                check_job(layout_fixes.applied(job_config, changes), ranks)  # raises if the fix would fail


def test_values_a_rule_lists_are_kept_when_they_pass():
    """U values for the debug model at CP 2 all fit: the rule's message, unchanged."""
    with pytest.raises(ConfigError, match=r"upipe.heads_per_stage=3 is invalid \(not a multiple of the CP degree 2\): "
                                          r"valid values for n_heads=8 at CP degree 2 are 0 \(= 2\) or \[2, 4, 8\]$"):
        check_job(job(UPIPE, "--upipe.heads_per_stage", "3"), 2)
