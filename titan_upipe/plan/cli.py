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

from titan_upipe.attention.backends import BACKENDS
from titan_upipe.errors import exit_once
from titan_upipe.parallel.document_layout import DOCUMENT_BALANCES
from titan_upipe.plan.job import MODES, RUNTIME_RESERVE_GIB_CUDA, PlanInput, as_tsp
from titan_upipe.plan.job_config import (
    async_checkpoint_staging_bytes,
    keep_host_budget,
    plan_input_from_job_config,
)
from titan_upipe.plan.models import KNOWN_MODELS, MODEL_FLAVORS, model_dims
from titan_upipe.plan.report import make_plot, render, summary
from titan_upipe.plan.search import size_keep_attention
from titan_upipe.plan.step import plan
from titan_upipe.plan.units import GIB
from titan_upipe.tools.cli_args import (
    ToolParser,
    non_negative_int,
    non_negative_size,
    positive_int,
    positive_size,
    token_count,
)
from titan_upipe.torchtitan_0_2.checks.keep_attention import KEEP_ATTENTION, keep_setting
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_0_2.registry import register_plugin

TOOL = "titan_upipe.plan"
"""The command's name in its error line."""


def _model_job(args) -> PlanInput:
    """The job of ``--model``: the paper's recipe on the given cluster (bf16 FSDP, offloaded full
    AC, every transform, Liger CE on CUDA), or full AC alone with ``--no-transforms``."""
    dims = model_dims(args.model)
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


def build_parser() -> argparse.ArgumentParser:
    parser = ToolParser(prog=f"python -m {TOOL}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="llama3_8b, qwen3_32b or <model.name>:<flavor> (instead of a TOML)")
    parser.add_argument("--seq-len", type=token_count, default="128K",
                        help="sequence length, e.g. 131072, 128K, 5M (2^20 per M)")
    parser.add_argument("--cp", type=positive_int, default=8, help="context-parallel degree")
    parser.add_argument("--ulysses", type=non_negative_int, default=0, help="Ulysses degree (0: all of CP); ring = cp / ulysses")
    parser.add_argument("--mode", default="upipe", choices=[m for m in MODES if m != "none"])
    parser.add_argument("--heads-per-stage", type=non_negative_int, default=None, help="UPipe's U (default: the Ulysses degree)")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences per rank")
    parser.add_argument("--world-size", type=positive_int, default=None, help="ranks (default: cp, or the TOML's degrees)")
    parser.add_argument("--gpus-per-node", type=positive_int, default=8)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="default: cuda (for a TOML: cpu when mixed_precision_param is float32)")
    parser.add_argument("--pin-memory", choices=["auto", "true", "false"], default="auto",
                        help="--model only: offload buffers pinned, pageable, or pinned when they fit (auto)")
    # No "auto" here: a TOML's auto is planned as PLAN_AUTO_BACKEND.
    parser.add_argument("--attention-backend", default="flash_attn3",
                        choices=list(BACKENDS),
                        help="--model only: local attention kernel (default flash_attn3, the paper's FA3)")
    parser.add_argument("--no-transforms", action="store_true",
                        help="--model only: full AC without offload and no tiling/fusing")
    parser.add_argument("--optimizer-state-on-host", action="store_true",
                        help="--model only: AdamW's moments in host memory ([optimizer] state_on_host = true)")
    parser.add_argument("--prefetch-after-attention", action="store_true",
                        help="--model only: fetch the next block's offloaded input after the attention backward "
                             "([activation_checkpoint] prefetch_after_attention = true)")
    parser.add_argument("--resident-blocks", type=non_negative_int, default=0,
                        help="--model only: the last N blocks keep their input on the device "
                             "([activation_checkpoint] resident_blocks = N)")
    parser.add_argument("--keep-attention", choices=KEEP_ATTENTION, default="off",
                        help="--model only: blocks keep their attention's output and LSE instead of recomputing "
                             "it ([activation_checkpoint] keep_attention; auto: on the GPU as many as fit --gpu-mem, "
                             "then on the host as many as fit --host-mem)")
    parser.add_argument("--keep-attention-blocks", type=non_negative_int, default=None,
                        help="--model only: at most this many blocks keep (default: as many as fit)")
    parser.add_argument("--kv-heads-per-bucket", type=int, default=0,
                        help="--model --mode tsp only: KV heads per K/V all-gather ([tsp] kv_heads_per_bucket; 0: all)")
    parser.add_argument("--no-mlp-recompute", action="store_true",
                        help="--model --mode tsp only: the ring MLP saves each step's projections "
                             "([tsp] mlp_recompute = false)")
    parser.add_argument("--documents", action="store_true",
                        help="packed documents (block-causal masks): plan the document mask on every rank "
                             "(a TOML's flavor turns this on with attn_mask_type = 'block_causal')")
    parser.add_argument("--document-balance", choices=DOCUMENT_BALANCES, default=None,
                        help="with --documents on a ring: the fixed zigzag or each batch's own layout "
                             "([upipe] document_balance; default documents)")
    parser.add_argument("--gpu-mem", type=positive_size, default=None, help="GiB of device memory per GPU (e.g. 80)")
    parser.add_argument("--host-mem", type=positive_size, default=None, help="GiB of host memory per node (e.g. 1900)")
    parser.add_argument("--reserve-gib", type=non_negative_size, default=None,
                        help=f"runtime reserve kept free on each GPU (default {RUNTIME_RESERVE_GIB_CUDA} on cuda, 0 on cpu)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", default=None, help="write a PNG of predicted peak vs sequence length")
    return parser


