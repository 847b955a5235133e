"""Parity check: does the configured parallel layout compute what one device computes?

    torchrun --nproc_per_node <CP degree> -m titan_upipe.check --job.config_file X.toml [--seq-len N]
             [--dtype float32|bfloat16] [--tolerance T] [--section.key value ...]

Builds the configured model twice with the same weights: the *reference*, TorchTitan's
unconverted model on the full (gathered) batch, and the *parallel* model with the config's
converters (CP attention and the memory transforms) on this rank's sequence shard in the
layout the trainer uses. One forward and backward each; the CP ranks' losses and gradients
are summed and their logits gathered, and rank 0 prints the max relative error
(max |parallel - reference| / max |reference|) of the loss, the logits and every gradient.
Exit code 1 when one exceeds the tolerance. FSDP and activation checkpointing are not
applied (they do not change the math; the end-to-end tests cover them); every rank holds
the whole model, so use a short ``--seq-len`` for big models.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import titan_upipe  # noqa: F401  (registers the plugin, picks the device)

DEFAULT_TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}


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
    parser = argparse.ArgumentParser(prog="torchrun ... -m titan_upipe.check", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: training.seq_len)")
    parser.add_argument("--dtype", choices=tuple(DEFAULT_TOLERANCE), default="float32",
                        help="parameter/activation dtype of both models (default float32: exact comparison)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="max relative error (default 1e-5 in float32, 3e-2 in bfloat16)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per batch (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_known_args(argv)


def _logits(pred):
    """Logits from the model output; a ``fused_ce`` model returns hidden states and its head."""
    import torch

    from titan_upipe.transforms.model_forward import FinalHiddenStates

    if isinstance(pred, FinalHiddenStates):
        with torch.no_grad():
            return torch.nn.functional.linear(pred.hidden, pred.head.weight)
    return pred.detach()


def _build_models(job_config, parallel_dims, device, dtype):
    import torch
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec

    from titan_upipe.specs import flavor_args

    spec = get_train_spec(job_config.model.name)
    args = flavor_args(job_config)
    with torch.device("meta"):
        reference = spec.model_cls(args)
        parallel = spec.model_cls(args)
    build_model_converters(job_config, parallel_dims).convert(parallel)
    for model in (reference, parallel):
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=device)
    parallel.load_state_dict(reference.state_dict())
    # Parameters in the compute dtype, as FSDP's mixed precision gives them to the model;
    # buffers (the RoPE tables) keep their own dtype, as in training.
    with torch.no_grad():
        for model in (reference, parallel):
            for param in model.parameters():
                param.data = param.data.to(dtype)
    return spec, args, reference, parallel


def run_check(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.tools.utils import device_type

    from titan_upipe.attention import sequence_mesh
    from titan_upipe.parallel import gather_sequence, shard_sequence
    from titan_upipe.train import with_plugin_config
    from titan_upipe.validation import check_job

    options, titan_args = _parse(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    overrides = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.data_parallel_replicate_degree", "1"]
    if options.seq_len:
        overrides += ["--training.seq_len", str(options.seq_len)]
    job_config = ConfigManager().parse_args(with_plugin_config([*titan_args, *overrides]))
    cp = job_config.parallelism.context_parallel_degree
    if world_size != cp:
        raise SystemExit(f"titan_upipe.check runs one rank per CP rank: launch with --nproc_per_node {cp} "
                         f"(parallelism.context_parallel_degree), not {world_size}")
    check_job(job_config, world_size)
    tolerance = options.tolerance if options.tolerance is not None else DEFAULT_TOLERANCE[options.dtype]
    dtype = getattr(torch, options.dtype)

    rank = int(os.environ.get("RANK", "0"))
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    owns_process_group = world_size > 1 and not dist.is_initialized()
    if owns_process_group:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    parallel_dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=cp, tp=1, pp=1, ep=1, etp=1, world_size=world_size)
    parallel_dims.build_mesh()

    torch.manual_seed(options.seed)
    spec, args, reference, parallel = _build_models(job_config, parallel_dims, device, dtype)
    loss_fn = spec.build_loss_fn(job_config)
    seq = job_config.training.seq_len
    generator = torch.Generator().manual_seed(options.seed)
    tokens = torch.randint(0, args.vocab_size, (options.batch, seq + 1), generator=generator).to(device)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    n_tokens = labels.numel()

    # Parallel: this rank's shard in the trainer's layout; losses and gradients summed over CP.
    if cp > 1:
        cp_mesh = sequence_mesh(parallel)  # the layout the converted attention expects
        local_inputs, positions = shard_sequence(inputs, cp_mesh, seq_dim=1)
        local_labels, _ = shard_sequence(labels, cp_mesh, seq_dim=1)
        pred = parallel(local_inputs, positions=positions)
    else:
        cp_mesh, local_labels = None, labels
        pred = parallel(inputs)
    loss = loss_fn(pred, local_labels) / n_tokens
    loss.backward()
    local_logits = _logits(pred)
    loss_sum = loss.detach().float().clone()
    grads = {name: p.grad.detach().float().clone() for name, p in parallel.named_parameters() if p.grad is not None}
    if cp > 1:
        group = parallel_dims.get_mesh("cp").get_group()  # all CP ranks (the layout mesh may be 2-D)
        dist.all_reduce(loss_sum, group=group)
        for grad in grads.values():
            dist.all_reduce(grad, group=group)
        logits = gather_sequence(local_logits.contiguous(), cp_mesh, seq_dim=1)
    else:
        logits = local_logits

    failed = False
    if rank == 0:
        ref_pred = reference(inputs)
        ref_loss = loss_fn(ref_pred, labels) / n_tokens
        ref_loss.backward()
        ref_grads = {name: p.grad for name, p in reference.named_parameters()}
        results = [Comparison("loss", relative_error(loss_sum, ref_loss.detach().float())),
                   Comparison("logits", relative_error(logits, _logits(ref_pred)))]
        missing = sorted(set(ref_grads) - set(grads))
        results += [Comparison(f"grad {name}", relative_error(grads[name], ref_grads[name].float()))
                    for name in ref_grads if name in grads]
        print(f"titan_upipe.check: {job_config.job.config_file} | converters "
              f"{', '.join(job_config.model.converters) or '(none)'} | CP {cp} | seq_len {seq} | batch "
              f"{options.batch} | {options.dtype} | tolerance {tolerance:g}")
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
    if world_size > 1:
        verdict = torch.tensor([int(failed)], device=device)
        dist.broadcast(verdict, src=0)
        failed = bool(verdict.item())
    if owns_process_group:
        # Tear down together: a rank that destroys its gloo groups while a peer is still in a
        # collective on them can abort at exit (seen under load on the ring meshes).
        dist.barrier()
        dist.destroy_process_group()
    return 1 if failed else 0


def main() -> None:
    sys.exit(run_check(sys.argv[1:]))


if __name__ == "__main__":
    main()
