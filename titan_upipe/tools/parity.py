"""Parity check: does the configured parallel layout compute what one device computes?

    torchrun --nproc_per_node <CP degree> -m titan_upipe.check --job.config_file X.toml [--seq-len N]
             [--dtype float32|bfloat16] [--tolerance T] [--section.key value ...]

Builds the configured model twice with the same weights (the installed TorchTitan's adapter's
``parity_job``: on 0.2.2 ``rank_model.build_rank_model``, the rank builder the emulator uses too; on
0.3 the recipe's model config, converted as its ``parallelize`` converts): the *reference*,
TorchTitan's unconverted model on the full (gathered) batch, and the *parallel* model with the
config's converters (CP attention and the memory transforms) on this rank's sequence shard in the
layout the trainer uses. One forward and backward each; the CP ranks' losses and gradients
are summed and their logits gathered, and rank 0 prints the max relative error
(max |parallel - reference| / max |reference|) of the loss, the logits and every gradient.
Exit code 1 when one exceeds the tolerance. With a ``block_causal`` flavor the batch holds packed
documents (EOS tokens: a 1-token document first, documents across the shard boundaries, a
different split per row), the parallel model gets the trainer's document mask
(``parallel.inputs.prepare_cp_batch``), and the reference is TorchTitan's model with its
``sdpa`` (causal) attention run on each document alone at its global positions, concatenated:
block-causal attention by definition, none of the plugin's mask code. FSDP and activation checkpointing are not
applied (they do not change the math; the end-to-end tests cover them); every rank holds
the whole model, so use a short ``--seq-len`` for big models.

On the CPU a config longer than ``CPU_SEQ_LEN_LIMIT`` tokens (a GPU recipe: 1M) is refused unless
``--seq-len`` is given, with a length that fits the layout to pass. Refused rather than shortened:
a parity verdict is about the length the user asked for, so a silently chosen one would answer
another question; and at a GPU recipe's length the single-device reference (attention quadratic
in the length, on every rank) would not finish on a CPU.

A mistake in the command line or the config (a length the layout cannot shard, a rank count
other than the CP degree, a length the memory planner predicts will not fit) is
one line, ``titan_upipe.check: error: ...``, printed once (rank 0) before any process group
starts, exit status 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_upipe.adapter import adapter_module
from titan_upipe.errors import ConfigError, exit_once
from titan_upipe.parallel import gather_sequence
from titan_upipe.parallel.inputs import prepare_cp_batch
from titan_upipe.toolkit.cli_args import (
    ToolParser,
    non_negative_int,
    positive_int,
    positive_size,
    token_count,
)
from titan_upipe.toolkit.packed_documents import document_runs, packed_document_tokens
from titan_upipe.transforms.model_forward import FinalHiddenStates

DEFAULT_TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}
TOOL = "titan_upipe.check"
"""The command's name in its error line."""
CPU_SEQ_LEN_LIMIT = 8192
"""Above this ``training.seq_len`` the check on the CPU needs ``--seq-len`` (module docstring)."""
SUGGESTED_SEQ_LEN = 64
"""The length suggested instead, rounded up to the layout's sequence divisor."""


@dataclass(frozen=True)
class Comparison:
    name: str
    error: float

    def line(self, tolerance: float) -> str:
        verdict = "ok" if self.error <= tolerance else "FAIL"
        return f"  {self.name:<58} {self.error:10.3e}  {verdict}"


def relative_error(actual, reference) -> float:
    actual, reference = actual.double(), reference.double()
    scale = reference.abs().max().item()
    diff = (actual - reference).abs().max().item()
    return diff / scale if scale > 0 else diff


def _parse(argv: list[str]):
    parser = ToolParser(prog=f"torchrun ... -m {TOOL}", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=token_count, default=None,
                        help="sequence length, e.g. 64 or 4K (default: training.seq_len; needed on the CPU above "
                             f"{CPU_SEQ_LEN_LIMIT})")
    parser.add_argument("--dtype", choices=tuple(DEFAULT_TOLERANCE), default="float32",
                        help="parameter/activation dtype of both models (default float32: exact comparison)")
    parser.add_argument("--tolerance", type=positive_size, default=None,
                        help="max relative error (default 1e-5 in float32, 3e-2 in bfloat16)")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences per batch (default 1)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser.parse_known_args(argv)


@dataclass(frozen=True)
class CheckSetup:
    """One rank's view of the check: the checked job (DP degrees forced to 1; the adapter's
    ``parity_job.ParityJob``), the compute dtype and the tolerance."""

    options: argparse.Namespace
    job: Any
    world_size: int
    rank: int
    cp: int
    device: torch.device
    dtype: torch.dtype
    tolerance: float


