"""Job-level checks that run before any process group starts.

Every problem is reported as a :class:`~titan_upipe.errors.ConfigError` naming the
setting and the valid choices. ``titan_upipe.train`` calls :func:`check_job` right
after parsing the config; ``parallelize_fn`` calls it again so that launches through
``torchtitan.train`` are covered too (there it runs after process-group start, but
still before any collective of ours). The context-parallel settings are read once, into
a :class:`~titan_upipe.parallel.cp_layout.CPLayout` (:func:`cp_layout`).
"""

from __future__ import annotations

import torchtitan.tools.utils as titan_utils
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.hf_datasets.text_datasets import DATASETS
from torchtitan.protocols import model_converter

from titan_upipe.attention.backends import BACKENDS, BackendChoice, choose_backend
from titan_upipe.attention.documents import document_kernel_problem
from titan_upipe.data.builders import PLUGIN_DATASETS
from titan_upipe.data.local_text import LOCAL_TEXT_DATASET
from titan_upipe.data.synthetic import COPY_DATASET, DOCS_DATASET, SYNTHETIC_DATASETS
from titan_upipe.errors import ConfigError, did_you_mean
from titan_upipe.parallel.cp_layout import CP_MODES, CPLayout, CPMode, cp_mode, divisors
from titan_upipe.torchtitan_0_2.cp_inputs import MASK_TYPES
from titan_upipe.torchtitan_0_2.flavors import ffn_hidden_dim, flavor_args, head_dim, packs_documents
from titan_upipe.transforms import TRANSFORM_NAMES
from titan_upipe.transforms.fused_ce import resolve_backend
from titan_upipe.tsp.shards import tsp_problems

__all__ = ["JOB_CHECKS", "PLUGIN_IMPORT", "attention_backend_choice", "check_job", "compute_dtype", "config_warnings",
           "cp_layout"]


def degrees_besides_shard(parallelism) -> int:
    """The product of every parallel degree but ``data_parallel_shard_degree``."""
    return (parallelism.context_parallel_degree * parallelism.tensor_parallel_degree
            * parallelism.pipeline_parallel_degree * parallelism.data_parallel_replicate_degree)


DEGREES_BESIDES_SHARD = ("context_parallel_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
                         "data_parallel_replicate_degree")
"""The ``[parallelism]`` degrees whose product the world size is a multiple of."""


def check_parallel_degrees(parallelism) -> None:
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
        check_parallel_degrees(parallelism)
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


