"""Memory planner: predicted per-rank peak memory of a training step, the longest context that
fits, and the UPipe head chunk ``U`` to use — the command line (``python -m titan_upipe.plan``).

``python -m titan_upipe.plan --job.config_file X.toml [--world-size N] [--section.key value ...]``
``python -m titan_upipe.plan --model llama3_8b --seq-len 5M --cp 8 --ulysses 8 --gpu-mem 80 --host-mem 1900``
(add ``--json`` for one JSON object, ``--plot out.png`` for peak vs sequence length).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace

from titan_upipe.adapter import adapter_module
from titan_upipe.errors import exit_once
from titan_upipe.plan.job import PlanInput, as_tsp
from titan_upipe.plan.machine import PLAN_GPU_GIB, checkpoint_staging_bytes, keep_host_budget
from titan_upipe.plan.models import KNOWN_MODELS, MODEL_FLAVORS
from titan_upipe.plan.report import make_plot, render, summary
from titan_upipe.plan.search import size_keep_attention
from titan_upipe.plan.spec_input import plan_input_from_spec
from titan_upipe.plan.step import plan
from titan_upipe.spec.keep_attention import stated_plan
from titan_upipe.spec.units import GIB
from titan_upipe.tools.plan_arguments import TOOL, build_parser


def _model_job(args) -> PlanInput:
    """The job of ``--model``: the paper's recipe on the given cluster (bf16 FSDP, offloaded full
    AC, every transform, Liger CE on CUDA), or full AC alone with ``--no-transforms``."""
    dims = (KNOWN_MODELS[args.model] if args.model in KNOWN_MODELS
            else adapter_module("load_job").flavor_model_dims(args.model))
    mode = args.mode
    ulysses = args.ulysses
    if mode == "upipe-in-usp":
        mode = "upipe"
    if mode in ("ring",):
        ulysses = 1
    job = PlanInput(
        model=dims, seq_len=args.seq_len, batch=args.batch, cp=args.cp, ulysses=ulysses, mode=mode,
        heads_per_stage=args.heads_per_stage, world_size=args.world_size or 0, device=args.device or "cuda",
        gpus_per_node=args.gpus_per_node, param_bytes=2 if (args.device or "cuda") == "cuda" else 4,
        pin_memory={"auto": None, "true": True, "false": False}[args.pin_memory],
        ce_backend="liger" if (args.device or "cuda") == "cuda" else "torch",
        attention_backend=args.attention_backend, optimizer_state_on_host=args.optimizer_state_on_host,
        prefetch_after_attention=args.prefetch_after_attention, resident_blocks=args.resident_blocks,
    )
    if mode == "tsp":
        job = replace(as_tsp(job), tsp_kv_heads_per_bucket=args.kv_heads_per_bucket,
                      tsp_mlp_recompute=not args.no_mlp_recompute)
    if args.no_transforms:
        job = replace(job, tiled_mlp=False, tiled_rmsnorm=False, fused_rope=False, fused_ce=False,
                      ac_mode="full", cpu_offload=False)
    return job


def _job(parser: argparse.ArgumentParser, args, rest: list[str], from_config: bool
         ) -> tuple[PlanInput, str | None, KeepRequest]:
    """(the job, the paper model whose Table 4 points to plot, the kept attention it asks for) from
    a TOML or ``--model``."""
    if from_config:
        # the installed TorchTitan's adapter reads the recipe (0.2: TorchTitan's parser; 0.3: ours)
        spec = adapter_module("load_job").spec_of_recipe(rest, args.world_size)
        job = replace(plan_input_from_spec(spec, args.device), gpus_per_node=args.gpus_per_node)
        paper_model = next((k for k, (name, flavor) in MODEL_FLAVORS.items() if spec.model.name == f"{name}:{flavor}"),
                           None)
        keep = KeepRequest(spec.keep_attention, spec.keep_attention_blocks,
                           checkpoint_staging_bytes(spec.async_checkpoint, job))
    else:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        job = _model_job(args)
        paper_model = args.model if args.model in KNOWN_MODELS else None
        keep = KeepRequest(args.keep_attention, args.keep_attention_blocks)
    if args.reserve_gib is not None:
        job = replace(job, reserve_bytes=int(args.reserve_gib * GIB))
    if args.documents:
        job = replace(job, documents=True)
    if args.document_balance is not None:
        job = replace(job, document_balance=args.document_balance)
    return job, paper_model, keep


@dataclass(frozen=True)
class KeepRequest:
    """``[activation_checkpoint] keep_attention`` and ``keep_attention_blocks`` (None: auto)."""

    where: str
    blocks: int | None
    staging_bytes: int = 0
    """Host bytes of a node an async checkpoint stages (``plan.machine.checkpoint_staging_bytes``)."""

    @property
    def sized_by_planner(self) -> bool:
        return stated_plan(self.where, self.blocks) is None

    def sized(self, job: PlanInput, gpu_mem_bytes: float | None, host_mem_bytes: float | None
              ) -> tuple[PlanInput, str | None]:
        """``job`` with its kept blocks: stated, or sized as the launch sizes them
        (``job_config.size_keep_attention_of_job``) for the GPU (default ``PLAN_GPU_GIB``, with a note
        saying so) and the host memory (none given: not limited)."""
        stated = stated_plan(self.where, self.blocks)  # the config's own plan, as the launch reads it
        if stated is not None:
            return replace(job, keep_device_blocks=stated.device_blocks, keep_host_blocks=stated.host_blocks), None
        note = None
        if gpu_mem_bytes is None:
            gpu_mem_bytes = PLAN_GPU_GIB * GIB
            note = (f"keep_attention = {self.where}: sized for a {PLAN_GPU_GIB:g} GiB GPU (the paper's H100; --gpu-mem "
                    "for another)" + ("" if host_mem_bytes else " and no host memory limit (--host-mem)"))
        keep = size_keep_attention(job, self.where, self.blocks, gpu_mem_bytes,
                                   keep_host_budget(host_mem_bytes, self.staging_bytes))
        return replace(job, keep_device_blocks=keep.device_blocks, keep_host_blocks=keep.host_blocks), note


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    config_flags = ("--job.config_file", "--job.config-file")
    from_config = any(a.split("=", 1)[0] in config_flags for a in rest)
    if from_config == bool(args.model):
        parser.error("give either --job.config_file X.toml [--section.key value ...] or --model NAME")
    try:
        job, paper_model, keep = _job(parser, args, rest, from_config)
        gpu = args.gpu_mem * GIB if args.gpu_mem is not None else None
        host = args.host_mem * GIB if args.host_mem is not None else None
        job, keep_note = keep.sized(job, gpu, host)
        result = plan(job, host)
        if keep_note:
            result.notes.append(keep_note)
        info = summary(result, gpu, host, keep.where, paper_model, keep.sized_by_planner)
    except ValueError as err:  # ConfigError included: the job's settings, as validate words them
        raise exit_once(TOOL, str(err)) from None
    if args.plot:
        message = make_plot(job, args.plot, gpu, host, paper_model)
        info["plot"] = args.plot
        if message:
            info["notes"].append(message)
            print(message, file=sys.stderr)
    if args.json:
        print(json.dumps({**info, "job": _job_dict(job)}, indent=1))
    else:
        print(render(result, info))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _job_dict(job: PlanInput) -> dict:
    d = asdict(job)
    d["model"] = asdict(job.model)
    return d