def _logits(pred):
    """Logits from the model output; a ``fused_ce`` model returns hidden states and its head."""
    if isinstance(pred, FinalHiddenStates):
        with torch.no_grad():
            return torch.nn.functional.linear(pred.hidden, pred.head.weight)
    return pred.detach()


def _build_models(job, device, dtype, seed: int):
    """The reference and the parallel model with the same weights (``job.build_models``), their
    parameters in the compute dtype, as FSDP's mixed precision gives them to the model; buffers (the
    RoPE tables) keep their own dtype, as in training. -> (reference, parallel, vocab)"""
    reference, parallel, vocab = job.build_models(device, dtype, seed)
    with torch.no_grad():
        for model in (reference, parallel):
            for param in model.parameters():
                param.data = param.data.to(dtype)
    return reference, parallel, vocab


def _cpu_length_problem(job, options: argparse.Namespace, device: torch.device) -> str | None:
    """A recipe length on the CPU without ``--seq-len`` (module docstring): the refusal, with a
    length this layout shards."""
    seq_len = job.spec.seq_len
    if device.type != "cpu" or options.seq_len is not None or seq_len <= CPU_SEQ_LEN_LIMIT:
        return None
    divisor = job.spec.layout.seq_divisor
    suggested = math.ceil(SUGGESTED_SEQ_LEN / divisor) * divisor
    return (f"training.seq_len = {seq_len} ({job.config_file}) is a GPU-scale length: on the CPU the "
            f"reference model would run all {seq_len} tokens; pass --seq-len {suggested} (a multiple of {divisor}, "
            f"this layout's sequence divisor; up to {CPU_SEQ_LEN_LIMIT} without --seq-len)")


def checked_job(options: argparse.Namespace, titan_args: list[str], world_size: int, device: torch.device):
    """The job the check runs (the adapter's ``parity_job``: data-parallel degrees forced to 1,
    ``--seq-len`` applied), validated as far as it can be before any process group: one rank per CP
    rank, the job checks, a length the CPU can run, the memory guard, documents only under CP.
    Raises ConfigError."""
    job = adapter_module("parity_job").parity_job(titan_args, options.seq_len)
    cp = job.cp_degree
    if world_size != cp:
        raise ConfigError(f"the check runs one rank per CP rank: launch it with --nproc_per_node {cp} "
                          f"(parallelism.context_parallel_degree), not {world_size}")
    job.check(world_size)
    if problem := _cpu_length_problem(job, options, device):
        raise ConfigError(problem)
    job.check_memory(world_size, device, options.batch)
    if job.spec.documents and cp == 1:
        raise ConfigError("titan_upipe.check with attn_mask_type 'block_causal' checks the context-parallel "
                          "attention against TorchTitan's per document: set parallelism.context_parallel_degree "
                          ">= 2 with a CP converter")
    return job


