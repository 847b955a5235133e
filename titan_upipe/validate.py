"""Check a training config before launching it: ``python -m titan_upipe.validate X.toml --world-size N``.

Parses the TOML (plus any ``--section.key value`` overrides) exactly as the trainer
does, runs every job-level check that ``titan_upipe.train`` runs before starting process
groups, and prints either the resolved layout (mode, degrees, U, tokens per rank) or every
problem found, each naming the setting and its valid choices. Exit code 0 when the job can
run, 1 when it cannot, 2 on usage errors. Needs no GPU and starts no processes.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from titan_upipe import validation
from titan_upipe.errors import ConfigError
from titan_upipe.registry import register_plugin
from titan_upipe.train import parse_config


@dataclass(frozen=True)
class LayoutSummary:
    model: str
    flavor: str
    world_size: int
    n_heads: int
    n_kv_heads: int
    cp_mode: str | None
    cp_degree: int
    ulysses_degree: int
    ring_degree: int
    heads_per_stage: int | None
    seq_len: int
    converters: tuple[str, ...]

    def lines(self) -> list[str]:
        rows = [
            f"model            {self.model} / {self.flavor} ({self.n_heads} query heads, {self.n_kv_heads} KV heads)",
            f"world size       {self.world_size} (data parallel shard x CP {self.cp_degree})",
            f"converters       {', '.join(self.converters) or '(none)'}",
        ]
        if self.cp_mode:
            rows.append(f"context parallel {self.cp_mode}: ulysses {self.ulysses_degree} x ring {self.ring_degree}")
            if self.heads_per_stage:
                stages = self.n_heads // self.heads_per_stage
                rows.append(f"UPipe            U = {self.heads_per_stage} query heads per stage, {stages} stages")
        rows.append(f"tokens per rank  {self.seq_len // max(self.cp_degree, 1)} of {self.seq_len}")
        return rows


def _world_size_from_config(parallelism) -> int | None:
    shard = parallelism.data_parallel_shard_degree
    return None if shard == -1 else shard * validation.degrees_besides_shard(parallelism)


def find_problems(job_config, world_size: int) -> list[str]:
    """Every problem the job-level checks find (not only the first)."""
    problems: list[str] = []
    for check in validation.JOB_CHECKS:
        try:
            check(job_config, world_size)
        except ConfigError as err:
            problems.append(str(err))
    return problems


def summarize(job_config, world_size: int) -> LayoutSummary:
    """The resolved layout of a job the checks accepted (``validation.cp_layout``)."""
    n_heads, n_kv_heads = validation.model_heads(job_config)
    layout = validation.cp_layout(job_config)
    mode = None if layout.mode is None else layout.mode.value
    return LayoutSummary(
        model=job_config.model.name, flavor=job_config.model.flavor, world_size=world_size,
        n_heads=n_heads, n_kv_heads=n_kv_heads, cp_mode=mode, cp_degree=layout.cp_degree,
        ulysses_degree=layout.ulysses_degree, ring_degree=layout.ring_degree,
        heads_per_stage=layout.heads_per_stage if mode == "upipe" else None, seq_len=job_config.training.seq_len,
        converters=tuple(job_config.model.converters),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_upipe.validate", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the TOML file to check")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks the job will run on (default: the product of the configured degrees)")
    args, overrides = parser.parse_known_args(argv)
    register_plugin()
    try:
        job_config = parse_config(["--job.config_file", args.config, *overrides])
    except (ConfigError, ValueError, TypeError) as err:
        print(f"{args.config}: cannot be parsed:\n  - {err}")
        return 1
    world_size = args.world_size or _world_size_from_config(job_config.parallelism)
    if world_size is None:
        parser.error("parallelism.data_parallel_shard_degree = -1 (derived from the launch): pass --world-size N")
    problems = find_problems(job_config, world_size)
    for warning in validation.config_warnings(job_config):
        print(f"{args.config}: warning: {warning}")
    if problems:
        print(f"{args.config}: {len(problems)} problem(s) for {world_size} ranks:")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print(f"{args.config}: OK for {world_size} ranks")
    for line in summarize(job_config, world_size).lines():
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
