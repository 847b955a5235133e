"""A ``JobSpec`` as the planner's ``PlanInput``: what the planner assumes where the spec leaves a
choice to the machine (the device from the dtype, ``auto`` kernels, selective AC that is full AC).
Pure: no torch, no TorchTitan (the adapter builds the spec, ``torchtitan_0_2.job_spec``)."""

from __future__ import annotations

from titan_upipe.plan.job import PlanInput
from titan_upipe.spec.job_spec import JobSpec
from titan_upipe.spec.keep_attention import NO_KEEP
from titan_upipe.spec.settings import DTYPE_BYTES

PLAN_AUTO_BACKEND = "flash_attn4"
"""What ``attention_backend = "auto"`` resolves to on the GPUs the recipes target (Hopper with
the ``[gpu]`` extra, which installs flash-attn-4); the planner predicts another machine, so it
cannot probe what is installed there."""



def planned_ac_mode(spec: JobSpec) -> str:
    """``none`` or ``full``: op-level selective AC without a save list (the plugin's parallelize
    passes none) and every-block selective AC (``1``) are full AC, measured to the byte
    (docs/benchmarks/selective_ac.md); other selective settings are not modelled (ValueError)."""
    option = spec.selective_ac_option
    if spec.ac_mode == "selective" and (option == "op" or option.isdigit() and int(option) <= 1):
        return "full"
    if spec.ac_mode not in ("none", "full"):
        raise ValueError(f"activation_checkpoint.mode = {spec.ac_mode!r} (selective_ac_option = {option!r}): the "
                         "planner models 'none', 'full' and the selective settings that are full AC ('op', '1'); "
                         "for selective layer AC see docs/benchmarks/selective_ac.md")
    return spec.ac_mode


def plan_input_from_spec(spec: JobSpec, device: str | None = None) -> PlanInput:
    """The planner's input for ``spec`` on ``device`` (default: ``cpu`` for fp32 parameters, else
    ``cuda``); an ``auto`` keep-attention setting the planner has not sized yet plans no kept block."""
    if device is None:
        device = "cpu" if spec.param_dtype == "float32" else "cuda"
    ce_backend = spec.ce_backend
    if ce_backend == "auto":
        ce_backend = "liger" if device == "cuda" else "torch"
    keep = spec.keep_plan or NO_KEEP
    return PlanInput(
        model=spec.model, seq_len=spec.seq_len, batch=spec.local_batch, cp=spec.cp_degree,
        ulysses=spec.ulysses_setting, mode=spec.mode or "none", heads_per_stage=spec.heads_per_stage_setting or None,
        world_size=spec.world_size, param_bytes=DTYPE_BYTES[spec.param_dtype],
        reduce_bytes=DTYPE_BYTES[spec.reduce_dtype],
        tiled_mlp=spec.tiled_mlp, tiled_rmsnorm=spec.tiled_rmsnorm, fused_rope=spec.fused_rope,
        fused_ce=spec.fused_ce, rope_tables=spec.rope_tables, mlp_tile_tokens=spec.mlp_tile_tokens,
        rmsnorm_tile_tokens=spec.rmsnorm_tile_tokens, ce_chunk_tokens=spec.ce_chunk_tokens, ce_backend=ce_backend,
        ac_mode=planned_ac_mode(spec),
        attention_backend=PLAN_AUTO_BACKEND if spec.attention_backend == "auto" else spec.attention_backend,
        cpu_offload=spec.cpu_offload, pin_memory=spec.pin_memory,
        prefetch_after_attention=spec.prefetch_after_attention, resident_blocks=spec.resident_blocks,
        device=device, documents=spec.documents, document_balance=spec.document_balance,
        optimizer_state_on_host=spec.optimizer_state_on_host, tsp_kv_heads_per_bucket=spec.tsp_kv_heads_per_bucket,
        tsp_overlap=spec.tsp_overlap, tsp_mlp_recompute=spec.tsp_mlp_recompute,
        keep_device_blocks=keep.device_blocks, keep_host_blocks=keep.host_blocks,
    )
