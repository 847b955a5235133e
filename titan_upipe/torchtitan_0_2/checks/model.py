"""Job checks of ``[model]`` (converters, the flavor's masks), ``[transforms]``, ``[compile]`` and the
attention kernel ``[upipe] attention_backend`` resolves to."""

from __future__ import annotations

from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.protocols import model_converter

from titan_upipe.attention.backends import BACKENDS, BackendChoice, choose_backend
from titan_upipe.attention.documents import document_kernel_problem
from titan_upipe.data.synthetic import COPY_DATASET, DOCS_DATASET
from titan_upipe.errors import ConfigError, did_you_mean
from titan_upipe.spec.cp_layout import CP_MODES, CPLayout, CPMode, cp_mode
from titan_upipe.torchtitan_0_2.checks.ignored import ignored_settings
from titan_upipe.torchtitan_0_2.checks.parallelism import cp_layout
from titan_upipe.torchtitan_0_2.cp_inputs import MASK_TYPES
from titan_upipe.torchtitan_0_2.flavors import flavor_args, head_dim, packs_documents
from titan_upipe.torchtitan_common.cpu_runtime import job_device
from titan_upipe.transforms import TRANSFORM_NAMES
from titan_upipe.transforms.fused_ce import resolve_backend


def compute_dtype(job_config):
    """The dtype of the attention inputs in training: FSDP's parameter dtype (TorchTitan runs
    every CP job under FSDP, its mesh spanning the CP ranks)."""
    return TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]


def attention_backend_choice(job_config, probe: bool = True, layout: CPLayout | None = None) -> BackendChoice:
    """``[upipe] attention_backend`` resolved for this job (``auto`` included); a backend that
    cannot run it raises ConfigError. Ring and USP layouts need a backend whose backward
    honours the merged out/lse."""
    layout = layout or cp_layout(job_config)
    # packed documents on CUDA need a varlen kernel: auto passes over those without one
    args = flavor_args(job_config, update=False)
    varlen = job_device(job_config) == "cuda" and packs_documents(args)
    return choose_backend(job_config.upipe.attention_backend, compute_dtype(job_config), ring=layout.has_ring,
                          probe=probe, head_dim=head_dim(args), varlen=varlen)


def check_attention_backend(job_config, world_size: int) -> None:
    """The kernel ``[upipe] attention_backend`` resolves to runs the job (dtype, head_dim, ring,
    packed documents), read from package metadata only (no import, no CUDA query)."""
    if cp_layout(job_config).mode is not None:
        attention_backend_choice(job_config, probe=False)


def check_converter_names(job_config, world_size: int) -> None:
    """Names TorchTitan knows plus the plugin's own (known here whether or not
    ``registry.register_plugin`` has run yet)."""
    converters = list(job_config.model.converters)
    known = sorted({*model_converter._registry_model_converter_cls, *CP_MODES, *TRANSFORM_NAMES})
    unknown = [name for name in converters if name not in known]
    if unknown:
        hints = [hint for name in unknown if (hint := did_you_mean(name, known))]
        raise ConfigError(f"model.converters has unknown name(s) {unknown}: valid values are {', '.join(known)}"
                          + "".join(f"; {hint}" for hint in hints))
    repeated = sorted({name for name in converters if converters.count(name) > 1})
    if repeated:
        raise ConfigError(f"model.converters names {repeated} more than once: list each converter once")


def check_transforms(job_config, world_size: int) -> None:
    """Tile sizes and backends (converter names: ``check_converter_names``, run before the CP
    checks so that a typo is named as one; offload settings: ``training.check_offload``)."""
    transforms = getattr(job_config, "transforms", None)
    if transforms is not None:
        type(transforms).__post_init__(transforms)  # CLI/TOML values, re-checked after overrides
        if "fused_ce" in job_config.model.converters:
            resolve_backend(transforms.ce_backend)


DOCUMENT_CP_MODES = tuple(mode for mode in CP_MODES if mode != CPMode.TSP)
"""CP converters whose attention reads packed-document masks (all but tsp)."""