def _setup(argv: list[str]) -> tuple[CheckSetup, bool]:
    """Parse the command line and the job, validate it (:func:`checked_job`), start the process
    group (when this call owns it: the second value) and build the CP mesh."""
    options, titan_args = _parse(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = adapter_module("parity_job").rank_device()
    job = checked_job(options, titan_args, world_size, device)
    tolerance = options.tolerance if options.tolerance is not None else DEFAULT_TOLERANCE[options.dtype]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns_process_group = world_size > 1 and not dist.is_initialized()
    if owns_process_group:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    setup = CheckSetup(options, job, world_size, int(os.environ.get("RANK", "0")), job.cp_degree, device,
                       getattr(torch, options.dtype), tolerance)
    return setup, owns_process_group


def reference_prediction(model, inputs: torch.Tensor, runs: list[list[tuple[int, int]]] | None):
    """The reference model's logits ``[B, S, V]``: on the whole batch, or each document alone at its
    global positions (RoPE unchanged), concatenated."""
    if runs is None:
        return model(inputs)
    rows = [torch.cat([model(inputs[row:row + 1, a:c], positions=torch.arange(a, c, device=inputs.device)[None])
                       for a, c in row_runs], dim=1)
            for row, row_runs in enumerate(runs)]
    return torch.cat(rows, dim=0)


def _parallel_step(setup: CheckSetup, model, inputs, labels, n_tokens: int, eos_id: int | None = None):
    """Forward and backward of the parallel model on this rank's shard, prepared as the trainer
    prepares it (``prepare_cp_batch``; ``eos_id``: packed documents); the loss and gradients summed
    over the CP ranks, the logits gathered. -> (loss, logits, grads)"""
    job = setup.job
    if setup.cp > 1:
        cp_mesh = job.cp_mesh()  # the mesh the converters used
        batch = prepare_cp_batch(inputs, labels, cp_mesh, eos_id=eos_id, ignore_index=job.ignore_index,
                                 document_balance=job.spec.document_balance,
                                 document_min_split=job.spec.document_min_split)
        local_labels = batch.labels
        pred = model(batch.tokens, **batch.model_kwargs())
    else:
        cp_mesh, local_labels, batch = None, labels, None
        pred = model(inputs)
    loss = job.loss(pred, local_labels) / n_tokens
    loss.backward()
    local_logits = _logits(pred)
    loss_sum = loss.detach().float().clone()
    grads = {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}
    if setup.cp > 1:
        group = job.cp_group()  # all CP ranks (the layout mesh may be 2-D)
        dist.all_reduce(loss_sum, group=group)
        for name, grad in grads.items():
            if isinstance(grad, DTensor):  # sharded weights (tsp): each shard's gradient is complete at its owner
                grads[name] = grad.full_tensor()
            else:  # replicated parameters: each CP rank holds its tokens' share
                dist.all_reduce(grad, group=group)
        logits = gather_sequence(local_logits.contiguous(), cp_mesh, 1, batch.batch_layout)
    else:
        logits = local_logits
    return loss_sum, logits, grads


def _compare(setup: CheckSetup, reference, inputs, labels, n_tokens: int, loss_sum, logits, grads,
             runs=None) -> bool:
    """Rank 0: the reference's forward and backward on the full batch (or per document), the
    comparison printed; whether it failed."""
    options, job, tolerance = setup.options, setup.job, setup.tolerance
    ref_pred = reference_prediction(reference, inputs, runs)
    ref_loss = job.loss(ref_pred, labels) / n_tokens
    ref_loss.backward()
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    results = [Comparison("loss", relative_error(loss_sum, ref_loss.detach().float())),
               Comparison("logits", relative_error(logits, _logits(ref_pred)))]
    missing = sorted(set(ref_grads) - set(grads))
    results += [Comparison(f"grad {name}", relative_error(grads[name], ref_grads[name].float()))
                for name in ref_grads if name in grads]
    print(f"titan_upipe.check: {job.config_file} | converters "
          f"{', '.join(job.converters) or '(none)'} | CP {setup.cp} | seq_len "
          f"{job.spec.seq_len} | batch {options.batch} | {options.dtype} | tolerance {tolerance:g}"
          + (f" | block_causal, documents per row {[len(r) for r in runs]}" if runs else ""))
    print(f"  loss: parallel {loss_sum.item():.7f}  single device {ref_loss.item():.7f}")
    for result in results[:2]:
        print(result.line(tolerance))
    worst = max(results[2:], key=lambda r: r.error)
    print(f"  gradients: {len(results) - 2} tensors, worst {worst.name} at {worst.error:.3e}")
    for result in results[2:]:
        if result.error > tolerance:
            print(result.line(tolerance))
    failed = any(r.error > tolerance for r in results) or bool(missing)
    if missing:
        print(f"  FAIL: no gradient for {missing}")
    print("PARITY OK" if not failed else "PARITY FAILED")
    return failed


def run_check(argv: list[str]) -> int:
    """The check on this rank (module docstring); the exit code, the same on every rank."""
    setup, owns_process_group = _setup(argv)
    options, job = setup.options, setup.job
    documents = job.spec.documents
    reference, parallel, vocab = _build_models(job, setup.device, setup.dtype, options.seed)
    generator = torch.Generator().manual_seed(options.seed)
    eos_id = vocab - 1  # the document separator; the random tokens stay below it
    tokens = torch.randint(0, vocab - 1 if documents else vocab, (options.batch, job.spec.seq_len + 1),
                           generator=generator).to(setup.device)
    if documents:
        tokens = packed_document_tokens(tokens, eos_id)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    n_tokens = labels.numel()
    runs = document_runs(inputs, eos_id) if documents else None
    loss_sum, logits, grads = _parallel_step(setup, parallel, inputs, labels, n_tokens, eos_id if documents else None)
    failed = False
    if setup.rank == 0:
        failed = _compare(setup, reference, inputs, labels, n_tokens, loss_sum, logits, grads, runs)
    if setup.world_size > 1:
        verdict = torch.tensor([int(failed)], device=setup.device)
        dist.broadcast(verdict, src=0)
        failed = bool(verdict.item())
    if owns_process_group:
        # Tear down together: a rank that destroys its gloo groups while a peer is still in a
        # collective on them can abort at exit (seen under load on the ring meshes).
        dist.barrier()
        dist.destroy_process_group()
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> None:
    """``torchrun ... -m titan_upipe.check``: exit status 0 (parity), 1 (a difference over the
    tolerance) or 2 (the command or the job cannot run: one line, printed once)."""
    try:
        code = run_check(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        raise exit_once(TOOL, str(err)) from None
    sys.exit(code)


if __name__ == "__main__":
    main()