def _job(parser: argparse.ArgumentParser, args, rest: list[str], from_config: bool
         ) -> tuple[PlanInput, str | None, KeepRequest]:
    """(the job, the paper model whose Table 4 points to plot, the kept attention it asks for) from
    a TOML or ``--model``."""
    if from_config:
        job_config = parse_config(rest, quiet=True)
        job = plan_input_from_job_config(job_config, args.world_size, args.device)
        job = replace(job, gpus_per_node=args.gpus_per_node)
        paper_model = next((k for k, (name, flavor) in MODEL_FLAVORS.items()
                            if (name, flavor) == (job_config.model.name, job_config.model.flavor)), None)
        keep = KeepRequest(*keep_setting(job_config), async_checkpoint_staging_bytes(job_config, job))
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
    """Host bytes of a node an async checkpoint stages (``job_config.async_checkpoint_staging_bytes``)."""

    @property
    def sized_by_planner(self) -> bool:
        return self.where != "off" and self.blocks != 0 and (self.where == "auto" or self.blocks is None)

    def sized(self, job: PlanInput, gpu_mem_bytes: float | None, host_mem_bytes: float | None
              ) -> tuple[PlanInput, str | None]:
        """``job`` with its kept blocks: stated, or sized as the launch sizes them
        (``job_config.size_keep_attention_of_job``) for the GPU (default ``PLAN_GPU_GIB``, with a note
        saying so) and the host memory (none given: not limited)."""
        if self.where == "off" or self.blocks == 0:
            return replace(job, keep_device_blocks=0, keep_host_blocks=0), None
        if self.where in ("device", "host") and self.blocks is not None:
            counts = {"keep_device_blocks": self.blocks} if self.where == "device" else {"keep_host_blocks": self.blocks}
            return replace(job, **{"keep_device_blocks": 0, "keep_host_blocks": 0, **counts}), None
        note = None
        if gpu_mem_bytes is None:
            gpu_mem_bytes = PLAN_GPU_GIB * GIB
            note = (f"keep_attention = {self.where}: sized for a {PLAN_GPU_GIB:g} GiB GPU (the paper's H100; --gpu-mem "
                    "for another)" + ("" if host_mem_bytes else " and no host memory limit (--host-mem)"))
        keep = size_keep_attention(job, self.where, self.blocks, gpu_mem_bytes,
                                   keep_host_budget(host_mem_bytes, self.staging_bytes))
        return replace(job, keep_device_blocks=keep.device_blocks, keep_host_blocks=keep.host_blocks), note


PLAN_GPU_GIB = 80.0
"""The GPU an ``auto`` keep plan is sized for when ``--gpu-mem`` is not given."""


def main(argv: list[str] | None = None) -> int:
    register_plugin()  # TorchTitan must know the plugin's specs, converters and config before a TOML is read
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
