"""Job checks of ``[parallelism]`` and the context-parallel layout it gives (with ``[upipe]``, ``[tsp]``
and the flavor's heads): degrees, world size, the one ``CPLayout`` of the job."""

from __future__ import annotations

from collections.abc import Callable

from titan_upipe.errors import ConfigError
from titan_upipe.parallel.cp_layout import CPLayout, CPMode, cp_mode, divisors, layout_problem
from titan_upipe.torchtitan_0_2.config import (
    OptimizerHostState,
    plugin_fields,
)
from titan_upipe.torchtitan_0_2.flavors import ffn_hidden_dim, flavor_args
from titan_upipe.tsp.shards import bucket_problems, tsp_problems


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


def _neighbouring_multiples(unit: int, world_size: int) -> str:
    """``"2 or 4"``: the multiples of ``unit`` just below and above ``world_size`` (below only if > 0)."""
    below = world_size // unit * unit
    return f"{below} or {below + unit}" if below else str(below + unit)


CPDegreeFits = Callable[[int], bool]
"""Whether ``context_parallel_degree = c`` fits the rest of the job (:func:`cp_degree_fits`)."""


def _ranks_besides_cp(parallelism, shard: int) -> int:
    """Ranks per CP group: every degree but CP's, with ``shard`` FSDP ranks."""
    return degrees_besides_shard(parallelism) // parallelism.context_parallel_degree * shard


