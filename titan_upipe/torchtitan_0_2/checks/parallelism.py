"""Job checks of ``[parallelism]`` and the context-parallel layout it gives (with ``[upipe]``, ``[tsp]``
and the flavor's heads): degrees, world size, the one ``CPLayout`` of the job."""

from __future__ import annotations

from titan_upipe.errors import ConfigError
from titan_upipe.spec.cp_layout import CPLayout, CPMode, cp_mode
from titan_upipe.spec.tsp_shards import tsp_job_problems
from titan_upipe.torchtitan_0_2.checks.layout_fixes import UnfitLayout
from titan_upipe.torchtitan_0_2.config import (
    OptimizerHostState,
    plugin_fields,
)
from titan_upipe.torchtitan_0_2.flavors import ffn_hidden_dim, flavor_args


def degrees_besides_shard(parallelism) -> int:
    """The product of every parallel degree but ``data_parallel_shard_degree``."""
    return (parallelism.context_parallel_degree * parallelism.tensor_parallel_degree
            * parallelism.pipeline_parallel_degree * parallelism.data_parallel_replicate_degree)


DEGREES_BESIDES_SHARD = ("context_parallel_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
                         "data_parallel_replicate_degree")
"""The ``[parallelism]`` degrees whose product the world size is a multiple of."""


def check_parallel_degrees(job_config, world_size: int) -> None:
    _check_degrees(job_config.parallelism)


def _check_degrees(parallelism) -> None:
    """Every degree is at least 1; ``data_parallel_shard_degree`` may also be -1 (the rest)."""
    for key in (*DEGREES_BESIDES_SHARD, "expert_parallel_degree"):
        if (value := getattr(parallelism, key)) < 1:
            raise ConfigError(f"parallelism.{key} = {value} is invalid: valid values are 1 or more")
    shard = parallelism.data_parallel_shard_degree
    if shard != -1 and shard < 1:
        raise ConfigError(f"parallelism.data_parallel_shard_degree = {shard} is invalid: valid values are -1 (the "
                          "ranks the other degrees leave) or 1 or more")


def _degrees_are_valid(parallelism) -> bool:
    try:
        _check_degrees(parallelism)
    except ConfigError:
        return False
    return True


def _degree_terms(parallelism) -> list[str]:
    """``["context_parallel_degree 2", ...]``: the degrees besides the shard degree that are not 1."""
    return [f"{key} {getattr(parallelism, key)}" for key in DEGREES_BESIDES_SHARD if getattr(parallelism, key) != 1]


def world_size_problem(parallelism, world_size: int) -> str | None:
    """What is wrong with launching these degrees on ``world_size`` ranks (its fix is chosen by
    trying layouts on the whole job: ``layout_fixes``); None when they fit (or when a degree is
    itself invalid: :func:`check_parallel_degrees`)."""
    if not _degrees_are_valid(parallelism):
        return None
    fixed = degrees_besides_shard(parallelism)
    shard = parallelism.data_parallel_shard_degree
    if shard == -1:
        if world_size % fixed == 0:
            return None
        terms = _degree_terms(parallelism)
        product = " x ".join(terms) + (f" = {fixed}" if len(terms) > 1 else "")
        ranks = f"{world_size} ranks are" if world_size != 1 else "1 rank is"
        return f"{ranks} not a multiple of {product}"
    if fixed * shard == world_size:
        return None
    terms = [*_degree_terms(parallelism), f"data_parallel_shard_degree {shard}"]
    return f"{' x '.join(terms)} need {fixed * shard} ranks, but {world_size} are launched"


def check_world_size(job_config, world_size: int) -> None:
    if problem := world_size_problem(job_config.parallelism, world_size):
        raise UnfitLayout(problem)


def data_parallel_degree(parallelism, world_size: int) -> int | None:
    """Ranks that read different batches (dp_replicate x dp_shard, -1 resolved); None when the
    degrees do not fit ``world_size``."""
    if not _degrees_are_valid(parallelism) or world_size_problem(parallelism, world_size):
        return None
    return data_parallel_shard_degree(parallelism, world_size) * parallelism.data_parallel_replicate_degree


