"""Memory transforms on real gloo ranks: FSDP (2 ranks) and UPipe context parallelism (2 and 4
ranks), every transform and offloaded checkpointing on, against the single-device model (fp32)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from dist_utils import run_distributed

FP32_RTOL = 1e-6
SEQ = 48
BATCH = 2


@dataclass(frozen=True)
class Case:
    family: str
    cp: bool
    """True: UPipe over all ranks, FSDP over the same ranks (the trainer's layout); False: FSDP only."""
    offload: bool = True


def _model(family: str):
    from test_transforms import llama3, qwen3

    return (llama3 if family == "llama3" else qwen3)(n_layers=2, max_seq_len=SEQ)


def _convert(model, mesh, case: Case, rope_tables: list):
    from torchtitan.models.llama3.infra.parallelize import apply_fsdp

    from titan_upipe.attention import convert_attention
    from titan_upipe.torchtitan_common import cpu_runtime
    from titan_upipe.transforms.model_forward import enable_fused_rope
    from titan_upipe.transforms.offload import apply_offloaded_ac
    from titan_upipe.transforms.surgery import fuse_cross_entropy, tile_feed_forwards, tile_rms_norms

    if case.cp:
        for block in model.layers.values():
            block.attention = convert_attention(block.attention, "upipe", mesh)
            # Record the RoPE table every attention call receives (fused: this rank's rows only).
            block.attention.register_forward_pre_hook(lambda m, args: rope_tables.append(tuple(args[1].shape)))
    enable_fused_rope(model)
    tile_feed_forwards(model, 10)  # ragged tiles: 2 x 24 local tokens
    tile_rms_norms(model, 16)
    fuse_cross_entropy(model, chunk_tokens=20, backend="torch")
    if case.offload:
        apply_offloaded_ac(model, pin_memory=False)
    apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
    cpu_runtime.force_sum_reductions(model)
    return model


def _run(rank: int, world: int, mesh, case: Case) -> dict[str, float]:
    from test_transforms import rel_err
    from torchtitan.components.loss import cross_entropy_loss

    from titan_upipe.parallel import shard_sequence
    from titan_upipe.transforms.offload import OFFLOAD_STATS

    torch.manual_seed(7)
    plain = _model(case.family)
    converted_source = copy.deepcopy(plain)
    tokens = torch.randint(0, 300, (BATCH * world, SEQ))
    labels = torch.randint(0, 300, (BATCH * world, SEQ))
    labels[:, :3] = -100
    n_valid = (labels != -100).sum()

    ref_loss = cross_entropy_loss(plain(tokens), labels) / n_valid
    ref_loss.backward()

    rope_tables: list = []
    model = _convert(converted_source, mesh, case, rope_tables)
    if case.cp:  # every rank: the whole batch, its contiguous sequence shard
        local_tokens, positions = shard_sequence(tokens, mesh, seq_dim=1)
        local_labels, _ = shard_sequence(labels, mesh, seq_dim=1)
        positions = positions.unsqueeze(0)
    else:  # data parallel: a slice of the batch
        local_tokens, local_labels = tokens[rank * BATCH:(rank + 1) * BATCH], labels[rank * BATCH:(rank + 1) * BATCH]
        positions = None
    pred = model(local_tokens, positions=positions)
    assert OFFLOAD_STATS.saved_tensors == (2 if case.offload else 0)
    local_loss = pred.loss_sum(local_labels) / n_valid
    del pred
    local_loss.backward()
    assert OFFLOAD_STATS.saved_tensors == 0
    loss = local_loss.detach().clone()
    torch.distributed.all_reduce(loss)
    errors = {"loss": rel_err(loss, ref_loss)}
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        errors[name] = rel_err(q.grad.full_tensor(), p.grad)
    if case.cp:
        local = SEQ // world
        assert rope_tables and all(shape[0] == local for shape in rope_tables), rope_tables
        errors["rope_rows"] = rope_tables[0][0]
    return errors


CASES = [
    pytest.param(2, Case("llama3", cp=False), id="fsdp2-llama3"),
    pytest.param(2, Case("qwen3", cp=False, offload=False), id="fsdp2-qwen3-no-offload"),
    pytest.param(2, Case("llama3", cp=True), id="upipe2-fsdp-llama3"),
    pytest.param(2, Case("qwen3", cp=True), id="upipe2-fsdp-qwen3"),
    pytest.param(4, Case("llama3", cp=True), id="upipe4-fsdp-llama3"),
]


def _run_all(rank, world, mesh, cases):
    return [_run(rank, world, mesh, case) for case in cases]


_RESULTS: dict[int, list] = {}


def results(world: int) -> list[dict[str, float]]:
    if world not in _RESULTS:
        cases = [p.values[1] for p in CASES if p.values[0] == world]
        per_rank = run_distributed(world, _run_all, cases, timeout=600)
        _RESULTS[world] = [dict(zip(per_rank[0][i], (max(r[i][k] for r in per_rank) for k in per_rank[0][i]),
                                    strict=True)) for i in range(len(cases))]
    return _RESULTS[world]


@pytest.mark.parametrize(("world", "case"), CASES)
def test_transforms_match_single_device(world: int, case: Case) -> None:
    index = [p.values[1] for p in CASES if p.values[0] == world].index(case)
    errors = dict(results(world)[index])
    if case.cp:
        assert errors.pop("rope_rows") == SEQ // world  # fused RoPE: local rows, not SEQ
    assert len(errors) > 5
    assert max(errors.values()) <= FP32_RTOL, errors