def _fitting_cp_degrees(parallelism, world_size: int, shard: int = 1, fits: CPDegreeFits | None = None) -> list[int]:
    """``context_parallel_degree`` values that, with the other degrees (and ``shard`` FSDP ranks),
    fit ``world_size`` (every divisor of what the others leave) and, where ``fits`` is given, the
    rest of the job."""
    others = _ranks_besides_cp(parallelism, shard)
    if world_size % others:
        return []
    return [c for c in divisors(world_size // others) if fits is None or fits(c)]


def _cp_degree_advice(parallelism, world_size: int, shard: int, fits: CPDegreeFits | None) -> str:
    """``"set context_parallel_degree to one of 2, 4"``: the degrees that fit the launch and the job;
    where the launch leaves room for some but none fits the job, a note saying so ('' otherwise)."""
    if cp_degrees := _fitting_cp_degrees(parallelism, world_size, shard, fits):
        values = f"one of {', '.join(map(str, cp_degrees))}" if len(cp_degrees) > 1 else str(cp_degrees[0])
        return f"set context_parallel_degree to {values}"
    if fits is None or world_size % _ranks_besides_cp(parallelism, shard):
        return ""
    return f"(no context_parallel_degree fits both {world_size} ranks and this job's heads, [upipe] settings and seq_len)"


def _fixes(launch: str, parallelism, world_size: int, shard: int, fits: CPDegreeFits | None) -> str:
    """``"launch 4 ranks, or set context_parallel_degree to 2"``; the launch is advised only where the
    configured CP degree fits the job (more ranks would not help a degree the heads refuse)."""
    advice = _cp_degree_advice(parallelism, world_size, shard, fits)
    if fits is not None and not fits(parallelism.context_parallel_degree):
        return advice or f"no context_parallel_degree fits this job on {world_size} ranks"
    if advice.startswith("("):
        return f"{launch} {advice}"
    return f"{launch}, or {advice}" if advice else launch


def _not_a_multiple(parallelism, world_size: int, fits: CPDegreeFits | None) -> str:
    """dp_shard = -1: the world size must be a multiple of the other degrees."""
    terms = _degree_terms(parallelism)
    unit = degrees_besides_shard(parallelism)
    product = " x ".join(terms) + (f" = {unit}" if len(terms) > 1 else "")
    ranks = f"{world_size} ranks are" if world_size != 1 else "1 rank is"
    launch = f"launch {_neighbouring_multiples(unit, world_size)} ranks"
    return f"{ranks} not a multiple of {product}: " + _fixes(launch, parallelism, world_size, 1, fits)


def _shard_mismatch(parallelism, world_size: int, fits: CPDegreeFits | None) -> str:
    """A fixed dp_shard: the degrees multiply to a world size other than the launched one."""
    shard = parallelism.data_parallel_shard_degree
    fixed = degrees_besides_shard(parallelism)
    terms = [*_degree_terms(parallelism), f"data_parallel_shard_degree {shard}"]
    message = f"{' x '.join(terms)} need {fixed * shard} ranks, but {world_size} are launched: "
    if world_size % fixed == 0:
        return message + (f"launch {fixed * shard} ranks, or set data_parallel_shard_degree to {world_size // fixed} "
                          "(or -1: the ranks the other degrees leave)")
    return message + _fixes(f"launch {fixed * shard} ranks", parallelism, world_size, shard, fits)


def world_size_problem(parallelism, world_size: int, fits: CPDegreeFits | None = None) -> str | None:
    """What is wrong with launching these degrees on ``world_size`` ranks, and what to change
    (a ``context_parallel_degree`` suggested only where ``fits`` accepts it: :func:`cp_degree_fits`);
    None when they fit (or when a degree is itself invalid: :func:`check_parallel_degrees`)."""
    if not _degrees_are_valid(parallelism):
        return None
    fixed = degrees_besides_shard(parallelism)
    if parallelism.data_parallel_shard_degree == -1:
        return None if world_size % fixed == 0 else _not_a_multiple(parallelism, world_size, fits)
    return None if fixed * parallelism.data_parallel_shard_degree == world_size else _shard_mismatch(
        parallelism, world_size, fits)


def cp_degree_fits(job_config) -> CPDegreeFits:
    """Whether a ``context_parallel_degree`` fits the rest of the job: the layout
    (``parallel.cp_layout.layout_problem``: the converter, ``[upipe] ulysses_degree``, the flavor's
    query and KV heads, U, ``training.seq_len``) and, under tsp, the heads and FFN width it splits.
    A mistake in those settings themselves (an unknown flavor) is another check's: then every
    degree is taken to fit."""
    try:
        mode = cp_mode(list(job_config.model.converters))
        args = flavor_args(job_config, update=False) if mode is not None else None
    except ConfigError:
        return lambda degree: True
    n_heads, n_kv_heads = (args.n_heads, args.n_kv_heads or args.n_heads) if args is not None else (0, 0)
    upipe, seq_len = job_config.upipe, max(job_config.training.seq_len, 0)

    def fits(degree: int) -> bool:
        if layout_problem(mode, degree, upipe.ulysses_degree, n_heads, n_kv_heads, upipe.heads_per_stage, seq_len):
            return False
        return mode is not CPMode.TSP or not tsp_problems(n_heads, n_kv_heads, ffn_hidden_dim(args), degree)

    return fits


def check_world_size(job_config, world_size: int) -> None:
    if problem := world_size_problem(job_config.parallelism, world_size, cp_degree_fits(job_config)):
        raise ConfigError(problem)


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
    the converters, ``parallelize``, the trainer, the validation loss and the tools read that same
    object. It is built again only if one of those settings changed since."""
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
    ``model.check_attention_backend``)."""
    cp_layout(job_config)


TSP_CONFLICTS = {
    "tiled_mlp": "tsp replaces the feed-forward by its weight ring (already F/D wide per step)",
    "fused_rope": "tsp rotates Q/K with the model's full RoPE table",
}
"""Converters ``tsp`` does not compose with, and why."""


def check_tsp(job_config, world_size: int) -> None:
    """``model.converters = ["tsp"]``: the degree splits the query heads, the KV heads and the FFN
    width, ``[tsp]`` fits, and nothing it does not compose with is set (module ``titan_upipe.tsp``);
    every problem in one ConfigError. Sequence lengths (multiples of ``2 D``) are CPLayout's."""
    converters = list(job_config.model.converters)
    if cp_mode(converters) != CPMode.TSP:
        return
    par = job_config.parallelism
    degree = par.context_parallel_degree
    args = flavor_args(job_config, update=False)
    n_heads, n_kv_heads = args.n_heads, args.n_kv_heads or args.n_heads
    # sequence lengths: CPLayout's 2 x degree (check_context_parallel, check_validation)
    problems = tsp_problems(n_heads, n_kv_heads, ffn_hidden_dim(args), degree)
    problems += bucket_problems(n_kv_heads, degree, job_config.tsp.kv_heads_per_bucket)
    problems += [f"model.converters has 'tsp' and {name!r}: {why}; remove {name!r}"
                 for name, why in TSP_CONFLICTS.items() if name in converters]
    if data_parallel_degree(par, world_size) not in (None, 1):
        problems.append("tsp shards the blocks' weights over the CP ranks; data parallelism on top (FSDP of those "
                        "shards over more ranks) is not built yet: set parallelism.data_parallel_shard_degree = 1 "
                        "and data_parallel_replicate_degree = 1 (world size = context_parallel_degree)")
    if job_config.training.enable_cpu_offload:
        problems.append("training.enable_cpu_offload with tsp is not supported (FSDP's parameter offload does not "
                        "manage the TSP-sharded weights): set training.enable_cpu_offload = false")
    if plugin_fields(job_config.optimizer, OptimizerHostState).state_on_host:
        problems.append("optimizer.state_on_host with tsp is not supported yet (its sharded weights are DTensors "
                        "on the TSP mesh, not FSDP shards): set optimizer.state_on_host = false")
    if problems:
        raise ConfigError("; ".join(problems))