def data_parallel_shard_degree(parallelism, world_size: int) -> int:
    """FSDP's degree: ``data_parallel_shard_degree``, or with -1 the ranks the other degrees leave
    (the one place the plugin resolves it; TorchTitan's ``ParallelDims`` does the same)."""
    shard = parallelism.data_parallel_shard_degree
    return world_size // degrees_besides_shard(parallelism) if shard == -1 else shard


def check_supported_parallelism(job_config, world_size: int) -> None:
    parallelism = job_config.parallelism
    if (parallelism.tensor_parallel_degree, parallelism.pipeline_parallel_degree,
            parallelism.expert_parallel_degree) != (1, 1, 1):
        raise ConfigError(
            "titan_upipe train specs support FSDP (parallelism.data_parallel_shard_degree) and "
            "context parallelism only: set parallelism.tensor_parallel_degree, "
            "pipeline_parallel_degree and expert_parallel_degree to 1"
        )
    replicas = parallelism.data_parallel_replicate_degree
    # TorchTitan shards over dp_shard x CP; without either, replicas alone are DDP, which
    # parallelize refuses only after the process groups started
    if replicas > 1 and _degrees_are_valid(parallelism) and not world_size_problem(parallelism, world_size) \
            and data_parallel_shard_degree(parallelism, world_size) == 1 and parallelism.context_parallel_degree == 1:
        raise ConfigError(
            f"parallelism.data_parallel_replicate_degree = {replicas} without sharding (DDP) is not supported by "
            "titan_upipe: shard instead with parallelism.data_parallel_shard_degree (FSDP), or shard within each "
            "replica as well (HSDP: data_parallel_shard_degree of 2 or more)")


def model_heads(job_config) -> tuple[int, int]:
    """(query heads, KV heads) of the configured flavor."""
    args = flavor_args(job_config, update=False)
    return args.n_heads, args.n_kv_heads or args.n_heads


LAYOUT_ATTRIBUTE = "_titan_upipe_cp_layout"
"""Where ``cp_layout`` keeps a job config's layout, with the settings it was built from."""


def cp_layout(job_config) -> CPLayout:
    """The job's context-parallel layout (``model.converters``, ``parallelism``, ``[upipe]``, the
    flavor's heads, ``training.seq_len``), validated (raises ConfigError). Built once per job
    config and kept on it: the job checks build it (``check_job``, before any process group) and
    the job's spec carries that same object (``job_spec``) to the converters, the trainer, the
    validation loss and the tools. It is built again only if one of those settings changed since."""
    mode = cp_mode(job_config.model.converters)
    n_heads, n_kv_heads = model_heads(job_config) if mode is not None else (0, 0)
    settings = (mode, job_config.parallelism.context_parallel_degree, job_config.upipe.ulysses_degree, n_heads,
                n_kv_heads, job_config.upipe.heads_per_stage, job_config.training.seq_len)
    built = vars(job_config).get(LAYOUT_ATTRIBUTE)
    if built is None or built[0] != settings:
        built = (settings, CPLayout(*settings))
        vars(job_config)[LAYOUT_ATTRIBUTE] = built
    return built[1]


def check_context_parallel(job_config, world_size: int) -> None:
    """The job's one CP layout, built and validated (the kernel it needs:
    ``model.check_attention_backend``). A degree, Ulysses degree or U its rules refuse is a
    ``cp_layout.LayoutError``: the runner of the job checks names the values that pass them all."""
    cp_layout(job_config)


def check_tsp(job_config, world_size: int) -> None:
    """``model.converters = ["tsp"]``: ``spec.tsp_shards.tsp_job_problems`` (module ``titan_upipe.tsp``),
    every problem in one ConfigError."""
    converters = list(job_config.model.converters)
    if cp_mode(converters) != CPMode.TSP:
        return
    par = job_config.parallelism
    args = flavor_args(job_config, update=False)
    problems = tsp_job_problems(
        args.n_heads, args.n_kv_heads or args.n_heads, ffn_hidden_dim(args), par.context_parallel_degree,
        kv_heads_per_bucket=job_config.tsp.kv_heads_per_bucket, converters=converters,
        data_parallel=data_parallel_degree(par, world_size), param_offload=job_config.training.enable_cpu_offload,
        state_on_host=plugin_fields(job_config.optimizer, OptimizerHostState).state_on_host)
    if problems:
        raise ConfigError("; ".join(problems))
