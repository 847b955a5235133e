"""The planner's arguments (``python -m titan_upipe.plan --help``): read without torch or TorchTitan,
so that ``--help`` and a bad argument answer at once; the run itself is ``tools.plan_cli``."""

from __future__ import annotations

import argparse

from titan_upipe.plan.job import MODES, RUNTIME_RESERVE_GIB_CUDA
from titan_upipe.spec.settings import ATTENTION_BACKEND_NAMES, DOCUMENT_BALANCES, KEEP_ATTENTION
from titan_upipe.toolkit.cli_args import (
    ToolParser,
    non_negative_int,
    non_negative_size,
    positive_int,
    positive_size,
    token_count,
)

TOOL = "titan_upipe.plan"
"""The command's name in its error line."""
DESCRIPTION = ("Memory planner: predicted per-rank peak memory of a training step, the longest context that "
               "fits, and the UPipe head chunk ``U`` to use")


def build_parser() -> argparse.ArgumentParser:
    parser = ToolParser(prog=f"python -m {TOOL}", description=DESCRIPTION)
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
                        choices=list(ATTENTION_BACKEND_NAMES),
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
