"""Job-level checks that run before any process group starts.

Every problem is reported as a :class:`~titan_upipe.errors.ConfigError` naming the
setting and the valid choices. ``titan_upipe.train`` calls :func:`check_job` right
after parsing the config; ``parallelize_fn`` calls it again so that launches through
``torchtitan.train`` are covered too (there it runs after process-group start, but
still before any collective of ours). The context-parallel settings are read once, into
a :class:`~titan_upipe.parallel.cp_layout.CPLayout` (:func:`cp_layout`).
"""

from __future__ import annotations

from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.protocols import model_converter

from titan_upipe.attention.backends import BackendChoice, choose_backend
from titan_upipe.errors import ConfigError
from titan_upipe.flavors import flavor_args
from titan_upipe.parallel.cp_layout import CP_MODES, CPLayout, cp_mode, divisors
from titan_upipe.transforms import TRANSFORM_NAMES
from titan_upipe.transforms.fused_ce import resolve_backend

__all__ = ["JOB_CHECKS", "PLUGIN_IMPORT", "attention_backend_choice", "check_job", "compute_dtype", "config_warnings",
           "cp_layout"]


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
            f"{world_size}: valid context_parallel_degree values for {world_size} ranks are {divisors(world_size)}"
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
    args = flavor_args(job_config, update=False)
    return args.n_heads, args.n_kv_heads or args.n_heads


def cp_layout(job_config) -> CPLayout:
    """The job's context-parallel layout (``model.converters``, ``parallelism``, ``[upipe]``,
    the flavor's heads, ``training.seq_len``), validated; raises ConfigError."""
    mode = cp_mode(job_config.model.converters)
    n_heads, n_kv_heads = model_heads(job_config) if mode is not None else (0, 0)
    return CPLayout(
        mode=mode,
        cp_degree=job_config.parallelism.context_parallel_degree,
        ulysses_setting=job_config.upipe.ulysses_degree,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        heads_per_stage_setting=job_config.upipe.heads_per_stage if mode == "upipe" else 0,
        seq_len=job_config.training.seq_len,
    )


def check_context_parallel(job_config) -> CPLayout:
    """The CP layout and the attention backend it needs; returns the layout."""
    layout = cp_layout(job_config)
    if layout.mode is not None:
        attention_backend_choice(job_config, probe=False, layout=layout)
    return layout


def compute_dtype(job_config):
    """The dtype of the attention inputs in training: FSDP's parameter dtype (TorchTitan runs
    every CP job under FSDP, its mesh spanning the CP ranks)."""
    return TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]


def attention_backend_choice(job_config, probe: bool = True, layout: CPLayout | None = None) -> BackendChoice:
    """``[upipe] attention_backend`` resolved for this job (``auto`` included); a backend that
    cannot run it raises ConfigError. Ring and USP layouts need a backend whose backward
    honours the merged out/lse."""
    layout = layout or cp_layout(job_config)
    return choose_backend(job_config.upipe.attention_backend, compute_dtype(job_config), ring=layout.has_ring,
                          probe=probe)


# ---------------------------------------------------------------------------- memory transforms


def check_converter_names(converters: list[str]) -> None:
    """Names TorchTitan knows plus the plugin's own (known here whether or not
    ``registry.register_plugin`` has run yet)."""
    known = sorted({*model_converter._registry_model_converter_cls, *CP_MODES, *TRANSFORM_NAMES})
    unknown = [name for name in converters if name not in known]
    if unknown:
        raise ConfigError(f"model.converters has unknown name(s) {unknown}: valid values are {', '.join(known)}")
    repeated = sorted({name for name in converters if converters.count(name) > 1})
    if repeated:
        raise ConfigError(f"model.converters names {repeated} more than once: list each converter once")


def check_offload(job_config) -> None:
    ac = job_config.activation_checkpoint
    if not getattr(ac, "cpu_offload", False):
        return
    if ac.mode != "full":
        raise ConfigError(
            f"activation_checkpoint.cpu_offload = true needs activation_checkpoint.mode = \"full\" "
            f"(got {ac.mode!r}): offloading keeps each block's checkpointed input on the host; "
            "valid values with offload: full"
        )
    if job_config.compile.enable and "model" in job_config.compile.components:
        raise ConfigError("activation_checkpoint.cpu_offload = true does not support compile.enable with the "
                          "'model' component: set compile.enable = false or cpu_offload = false")
    if not isinstance(getattr(ac, "pin_memory", True), bool):
        raise ConfigError(f"invalid activation_checkpoint.pin_memory = {ac.pin_memory!r}: valid values are true, false")


def check_transforms(job_config) -> None:
    """Converter names, tile sizes and backends, offload settings; raises ConfigError."""
    check_converter_names(list(job_config.model.converters))
    transforms = getattr(job_config, "transforms", None)
    if transforms is not None:
        type(transforms).__post_init__(transforms)  # CLI/TOML values, re-checked after overrides
        if "fused_ce" in job_config.model.converters:
            resolve_backend(transforms.ce_backend)
    check_offload(job_config)


PLUGIN_IMPORT = "titan_upipe.plugin"
"""``experimental.custom_import`` that registers the plugin under ``-m torchtitan.train``."""


def config_warnings(job_config) -> list[str]:
    """Settings that run under ``-m titan_upipe.train`` but not under every launch.

    ``custom_import = "titan_upipe"`` registered the plugin while importing the package did; now
    it registers nothing, so ``-m torchtitan.train`` would fail to find the train specs (before
    any check of ours runs). ``titan_upipe.validate`` prints these."""
    if getattr(job_config.experimental, "custom_import", "") == "titan_upipe":
        return [f"experimental.custom_import = 'titan_upipe' no longer registers the plugin (importing the package "
                f"has no side effects): -m torchtitan.train needs {PLUGIN_IMPORT!r}; -m titan_upipe.train "
                "registers it either way"]
    return []


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
