"""TSP (folded tensor and sequence parallelism, seed paper 001): the attention and gated MLP of
one block on real gloo groups of 2, 3 and 4 ranks against TorchTitan's unconverted modules in one
process: output, input gradient and every weight gradient at its owning rank, MHA and GQA, Llama3
and Qwen3 (qk-norm), fp32 exact to rounding, bf16 within the dtype's own error; broken variants
fail. Pure shard arithmetic and the degree checks run without processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from test_attention_parity import HEAD_DIM, _rel_err, build_reference, reference_results

from titan_upipe.attention.backends import get_backend
from titan_upipe.attention.projection import RotaryKind
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.layout import ZigzagLayout
from titan_upipe.tsp import (
    CommLog,
    TSPShards,
    check_tsp_degree,
    layer_comm_bytes,
    tsp_attention,
    tsp_gated_mlp,
    tsp_problems,
)

FP32_TOL = 2e-5


# --- pure ----------------------------------------------------------------------------------------


def test_degree_problems_name_the_fix():
    assert tsp_problems(8, 2, 64, 2, seq_len=16) == []
    problems = tsp_problems(8, 2, 62, 4, seq_len=12)
    assert len(problems) == 3, problems
    assert "does not divide the 2 KV heads" in problems[0] and "use one of 1, 2" in problems[0]
    assert "FFN width 62" in problems[1] and "multiple of 8" in problems[2]
    assert "query heads" in tsp_problems(6, 6, 64, 4)[0]
    with pytest.raises(ConfigError, match="TSP degree 3"):
        check_tsp_degree(8, 8, 96, 3)


def test_packed_shards_cover_every_weight_once():
    shards = TSPShards(n_heads=8, n_kv_heads=4, head_dim=4, ffn_dim=12, degree=4)
    wq, wk, wv, wo = torch.randn(32, 16), torch.randn(16, 16), torch.randn(16, 16), torch.randn(16, 32)
    parts = [shards.unpack_attention(shards.pack_attention(wq, wk, wv, wo, r)) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), wq) and torch.equal(torch.cat([p[1] for p in parts]), wk)
    assert torch.equal(torch.cat([p[2] for p in parts]), wv)
    assert torch.equal(torch.cat([p[3] for p in parts]).t(), wo)
    w1, w2, w3 = torch.randn(12, 16), torch.randn(16, 12), torch.randn(12, 16)
    mlp = [shards.unpack_mlp(shards.pack_mlp(w1, w2, w3, r)) for r in range(4)]
    assert torch.equal(torch.cat([m[0] for m in mlp]), w1) and torch.equal(torch.cat([m[1] for m in mlp]), w3)
    assert torch.equal(torch.cat([m[2] for m in mlp]).t(), w2)


# --- distributed ---------------------------------------------------------------------------------


def _cases(world: int) -> list[tuple]:
    """(model, n_heads, n_kv_heads, dtype, bucket, sabotage): MHA and GQA of both models."""
    layouts = {2: [(8, 8), (8, 2)], 3: [(6, 6), (12, 3)], 4: [(8, 8), (8, 4)]}[world]
    cases = [(model, h, kv, "float32", None, None) for model in ("llama3", "qwen3") for h, kv in layouts]
    if world == 2:  # the broken variants
        cases += [("llama3", *layouts[0], "float32", None, "positions"), ("llama3", *layouts[0], "float32", None, "ring")]
    if world == 4:  # bf16, and one KV head per all-gather bucket
        cases += [("qwen3", *layouts[1], "bfloat16", None, None), ("llama3", *layouts[0], "float32", 1, None)]  # 2 KV heads per rank
    return cases


def _feed_forward(dim: int, dtype: torch.dtype):
    from torchtitan.models.llama3.model.model import FeedForward

    module = FeedForward(dim=dim, hidden_dim=4 * dim, multiple_of=48, ffn_dim_multiplier=None).to(dtype)  # F % 2, 3, 4 == 0
    for p in module.parameters():
        torch.nn.init.normal_(p, std=dim ** -0.5)
    return module


def _block_on_rank(rank, world, group, model, n_heads, n_kv, dtype_name, bucket, sabotage):
    """Errors of this rank's TSP attention and MLP against the unconverted modules (rank-local
    slices compared directly; replicated qk-norm gradients summed over the group in fp32)."""
    import titan_upipe.tsp.mlp as tsp_mlp

    dtype = getattr(torch, dtype_name)
    seq, batch = 4 * world * 2, 2
    torch.manual_seed(0)
    module, table = build_reference(model, n_heads, n_kv, max_seq_len=2 * seq)
    dim = module.wq.in_features
    x = torch.randn(batch, seq, dim)
    grad_y = torch.randn(batch, seq, dim)
    ffn = _feed_forward(dim, torch.float32)
    # references in fp32 (and, for bf16, the single-device bf16 run's own error against them)
    ref = reference_results(module, x, table, None, grad_y)
    x_ref = x.clone().requires_grad_(True)
    out = ffn(x_ref)
    out.backward(grad_y)
    ref_mlp = {"out": out.detach(), "dx": x_ref.grad, **{f"d{n}": p.grad.clone() for n, p in ffn.named_parameters()}}
    ffn.zero_grad(set_to_none=True)

    layout = ZigzagLayout(seq, ring_size=world)
    shards = TSPShards(n_heads=n_heads, n_kv_heads=n_kv, head_dim=HEAD_DIM, ffn_dim=ffn.w1.out_features, degree=world)
    positions = layout.positions(rank).unsqueeze(0)
    if sabotage == "positions":  # RoPE at another rank's positions: the test must see it
        positions = layout.positions((rank + 1) % world).unsqueeze(0)
    local = lambda t: layout.shard(t, rank, seq_dim=1)  # noqa: E731
    rotary = RotaryKind.COMPLEX if model == "llama3" else RotaryKind.COS_SIN
    norms = {}
    if model == "qwen3":
        norms = {"q_norm": module.q_norm.weight.detach().to(dtype).requires_grad_(True),
                 "k_norm": module.k_norm.weight.detach().to(dtype).requires_grad_(True),
                 "norm_eps": module.q_norm.eps}
    packed = shards.pack_attention(module.wq.weight, module.wk.weight, module.wv.weight, module.wo.weight, rank)
    packed = packed.detach().to(dtype).requires_grad_(True)
    x_local = local(x).to(dtype).requires_grad_(True)
    log = CommLog()
    y = tsp_attention(x_local, packed, shards, layout, group, get_backend("sdpa", dtype), HEAD_DIM ** -0.5,
                      table, positions, rotary, bucket_kv_heads=bucket, log=log, **norms)
    y.backward(local(grad_y).to(dtype))
    grads = ref
    expected_packed = shards.pack_attention(grads["dwq.weight"], grads["dwk.weight"], grads["dwv.weight"],
                                            grads["dwo.weight"], rank)
    errors = {"attention out": _rel_err(y, local(ref["out"])), "attention dx": _rel_err(x_local.grad, local(ref["dx"])),
              "attention dW (owner)": _rel_err(packed.grad, expected_packed)}
    for name in ("q_norm", "k_norm"):
        if name in norms:
            summed = norms[name].grad.float()
            dist.all_reduce(summed, group=group)
            errors[f"d{name}"] = _rel_err(summed, ref[f"d{name}.weight"])

    if sabotage == "ring":  # every rank applies its own MLP shard D times: the test must see it
        original, tsp_mlp.shift = tsp_mlp.shift, lambda t, group, step: t
    try:
        packed_mlp = shards.pack_mlp(ffn.w1.weight, ffn.w2.weight, ffn.w3.weight, rank).detach().to(dtype)
        packed_mlp.requires_grad_(True)
        x_mlp = local(x).to(dtype).requires_grad_(True)
        y_mlp = tsp_gated_mlp(x_mlp, packed_mlp, shards, group, log=log)
        y_mlp.backward(local(grad_y).to(dtype))
    finally:
        if sabotage == "ring":
            tsp_mlp.shift = original
    expected_mlp = shards.pack_mlp(ref_mlp["dw1.weight"], ref_mlp["dw2.weight"], ref_mlp["dw3.weight"], rank)
    errors.update({"mlp out": _rel_err(y_mlp, local(ref_mlp["out"])), "mlp dx": _rel_err(x_mlp.grad, local(ref_mlp["dx"])),
                   "mlp dW (owner)": _rel_err(packed_mlp.grad, expected_mlp)})
    comm = {"counted": dict(log.received), "formula": layer_comm_bytes(shards, dim, batch, seq, dtype.itemsize)}
    if dtype != torch.float32:  # the dtype's own error: the unconverted modules run in it on one rank
        own = {}
        module_b, ffn_b = module.to(dtype), ffn.to(dtype)
        own_ref = reference_results(module_b, x.to(dtype), table, None, grad_y.to(dtype))
        own["attention out"] = _rel_err(own_ref["out"], ref["out"])
        own["attention dx"] = _rel_err(own_ref["dx"], ref["dx"])
        own["attention dW (owner)"] = max(_rel_err(own_ref[f"d{w}.weight"], ref[f"d{w}.weight"])
                                          for w in ("wq", "wk", "wv", "wo"))
        xb = x.to(dtype).requires_grad_(True)
        ob = ffn_b(xb)
        ob.backward(grad_y.to(dtype))
        own["mlp out"], own["mlp dx"] = _rel_err(ob, ref_mlp["out"]), _rel_err(xb.grad, ref_mlp["dx"])
        own["mlp dW (owner)"] = max(_rel_err(getattr(ffn_b, w).weight.grad, ref_mlp[f"d{w}.weight"])
                                    for w in ("w1", "w2", "w3"))
        for name in ("q_norm", "k_norm"):
            if name in norms:
                own[f"d{name}"] = _rel_err(own_ref[f"d{name}.weight"], ref[f"d{name}.weight"])
        return {"errors": errors, "own": own, "comm": comm}
    return {"errors": errors, "comm": comm}


def _cases_on_rank(rank, pool_size, mesh, world, cases):
    """The cases of a ``world``-rank TSP group on ranks ``0 .. world-1`` of a pool (degree 3 runs in
    the 4-rank pool the other tests share: no pool of its own to start)."""
    group = mesh.get_group() if world == pool_size else dist.new_group(list(range(world)))
    if rank >= world:
        return []
    return [_block_on_rank(rank, world, group, *case) for case in cases]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_tsp_block_matches_one_device(world):
    cases = _cases(world)
    per_rank = run_distributed(4 if world == 3 else world, _cases_on_rank, world, cases)[:world]
    for i, case in enumerate(cases):
        model, n_heads, n_kv, dtype, bucket, sabotage = case
        for rank, result in enumerate(r[i] for r in per_rank):
            errors = result["errors"]
            if sabotage != "ring":  # every byte each rank received, forward and backward, as the formula says
                assert result["comm"]["counted"] == result["comm"]["formula"], (case, rank, result["comm"])
            if sabotage == "positions":
                assert errors["attention out"] > 1e-2, (case, rank, errors)
            elif sabotage == "ring":
                assert errors["mlp out"] > 1e-2, (case, rank, errors)
                assert errors["attention out"] <= FP32_TOL, (case, rank, errors)
            elif dtype == "float32":
                assert max(errors.values()) <= FP32_TOL, (case, rank, errors)
            else:  # bf16: within twice the unconverted bf16 modules' own error (and bf16's epsilon)
                for key, err in errors.items():
                    assert err <= max(2 * result["own"][key], 2 ** -7), (case, rank, key, err, result["own"])
