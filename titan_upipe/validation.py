"""Job-level checks that run before any process group starts.

Every problem is reported as a :class:`~titan_upipe.config.ConfigError` naming the
setting and the valid choices. ``titan_upipe.train`` calls :func:`check_job` right
after parsing the config; ``parallelize_fn`` calls it again so that launches through
``torchtitan.train`` are covered too (there it runs after process-group start, but
still before any collective of ours).
"""

from __future__ import annotations

from titan_upipe.attention.validation import (
    check_cp_degree,
    resolve_heads_per_stage,
    resolve_mesh_shape,
    valid_ulysses_degrees,
)
from titan_upipe.config import ConfigError
from titan_upipe.transforms.validation import check_transforms

CP_MODES = ("ulysses", "upipe", "ring", "usp")
"""Converter names that provide context-parallel attention."""


def cp_mode(converters: list[str]) -> str | None:
    """The context-parallel attention converter named in ``model.converters``, if any."""
    modes = [name for name in converters if name in CP_MODES]
    if len(modes) > 1:
        raise ConfigError(
            f"model.converters names several context-parallel attentions {modes}: keep one of {', '.join(CP_MODES)}"
        )
    return modes[0] if modes else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def degrees_besides_shard(parallelism) -> int:
    """The product of every parallel degree but ``data_parallel_shard_degree``."""
    return (parallelism.context_parallel_degree * parallelism.tensor_parallel_degree
            * parallelism.pipeline_parallel_degree * parallelism.data_parallel_replicate_degree)


def check_world_size(parallelism, world_size: int) -> None:
    fixed = degrees_besides_shard(parallelism)
    shard = parallelism.data_parallel_shard_degree
    if shard == -1:
        ok = world_size % fixed == 0
    else:
        ok = fixed * shard == world_size
    if not ok:
        raise ConfigError(
            f"parallelism degrees (context_parallel_degree={parallelism.context_parallel_degree}, "
            f"data_parallel_shard_degree={shard}, data_parallel_replicate_degree="
            f"{parallelism.data_parallel_replicate_degree}, tensor/pipeline=1) do not match the world size "
            f"{world_size}: valid context_parallel_degree values for {world_size} ranks are {_divisors(world_size)}"
        )


def check_supported_parallelism(parallelism) -> None:
    if (parallelism.tensor_parallel_degree, parallelism.pipeline_parallel_degree,
            parallelism.expert_parallel_degree) != (1, 1, 1):
        raise ConfigError(
            "titan_upipe train specs support FSDP (parallelism.data_parallel_shard_degree) and "
            "context parallelism only: set parallelism.tensor_parallel_degree, "
            "pipeline_parallel_degree and expert_parallel_degree to 1"
        )


def model_heads(job_config) -> tuple[int, int]:
    """(query heads, KV heads) of the configured flavor."""
    from titan_upipe.specs import flavor_args

    args = flavor_args(job_config, update=False)
    return args.n_heads, args.n_kv_heads or args.n_heads


def check_context_parallel(job_config) -> None:
    cp = job_config.parallelism.context_parallel_degree
    mode = cp_mode(job_config.model.converters)
    if cp > 1 and mode is None:
        raise ConfigError(
            f"parallelism.context_parallel_degree = {cp} needs a context-parallel attention converter: "
            f"add one of {', '.join(CP_MODES)} to model.converters"
        )
    if mode is None:
        return
    if cp < 2:
        raise ConfigError(
            f"model.converters has {mode!r} but parallelism.context_parallel_degree = {cp}: "
            "set it to 2 or more (a divisor of the world size that splits the heads)"
        )
    ulysses_setting = job_config.upipe.ulysses_degree
    if cp % max(ulysses_setting, 1):
        raise ConfigError(
            f"upipe.ulysses_degree = {ulysses_setting} does not divide parallelism.context_parallel_degree = {cp}: "
            f"valid values for mode {mode!r} are {valid_ulysses_degrees(mode, cp)}"
        )
    ring, ulysses, _ = resolve_mesh_shape(mode, cp, ulysses_setting)
    n_heads, n_kv_heads = model_heads(job_config)
    if ring == 1:
        check_cp_degree(n_heads, n_kv_heads, cp)
    else:
        _check_ulysses_heads(mode, n_heads, n_kv_heads, cp, ulysses)
    if mode == "upipe":
        resolve_heads_per_stage(n_heads, n_kv_heads, ulysses, job_config.upipe.heads_per_stage)
    attention_backend_choice(job_config, probe=False)
    seq_len = job_config.training.seq_len
    unit = cp if ring == 1 else 2 * ring * ulysses
    if seq_len % unit:
        what = (f"parallelism.context_parallel_degree = {cp}" if ring == 1 else
                f"2 x ring x ulysses = 2 x {ring} x {ulysses} = {unit} (zigzag chunks over the Ulysses ranks)")
        raise ConfigError(
            f"training.seq_len = {seq_len} is not divisible by {what}: "
            f"use a multiple of {unit} (e.g. {seq_len - seq_len % unit or unit})"
        )


def compute_dtype(job_config):
    """The dtype of the attention inputs in training: FSDP's parameter dtype (TorchTitan runs
    every CP job under FSDP, its mesh spanning the CP ranks)."""
    from torchtitan.config import TORCH_DTYPE_MAP

    return TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]


def attention_backend_choice(job_config, probe: bool = True):
    """``[upipe] attention_backend`` resolved for this job (``auto`` included), as a
    ``BackendChoice``; a backend that cannot run it raises ConfigError. Ring and USP layouts
    need a backend whose backward honours the merged out/lse."""
    from titan_upipe.attention.backends import choose_backend

    mode = cp_mode(job_config.model.converters)
    cp = job_config.parallelism.context_parallel_degree
    ring = mode is not None and resolve_mesh_shape(mode, cp, job_config.upipe.ulysses_degree)[0] > 1
    return choose_backend(job_config.upipe.attention_backend, compute_dtype(job_config), ring=ring, probe=probe)


def _check_ulysses_heads(mode: str, n_heads: int, n_kv_heads: int, cp: int, ulysses: int) -> None:
    """With a ring, only the Ulysses degree splits heads (K/V replicated when it exceeds KV)."""
    try:
        check_cp_degree(n_heads, n_kv_heads, ulysses, what="upipe.ulysses_degree")
    except ConfigError as exc:
        valid = [d for d in valid_ulysses_degrees(mode, cp) if d > 0 and n_heads % d == 0
                 and (n_kv_heads % d == 0 or d % n_kv_heads == 0)]
        raise ConfigError(f"{exc}; for mode {mode!r} at CP {cp} use upipe.ulysses_degree in {valid}") from None


JOB_CHECKS = (
    lambda job_config, world_size: check_supported_parallelism(job_config.parallelism),
    lambda job_config, world_size: check_world_size(job_config.parallelism, world_size),
    lambda job_config, world_size: check_context_parallel(job_config),
    lambda job_config, world_size: check_transforms(job_config),
)
"""Every job-level check as ``check(job_config, world_size)``; ``titan_upipe.validate`` runs
them all to report every problem, ``check_job`` stops at the first."""


def check_job(job_config, world_size: int) -> None:
    """All checks; raises the first problem found."""
    for check in JOB_CHECKS:
        check(job_config, world_size)
