"""``compile.enable`` with context-parallel converters: norms and feed-forwards compiled, attention
eager, losses equal to the single-process eager reference through the real trainer.

Inductor's first C++ compile costs ~15-40 s per process on the 2-core CI machine, so the CPU tests
compile with ``aot_eager`` (dynamo's trace and AOTAutograd's joint forward/backward graph,
partitioned, run by eager kernels: every compile step but inductor's code generation); the GPU
suite's kernels stage runs the same path with inductor (``gpu_kernels.compile_checks``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fake_meshes import OneRankMesh
from test_transforms import llama3, qwen3, rel_err
from torch import nn
from trainer_utils import E2E_STEPS, assert_losses_close, load_seed, losses, torchrun

from titan_upipe.attention import convert_attention
from titan_upipe.torchtitan_0_2.compile_parts import compile_parts, needs_part_compile
from titan_upipe.transforms.model_forward import FinalHiddenStates
from titan_upipe.transforms.surgery import fuse_cross_entropy, tile_feed_forwards

FP32_RTOL = 1e-6
BLOCK_PARTS = ["feed_forward", "attention_norm", "ffn_norm"]


class RecordingBackend:
    """A ``torch.compile`` backend that keeps each traced graph's code, then runs ``aot_eager``."""

    def __init__(self) -> None:
        self.graphs: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, inputs):
        self.graphs.append(gm.code)
        return torch._dynamo.lookup_backend("aot_eager")(gm, inputs)


def converted(family: str, mode: str, *transforms: str) -> nn.Module:
    model = {"llama3": llama3, "qwen3": qwen3}[family]()
    for block in model.layers.values():
        block.attention = convert_attention(block.attention, mode, OneRankMesh(), backend="sdpa")
    if "tiled_mlp" in transforms:
        tile_feed_forwards(model, 16)
    if "fused_ce" in transforms:
        fuse_cross_entropy(model, 16, "torch")
    return model


def train_steps(model: nn.Module, steps: int = 2) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(0, 300, (2, 64), generator=gen), torch.randint(0, 300, (2, 64), generator=gen)
    for _ in range(steps):
        out = model(tokens, positions=torch.arange(64).unsqueeze(0))
        loss = (out.loss_sum(labels) if isinstance(out, FinalHiddenStates)
                else F.cross_entropy(out.flatten(0, 1).float(), labels.flatten(), reduction="sum"))
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family, mode, transforms, eager_parts", [
    ("llama3", "upipe", (), []),
    ("qwen3", "ulysses", ("tiled_mlp", "fused_ce"), ["feed_forward"]),
])
def test_compiled_parts_are_norms_and_feed_forwards_never_the_attention(family, mode, transforms, eager_parts):
    reference, model = converted(family, mode, *transforms), converted(family, mode, *transforms)
    model.load_state_dict(reference.state_dict())
    backend = RecordingBackend()
    assert needs_part_compile(model)
    names = compile_parts(model, backend)
    block_parts = [p for p in BLOCK_PARTS if p not in eager_parts]
    assert sorted(names) == sorted(["norm", *(f"layers.{i}.{p}" for i in range(2) for p in block_parts)])
    for block in model.layers.values():  # compiled = its forward is torch.compile's wrapper
        assert "forward" not in vars(block.attention)
        assert all(("forward" in vars(getattr(block, p))) == (p in block_parts) for p in BLOCK_PARTS)

    loss, grads = train_steps(model)
    want_loss, want_grads = train_steps(reference)
    # What dynamo traced: an RMSNorm graph and (unless tiled) a SwiGLU graph; no attention op or weight.
    traced = "\n".join(backend.graphs)
    assert "rms_norm" in traced and ("silu" in traced) == ("feed_forward" in block_parts)
    assert not any(word in traced for word in ("scaled_dot_product", "all_to_all", "_wq_", "_wo_")), traced
    assert rel_err(loss, want_loss) <= FP32_RTOL
    assert list(grads) == list(want_grads)
    assert max(rel_err(grads[n], want_grads[n]) for n in grads) <= FP32_RTOL


def _job(*overrides: str):
    from titan_upipe.torchtitan_0_2.config_parse import parse_config

    return parse_config(["--job.config_file", "configs/debug/llama3_upipe.toml", "--compile.enable",
                         "--compile.backend", "aot_eager", *overrides])


ONE_RANK = ("--parallelism.context_parallel_degree", "1", "--model.converters", "tiled_mlp")
"""A job that passes the checks on one rank (parallelize decides by the model it is given)."""


def test_parallelize_compiles_parts_with_cp_attention_and_whole_blocks_without():
    from torchtitan.distributed import ParallelDims

    from titan_upipe.torchtitan_0_2.parallelize import parallelize

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    cp_model = parallelize(converted("llama3", "upipe"), dims, _job(*ONE_RANK))
    assert all(type(b).__name__ == "TransformerBlock" for b in cp_model.layers.values())
    assert all("forward" in vars(b.feed_forward) and "forward" not in vars(b.attention)
               for b in cp_model.layers.values())
    plain = parallelize(llama3(), dims, _job(*ONE_RANK))  # TorchTitan's whole-block compile
    assert not needs_part_compile(plain)
    assert all(isinstance(b, torch._dynamo.eval_frame.OptimizedModule) for b in plain.layers.values())


def test_memory_budget_with_compiled_cp_blocks_is_refused_before_any_process_group():
    from titan_upipe.errors import ConfigError
    from titan_upipe.torchtitan_0_2.checks import check_job

    check_job(_job("--activation_checkpoint.mode", "full"), world_size=2)  # compile with UPipe is accepted
    with pytest.raises(ConfigError, match=r"activation_checkpoint.mode = \"memory_budget\" with compile.enable"):
        check_job(_job("--activation_checkpoint.mode", "memory_budget"), world_size=2)
    with pytest.raises(ConfigError, match=r"model.converters \['tiled_mlp'\]"):
        check_job(_job(*ONE_RANK, "--activation_checkpoint.mode", "memory_budget"), world_size=1)


def test_upipe_with_compile_matches_one_rank(llama3_seed, llama3_one_rank, tmp_path):
    """UPipe CP=2 + FSDP with compile.enable (model and loss) through the real trainer: the eager
    single-process reference's losses, and the log says what was compiled."""
    proc = torchrun(2, "titan_upipe.train", "configs/debug/llama3_upipe.toml", tmp_path, "--training.steps", E2E_STEPS,
                    "--training.local_batch_size", "4", "--compile.enable", "--compile.backend", "aot_eager",
                    *load_seed(llama3_seed))
    log = proc.stdout + proc.stderr
    assert "Compiled 7 norms and feed-forwards" in log and "Compiling the loss function" in log
    assert_losses_close(losses(tmp_path), losses(llama3_one_rank), rtol=1e-5)