def _fitting_cp_degrees(parallelism, world_size: int, shard: int = 1) -> list[int]:
    """``context_parallel_degree`` values that, with the other degrees (and ``shard`` FSDP ranks),
    fit ``world_size``: every divisor of what the others leave."""
    others = degrees_besides_shard(parallelism) // parallelism.context_parallel_degree * shard
    return [] if world_size % others else divisors(world_size // others)


def _not_a_multiple(parallelism, world_size: int) -> str:
    """dp_shard = -1: the world size must be a multiple of the other degrees."""
    terms = _degree_terms(parallelism)
    unit = degrees_besides_shard(parallelism)
    product = " x ".join(terms) + (f" = {unit}" if len(terms) > 1 else "")
    ranks = f"{world_size} ranks are" if world_size != 1 else "1 rank is"
    message = f"{ranks} not a multiple of {product}: launch {_neighbouring_multiples(unit, world_size)} ranks"
    if cp_degrees := _fitting_cp_degrees(parallelism, world_size):
        message += f", or set context_parallel_degree to one of {', '.join(map(str, cp_degrees))}"
    return message


def _shard_mismatch(parallelism, world_size: int) -> str:
    """A fixed dp_shard: the degrees multiply to a world size other than the launched one."""
    shard = parallelism.data_parallel_shard_degree
    fixed = degrees_besides_shard(parallelism)
    terms = [*_degree_terms(parallelism), f"data_parallel_shard_degree {shard}"]
    message = (f"{' x '.join(terms)} need {fixed * shard} ranks, but {world_size} are launched: launch "
               f"{fixed * shard} ranks")
    if world_size % fixed == 0:
        return message + (f", or set data_parallel_shard_degree to {world_size // fixed} (or -1: the ranks the "
                          "other degrees leave)")
    if cp_degrees := _fitting_cp_degrees(parallelism, world_size, shard):
        message += f", or set context_parallel_degree to one of {', '.join(map(str, cp_degrees))}"
    return message


def world_size_problem(parallelism, world_size: int) -> str | None:
    """What is wrong with launching these degrees on ``world_size`` ranks, and what to change;
    None when they fit (or when a degree is itself invalid: :func:`check_parallel_degrees`)."""
    if not _degrees_are_valid(parallelism):
        return None
    fixed = degrees_besides_shard(parallelism)
    if parallelism.data_parallel_shard_degree == -1:
        return None if world_size % fixed == 0 else _not_a_multiple(parallelism, world_size)
    return None if fixed * parallelism.data_parallel_shard_degree == world_size else _shard_mismatch(
        parallelism, world_size)


def check_world_size(parallelism, world_size: int) -> None:
    if problem := world_size_problem(parallelism, world_size):
        raise ConfigError(problem)


def data_parallel_degree(parallelism, world_size: int) -> int | None:
    """Ranks that read different batches (dp_replicate x dp_shard, -1 resolved); None when the
    degrees do not fit ``world_size``."""
    if not _degrees_are_valid(parallelism) or world_size_problem(parallelism, world_size):
        return None
    shard = parallelism.data_parallel_shard_degree
    if shard == -1:
        shard = world_size // degrees_besides_shard(parallelism)
    return shard * parallelism.data_parallel_replicate_degree


POSITIVE_TRAINING_KEYS = {
    "local_batch_size": "sequences per data-parallel rank",
    "steps": "optimizer steps to run",
    "seq_len": "tokens per sequence",
}
"""``[training]`` counts that must be at least 1, with what a value means (TorchTitan refuses a
batch of 0 only after the process group starts, and exits 0 after 0 steps)."""


def check_training_counts(training) -> None:
    for key, meaning in POSITIVE_TRAINING_KEYS.items():
        if (value := getattr(training, key)) < 1:
            raise ConfigError(f"training.{key} = {value} is invalid ({meaning}): valid values are 1 or more")


def check_global_batch(training, parallelism, world_size: int) -> None:
    """``global_batch_size`` is -1 (one step of local x data-parallel sequences) or a multiple of it
    (that many gradient-accumulation micro-batches)."""
    dp = data_parallel_degree(parallelism, world_size)
    if training.global_batch_size < 0 or dp is None or training.local_batch_size < 1:
        return
    unit = training.local_batch_size * dp
    if training.global_batch_size == 0 or training.global_batch_size % unit:
        raise ConfigError(
            f"training.global_batch_size = {training.global_batch_size} is not a multiple of local_batch_size "
            f"{training.local_batch_size} x data-parallel degree {dp} = {unit}: use a multiple of {unit} (global / {unit} "
            f"gradient-accumulation micro-batches per step) or -1 (= {unit}, one micro-batch per step)"
        )


def check_training(job_config, world_size: int) -> None:
    """Batch sizes and step count before any process group starts."""
    check_training_counts(job_config.training)
    check_global_batch(job_config.training, job_config.parallelism, world_size)


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


def check_context_parallel(job_config) -> CPLayout:
    """The CP layout and the attention backend it needs; returns the layout."""
    layout = cp_layout(job_config)
    if layout.mode is not None:
        attention_backend_choice(job_config, probe=False, layout=layout)
    return layout


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
    bucket, kv_per_rank = job_config.tsp.kv_heads_per_bucket, n_kv_heads // degree
    if bucket and kv_per_rank and kv_per_rank % bucket:
        problems.append(f"tsp.kv_heads_per_bucket = {bucket} does not divide the {kv_per_rank} KV heads per rank "
                        f"(n_kv_heads {n_kv_heads} / {degree}): use 0 or one of {divisors(kv_per_rank)}")
    problems += [f"model.converters has 'tsp' and {name!r}: {why}; remove {name!r}"
                 for name, why in TSP_CONFLICTS.items() if name in converters]
    if data_parallel_degree(par, world_size) not in (None, 1):
        problems.append("tsp shards the blocks' weights over the CP ranks; data parallelism on top (FSDP of those "
                        "shards over more ranks) is not built yet: set parallelism.data_parallel_shard_degree = 1 "
                        "and data_parallel_replicate_degree = 1 (world size = context_parallel_degree)")
    if job_config.training.enable_cpu_offload:
        problems.append("training.enable_cpu_offload with tsp is not supported (FSDP's parameter offload does not "
                        "manage the TSP-sharded weights): set training.enable_cpu_offload = false")
    if getattr(job_config.optimizer, "state_on_host", False):
        problems.append("optimizer.state_on_host with tsp is not supported yet (its sharded weights are DTensors "
                        "on the TSP mesh, not FSDP shards): set optimizer.state_on_host = false")
    if problems:
        raise ConfigError("; ".join(problems))


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
    varlen = titan_utils.device_type == "cuda" and packs_documents(args)
    return choose_backend(job_config.upipe.attention_backend, compute_dtype(job_config), ring=layout.has_ring,
                          probe=probe, head_dim=head_dim(args), varlen=varlen)


# ---------------------------------------------------------------------------- memory transforms


def check_converter_names(converters: list[str]) -> None:
    """Names TorchTitan knows plus the plugin's own (known here whether or not
    ``registry.register_plugin`` has run yet)."""
    known = sorted({*model_converter._registry_model_converter_cls, *CP_MODES, *TRANSFORM_NAMES})
    unknown = [name for name in converters if name not in known]
    if unknown:
        hints = [hint for name in unknown if (hint := did_you_mean(name, known))]
        raise ConfigError(f"model.converters has unknown name(s) {unknown}: valid values are {', '.join(known)}"
                          + "".join(f"; {hint}" for hint in hints))
    repeated = sorted({name for name in converters if converters.count(name) > 1})
    if repeated:
        raise ConfigError(f"model.converters names {repeated} more than once: list each converter once")


def check_offload(job_config) -> None:
    ac = job_config.activation_checkpoint
    late = getattr(ac, "prefetch_after_attention", False)
    if not isinstance(late, bool):
        raise ConfigError(f"invalid activation_checkpoint.prefetch_after_attention = {late!r}: valid values are "
                          "true, false")
    resident = getattr(ac, "resident_blocks", 0)
    if isinstance(resident, bool) or not isinstance(resident, int) or resident < 0:
        raise ConfigError(f"invalid activation_checkpoint.resident_blocks = {resident!r}: valid values are 0 (every "
                          "block input offloaded) or a positive number of last blocks kept on the device")
    if not getattr(ac, "cpu_offload", False):
        if resident:
            raise ConfigError("activation_checkpoint.resident_blocks keeps some offloaded block inputs on the device: "
                              "set activation_checkpoint.cpu_offload = true (and mode = \"full\") or drop it")
        if late:  # it would change nothing: no block input is offloaded
            raise ConfigError("activation_checkpoint.prefetch_after_attention = true times the prefetch of offloaded "
                              "block inputs: set activation_checkpoint.cpu_offload = true (and mode = \"full\") "
                              "or drop it")
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


def check_optimizer(job_config) -> None:
    """``[optimizer] state_on_host``: a bool, with AdamW stepped after backward (no early step in
    backward, no TorchFT wrapper), which is what ``titan_upipe.torchtitan_0_2.optimizers`` builds."""
    optimizer = job_config.optimizer
    on_host = getattr(optimizer, "state_on_host", False)
    if not isinstance(on_host, bool):
        raise ConfigError(f"invalid optimizer.state_on_host = {on_host!r}: valid values are true, false")
    if not on_host:
        return
    if optimizer.name != "AdamW":
        raise ConfigError(f"optimizer.state_on_host = true runs AdamW only (got optimizer.name = {optimizer.name!r}): "
                          "valid values are \"AdamW\"; set optimizer.name = \"AdamW\" or state_on_host = false")
    if optimizer.early_step_in_backward:
        raise ConfigError("optimizer.state_on_host = true does not support optimizer.early_step_in_backward = true "
                          "(the moments are streamed once per step, after backward): valid values are false")
    if job_config.fault_tolerance.enable:
        raise ConfigError("optimizer.state_on_host = true does not support fault_tolerance.enable = true (TorchFT "
                          "wraps its own optimizer container): set one of them to false")


def check_transforms(job_config) -> None:
    """Tile sizes and backends, offload settings (converter names: ``check_converter_names``, run
    before the CP checks so that a typo is named as one); raises ConfigError."""
    transforms = getattr(job_config, "transforms", None)
    if transforms is not None:
        type(transforms).__post_init__(transforms)  # CLI/TOML values, re-checked after overrides
        if "fused_ce" in job_config.model.converters:
            resolve_backend(transforms.ce_backend)
    check_offload(job_config)


def check_validation(job_config) -> None:
    """``[validation]`` when enabled: a CP-shardable ``seq_len`` within the RoPE table, batches and
    steps that end, a dataset the plugin or TorchTitan can read."""
    validation = job_config.validation
    if not validation.enable:
        return
    if validation.local_batch_size < 1 or validation.seq_len < 1:
        raise ConfigError(f"validation.local_batch_size = {validation.local_batch_size} and validation.seq_len = "
                          f"{validation.seq_len} must both be >= 1")
    if validation.seq_len > job_config.training.seq_len:
        raise ConfigError(f"validation.seq_len = {validation.seq_len} exceeds training.seq_len = "
                          f"{job_config.training.seq_len} (the RoPE table's length): set validation.seq_len <= "
                          f"{job_config.training.seq_len}")
    cp_layout(job_config).check_length(validation.seq_len, "validation.seq_len")
    if validation.dataset not in PLUGIN_DATASETS and validation.dataset not in DATASETS:
        raise ConfigError(f"validation.dataset = {validation.dataset!r} is unknown: valid values are "
                          f"{', '.join(sorted({*PLUGIN_DATASETS, *DATASETS}))}")
    if (validation.dataset in SYNTHETIC_DATASETS) != (job_config.training.dataset in SYNTHETIC_DATASETS):
        raise ConfigError(f"validation.dataset = {validation.dataset!r} and training.dataset = "
                          f"{job_config.training.dataset!r} use different tokenizers ({', '.join(SYNTHETIC_DATASETS)} "
                          "have their own vocabulary): validate on a synthetic dataset with synthetic training data, "
                          "on text otherwise")
    if validation.dataset in PLUGIN_DATASETS:  # infinite streams
        if validation.steps < 1:
            raise ConfigError(f"validation.steps = {validation.steps} reads {validation.dataset!r} until it ends, "
                              "and it never ends (synthetic, or local files read pass after pass): set "
                              "validation.steps to the number of batches to score, e.g. 4")
        if validation.dataset == LOCAL_TEXT_DATASET and not validation.dataset_path:
            raise ConfigError('validation.dataset = "local_text" needs validation.dataset_path: a glob pattern of '
                              '.jsonl/.parquet/.txt files, e.g. "/data/heldout/*.jsonl"')


DOCUMENT_CP_MODES = tuple(mode for mode in CP_MODES if mode != CPMode.TSP)
"""CP converters whose attention reads packed-document masks (all but tsp)."""


def check_document_masking(job_config) -> None:
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
      the one this process trains on (TorchTitan's ``device_type``; CPU on a machine without one).
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
        if problem := document_kernel_problem(backend, titan_utils.device_type):
            raise ConfigError(f"{flavor} under {mode}: {problem}")


PER_PART_COMPILE_CONVERTERS = ("tiled_mlp", "tiled_rmsnorm")
"""Besides a CP converter, the converters whose blocks ``compile.enable`` compiles part by part."""


def check_compile(job_config) -> None:
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


SELECTIVE_AC_1M_GIB = {
    "upipe": (8, 118, 54, 26),
    "ulysses": (8, 163, 57, 29),
    "ring": (8, 169, 63, 35),
    "usp": (16, 86, 33, 19),
}
"""Per CP converter: (ranks, GiB per rank with selective layer AC "2", with full AC, with full AC
offloaded) of its Llama3-8B recipe at 1M tokens (``configs/llama3_8b/<converter>_1m.toml``;
planner, the selective figure extrapolated from its full/none moments and checked against the
rank emulator on CPU: ``docs/benchmarks/selective_ac.md``, ``scripts/bench_selective_ac.py``)."""


def check_activation_checkpointing(job_config) -> None:
    """``activation_checkpoint.mode = "selective"`` (TorchTitan's default when a TOML has no
    ``[activation_checkpoint]`` section, with ``selective_ac_option = "2"``) with a CP converter:
    a layer frequency k >= 2 checkpoints every k-th block and keeps the others' activations whole,
    which long contexts cannot hold (``SELECTIVE_AC_1M_GIB``); refused with the setting to use.
    ``"op"`` and k = 1 (every block checkpointed) are full AC in this plugin and pass: its
    ``parallelize`` gives TorchTitan's op-level AC no save list, so every op is recomputed
    (measured: the same bytes as full). Without a CP converter selective AC is TorchTitan's and
    passes. A ``selective_ac_option`` TorchTitan would reject at ``apply_ac`` is refused here."""
    ac = job_config.activation_checkpoint
    if ac.mode != "selective":
        return
    option = str(ac.selective_ac_option).strip()
    if option != "op" and not option.isdigit():
        raise ConfigError(f"activation_checkpoint.selective_ac_option = {option!r} is invalid: valid values are "
                          "\"op\" or a block frequency k (\"2\": every 2nd block checkpointed)")
    mode = cp_mode(list(job_config.model.converters))
    if mode is None or option == "op" or int(option) <= 1:
        return
    if mode not in SELECTIVE_AC_1M_GIB:
        raise ConfigError(
            f"activation_checkpoint.mode = \"selective\" (selective_ac_option = \"{option}\") checkpoints one block "
            f"in {option} and keeps the other blocks' activations, too many for {mode} at long contexts: set "
            "activation_checkpoint.mode = \"full\", or \"none\" for short debug runs")
    ranks, selective, full, offloaded = SELECTIVE_AC_1M_GIB[mode]
    default = "; TorchTitan's default when the TOML has no [activation_checkpoint] section" if option == "2" else ""
    raise ConfigError(
        f"activation_checkpoint.mode = \"selective\" (selective_ac_option = \"{option}\"{default}) checkpoints one "
        f"block in {option} and keeps the other blocks' activations, too many for {mode} at long contexts "
        f"(Llama3-8B, 1M tokens, {ranks} ranks: {selective} GiB per rank against {full} with full AC and {offloaded} "
        "offloaded; docs/benchmarks/selective_ac.md): set activation_checkpoint.mode = \"full\" (with "
        "activation_checkpoint.cpu_offload = true for long contexts), or \"none\" for short debug runs"
    )


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
    lambda job_config, world_size: check_parallel_degrees(job_config.parallelism),
    lambda job_config, world_size: check_supported_parallelism(job_config.parallelism),
    lambda job_config, world_size: check_world_size(job_config.parallelism, world_size),
    lambda job_config, world_size: check_training(job_config, world_size),
    lambda job_config, world_size: check_converter_names(list(job_config.model.converters)),
    lambda job_config, world_size: check_context_parallel(job_config),
    lambda job_config, world_size: check_tsp(job_config, world_size),
    lambda job_config, world_size: check_document_masking(job_config),
    lambda job_config, world_size: check_transforms(job_config),
    lambda job_config, world_size: check_validation(job_config),
    lambda job_config, world_size: check_compile(job_config),
    lambda job_config, world_size: check_activation_checkpointing(job_config),
    lambda job_config, world_size: check_optimizer(job_config),
)
"""Every job-level check as ``check(job_config, world_size)``; ``titan_upipe.validate`` runs
them all to report every problem, ``check_job`` stops at the first."""


def check_job(job_config, world_size: int) -> None:
    """All checks; raises the first problem found."""
    for check in JOB_CHECKS:
        check(job_config, world_size)