def check_document_masking(job_config, world_size: int) -> None:
    """The flavor's ``attn_mask_type`` with the attention and data that will run it. Refused, because
    each would train plain causal attention (or stop later with another library's error):

    * a mask type TorchTitan's Llama3/Qwen3 do not know, under a CP converter or with ``attn_type``
      ``sdpa`` (whose TorchTitan path reads no mask);
    * ``block_causal`` with ``attn_type = "sdpa"`` and no CP converter: TorchTitan builds document
      masks for flex/varlen only (with a CP converter the plugin builds them, whatever the type);
    * ``block_causal`` with ``attn_type = "varlen"`` under a CP converter: TorchTitan's Llama3 args
      refuse varlen with CP (``update_from_config``) before conversion replaces the kernel;
    * ``block_causal`` on ``synthetic_copy`` (training or validation), which has no EOS: every
      row would be one document;
    * ``block_causal`` under a CP converter on CUDA with an attention backend (``auto`` resolved)
      that has no varlen kernel (``attention.documents.document_kernel_problem``). The device is
      the one the job trains on (``cpu_runtime.job_device``: this process's, or the compute nodes'
      that ``validate`` names on a login node), the kernels the installed packages provide.
    """
    args = flavor_args(job_config, update=False)
    attn_type = getattr(args, "attn_type", "sdpa")
    mask_type = getattr(args, "attn_mask_type", "causal")
    mode = cp_mode(list(job_config.model.converters))
    flavor = (f"model.flavor = {job_config.model.flavor!r} (attn_type {attn_type!r}, attn_mask_type "
              f"{mask_type!r})")
    if mask_type not in MASK_TYPES and (mode is not None or attn_type == "sdpa"):
        runner = f"the {mode} converter" if mode else "TorchTitan's sdpa attention"
        raise ConfigError(f"{flavor}: {runner} runs attn_mask_type {' or '.join(MASK_TYPES)} only (any other would "
                          "run as causal): pick a flavor with one of them")
    if mask_type != "block_causal":
        return
    if mode is CPMode.TSP:
        raise ConfigError(f"{flavor} under tsp: TSP attention is causal over the whole sequence (no document "
                          "masks yet): use a causal flavor (e.g. debug)")
    if mode is None and attn_type == "sdpa":
        raise ConfigError(
            f"{flavor} without a context-parallel converter: TorchTitan builds document masks for attn_type flex "
            "and varlen only, so sdpa would attend across documents; use a flavor with attn_type 'flex' or 'varlen' "
            f"(e.g. debug_flex, 8B_flex), or add a CP converter ({', '.join(DOCUMENT_CP_MODES)}), which reads block_causal "
            "under any attn_type")
    if mode is not None and attn_type == "varlen":
        try:
            flavor_args(job_config)  # TorchTitan's update_from_config, as the trainer will run it
        except NotImplementedError:
            raise ConfigError(
                f"{flavor}: TorchTitan's model args refuse attn_type 'varlen' with context_parallel_degree "
                f"{job_config.parallelism.context_parallel_degree} before the {mode} converter replaces the kernel; "
                "use the flavor's flex twin (e.g. 8B_flex): the converted attention reads the same block_causal "
                "documents under any attn_type") from None
    validation = job_config.validation
    datasets = [("training.dataset", job_config.training.dataset)]
    if validation.enable:
        datasets.append(("validation.dataset", validation.dataset))
    for key, dataset in datasets:
        if dataset == COPY_DATASET:
            raise ConfigError(
                f"{flavor} with {key} = {COPY_DATASET!r}, which has no EOS token: every row would be one document "
                f"(plain causal attention); use {DOCS_DATASET!r} (packed documents) or a causal flavor (e.g. debug)")
    if mode is not None:
        backend = BACKENDS[attention_backend_choice(job_config, probe=False).name]
        if problem := document_kernel_problem(backend, job_device(job_config)):
            raise ConfigError(f"{flavor} under {mode}: {problem}")


PER_PART_COMPILE_CONVERTERS = ("tiled_mlp", "tiled_rmsnorm")
"""Besides a CP converter, the converters whose blocks ``compile.enable`` compiles part by part."""


def check_compile(job_config, world_size: int) -> None:
    """``compile.enable`` with the ``model`` component on a block the plugin converts (a CP
    converter, ``tiled_mlp``, ``tiled_rmsnorm``) compiles the block's norms and feed-forward, not
    the block (``titan_upipe.torchtitan_0_2.compile_parts``): ``activation_checkpoint.mode = "memory_budget"``,
    which budgets a compiled block's activations, would have no block graph to act on."""
    compile_config, converters = job_config.compile, list(job_config.model.converters)
    if not (compile_config.enable and "model" in compile_config.components):
        return
    per_part = cp_mode(converters) is not None or any(name in converters for name in PER_PART_COMPILE_CONVERTERS)
    if per_part and job_config.activation_checkpoint.mode == "memory_budget":
        raise ConfigError(
            "activation_checkpoint.mode = \"memory_budget\" with compile.enable needs whole compiled blocks, but with "
            f"model.converters {converters} only each block's norms and feed-forward are compiled (the attention "
            "and tiled modules stay eager): valid values here are none, full (and selective with selective_ac_option "
            "= \"op\" or \"1\" where a CP converter is set: the same as full)"
        )


PLUGIN_IMPORT = "titan_upipe.plugin"
"""``experimental.custom_import`` that registers the plugin under ``-m torchtitan.train``."""


def config_warnings(job_config) -> list[str]:
    """Settings that run, but not as written: ``titan_upipe.validate`` prints these, and the
    trainer should log them once (rank 0) at launch.

    * Settings with no effect in this job's layout (``checks.ignored.ignored_settings``).
    * ``custom_import = "titan_upipe"`` registered the plugin while importing the package did; now
      it registers nothing, so ``-m torchtitan.train`` would fail to find the train specs (before
      any check of ours runs)."""
    warnings = ignored_settings(job_config)
    if getattr(job_config.experimental, "custom_import", "") == "titan_upipe":
        warnings.append(f"experimental.custom_import = 'titan_upipe' no longer registers the plugin (importing the "
                        f"package has no side effects): -m torchtitan.train needs {PLUGIN_IMPORT!r}; "
                        "-m titan_upipe.train registers it either way")
    return warnings
