"""``JobSpec``: one training job, decided once and passed down (pure values, no torch, no TorchTitan).

Each TorchTitan adapter builds it from its own config, in one place (``torchtitan_0_2.job_spec`` from a
``JobConfig``, ``torchtitan_0_3.job_spec`` from a recipe's ``Trainer.Config``: equal for the same
recipe); the planner (``plan.spec_input``) reads the spec, never the config; on 0.2 the CP converters,
the trainer and the validation loss read it through the launch's ``launched_job``, the tools through
``load_job`` (``docs/architecture.md``).

==================  =====================================================================
group               fields
==================  =====================================================================
model               ``model`` (``ModelDims``: heads, KV heads, head_dim, widths, layers,
                    vocab, rotary kind, qk-norm), ``documents`` (packed, block-causal)
sequence, ranks     ``seq_len``, ``local_batch``, ``world_size``; ``layout`` (``CPLayout``:
                    mode, degrees, U and sequence divisor, the one the job checks built)
kernel, documents   ``attention_backend``, ``document_balance``, ``document_min_split``
dtypes              ``param_dtype``, ``reduce_dtype`` (torch's names: ``"bfloat16"``)
transforms          ``tiled_mlp``, ``tiled_rmsnorm``, ``fused_rope``, ``fused_ce`` and tiles
memory              activation checkpointing and its offload, optimizer state on the host,
                    keep-attention (setting and, where known, the plan), async checkpoints
TSP                 ``tsp_kv_heads_per_bucket``, ``tsp_overlap``, ``tsp_mlp_recompute``
==================  =====================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_upipe.spec.cp_layout import CPLayout, CPMode
from titan_upipe.spec.keep_attention import KeepAttentionPlan
from titan_upipe.spec.model_dims import ModelDims
from titan_upipe.spec.settings import DEFAULT_MIN_SPLIT, DTYPES


@dataclass(frozen=True)
class JobSpec:
    """One job: the model's shape and every setting the plugin's layers act on (module table)."""

    model: ModelDims
    seq_len: int
    local_batch: int
    world_size: int
    """The job's ranks: the launch's ``WORLD_SIZE``, or the product of the configured degrees."""
    layout: CPLayout
    """The CP layout (mode, degrees, U, sequence divisor), validated when it was built: the adapter
    passes the one its job checks built, so a job has one ``CPLayout``."""
    documents: bool = False
    attention_backend: str = "auto"
    document_balance: str = "documents"
    document_min_split: int = DEFAULT_MIN_SPLIT
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    tiled_mlp: bool = False
    tiled_rmsnorm: bool = False
    fused_rope: bool = False
    fused_ce: bool = False
    rope_tables: int = 1
    """Full-length RoPE tables a rank holds without ``fused_rope``: 1 on TorchTitan 0.2 (the model's
    buffer), the number of blocks on 0.3 (each attention's ``rope.cache``)."""
    mlp_tile_tokens: int = 0
    rmsnorm_tile_tokens: int = 0
    ce_chunk_tokens: int = 0
    ce_backend: str = "auto"
    ac_mode: str = "none"
    selective_ac_option: str = ""
    """With ``ac_mode = "selective"``: ``"op"`` or every N-th block (``"2"``); empty for other modes."""
    cpu_offload: bool = False
    pin_memory: bool = False
    prefetch_after_attention: bool = False
    resident_blocks: int = 0
    optimizer_state_on_host: bool = False
    keep_attention: str = "off"
    keep_attention_blocks: int | None = 0
    """Blocks that keep their attention (None: ``auto``, as many as fit)."""
    keep_plan: KeepAttentionPlan | None = None
    """The kept-attention plan where the settings state it or the planner sized it (None: not yet)."""
    async_checkpoint: bool = False
    tsp_kv_heads_per_bucket: int = 0
    tsp_overlap: bool = True
    tsp_mlp_recompute: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"JobSpec.{name} = {getattr(self, name)!r}: valid values are {', '.join(DTYPES)}")

    @property
    def mode(self) -> CPMode | None:
        """The context-parallel attention (``model.converters``); None: none."""
        return self.layout.mode

    @property
    def cp_degree(self) -> int:
        return self.layout.cp_degree

    @property
    def ulysses_setting(self) -> int:
        """``[upipe] ulysses_degree`` as written (0: all of CP for Ulysses and UPipe)."""
        return self.layout.ulysses_setting

    @property
    def heads_per_stage_setting(self) -> int:
        """``[upipe] heads_per_stage`` as written (0: U = the Ulysses degree)."""
        return self.layout.heads_per_stage_setting


def degrees_world_size(parallelism) -> int:
    """The ranks a job's degrees make: ``data_parallel_shard_degree`` (``-1``, derived from the launch:
    1 here) x ``context_parallel_degree`` x ``data_parallel_replicate_degree``. ``parallelism``: any
    object with those three fields (TorchTitan 0.2's ``[parallelism]`` section, 0.3's ``ParallelismConfig``)."""
    shard = parallelism.data_parallel_shard_degree
    return (shard if shard > 0 else 1) * parallelism.context_parallel_degree * parallelism.data_parallel_replicate_degree


def writes_async_checkpoints(enable: bool, async_mode: str) -> bool:
    """``[checkpoint]`` enabled with an ``async_mode`` other than ``disabled``: each save stages the node's
    shard of the state in host memory."""
    return bool(enable and async_mode != "disabled")


def section_fields(converters, upipe, transforms, tsp, offload, state_on_host: bool, ac_mode: str,
                   selective_ac_option: str) -> dict[str, object]:
    """The ``JobSpec`` fields that ``model.converters`` and the plugin's sections decide
    (``spec.sections``: ``upipe`` a ``UPipe``, ``transforms``, ``tsp``, ``offload`` an
    ``ActivationCheckpointOffload``), mapped once for every adapter; ``selective_ac_option`` is kept for
    ``ac_mode = "selective"`` alone. The adapters add the model, sizes, layout and keep plan."""
    return dict(
        attention_backend=upipe.attention_backend, document_balance=upipe.document_balance,
        document_min_split=upipe.document_min_split,
        tiled_mlp="tiled_mlp" in converters, tiled_rmsnorm="tiled_rmsnorm" in converters,
        fused_rope="fused_rope" in converters, fused_ce="fused_ce" in converters,
        mlp_tile_tokens=transforms.mlp_tile_tokens, rmsnorm_tile_tokens=transforms.rmsnorm_tile_tokens,
        ce_chunk_tokens=transforms.ce_chunk_tokens, ce_backend=transforms.ce_backend,
        ac_mode=ac_mode, selective_ac_option=selective_ac_option if ac_mode == "selective" else "",
        cpu_offload=bool(offload.cpu_offload), pin_memory=bool(offload.pin_memory),
        prefetch_after_attention=bool(offload.prefetch_after_attention), resident_blocks=int(offload.resident_blocks),
        optimizer_state_on_host=bool(state_on_host),
        tsp_kv_heads_per_bucket=tsp.kv_heads_per_bucket, tsp_overlap=tsp.overlap, tsp_mlp_recompute=tsp.mlp_recompute,
    )
