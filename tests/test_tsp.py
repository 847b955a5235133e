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
from titan_upipe.costs.tsp_comm import layer_comm_bytes
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.layout import ZigzagLayout
from titan_upipe.tsp import (
    CommLog,
    Pending,
    TSPShards,
    check_tsp_degree,
    pack_attention_shard,
    tsp_attention,
    tsp_gated_mlp,
    tsp_problems,
)
from titan_upipe.tsp.grad_sum import fp32_summed_uses

FP32_TOL = 2e-5


# --- pure ----------------------------------------------------------------------------------------


def test_degree_problems_name_the_fix():
    assert tsp_problems(8, 2, 64, 2, seq_len=16) == []
    problems = tsp_problems(8, 2, 62, 4, seq_len=12)
    assert len(problems) == 3, problems
    # one fix for every problem: the degrees > 1 that split heads, KV heads, FFN and sequence at once
    assert "does not divide the 2 KV heads" in problems[0] and problems[0].endswith("): use 2"), problems
    assert "FFN width 62" in problems[1] and problems[1].endswith(": use 2") and "multiple of 8" in problems[2]
    assert tsp_problems(6, 6, 64, 4)[0].endswith("query heads (each rank owns H/D heads): use 2")  # not 3 or 6: FFN
    assert tsp_problems(12, 12, 96, 5)[0].endswith(": use one of 2, 3, 4, 6, 12")
    assert tsp_problems(8, 8, 63, 2)[0].endswith(": no degree > 1 splits this model")
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


def _storage_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_packed_shard_gradients_are_the_parameters_own():
    """Each weight's gradient from the packed shard is contiguous and its own storage: the grads
    hold exactly the parameters' bytes (plain cat + transpose would hold the packed gradient plus
    a copy of wo's, which this test tells apart)."""
    torch.manual_seed(0)
    weights = [torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3), torch.randn(3, 4)]  # wq, wk, wv, wo
    grad = torch.randn(12, 3)
    results = {}
    for name, pack in (("packed", pack_attention_shard), ("plain", lambda q, k, v, o: torch.cat([q, k, v, o.t()]))):
        params = [w.clone().requires_grad_(True) for w in weights]
        pack(*params).backward(grad)
        grads = [p.grad for p in params]
        results[name] = grads
        params_bytes = sum(p.numel() * p.element_size() for p in params)
        if name == "packed":
            assert all(g.is_contiguous() for g in grads) and _storage_bytes(grads) == params_bytes
        else:  # what the packing function avoids
            assert _storage_bytes(grads) > params_bytes
    assert all(torch.equal(a, b) for a, b in zip(results["packed"], results["plain"], strict=True))


def test_fp32_summed_uses_rounds_the_sum_once():
    """Gradients of the aliases reach the tensor as their fp32 sum rounded once: 1 + 3 x 0.4 ulp is
    1 + 1 ulp, where autograd's bf16 sums (the tensor used plainly) add each 0.4 ulp to 1 and drop it; values
    are the tensor's; unused aliases add nothing; fp32/fp64 tensors and no-grad calls are used as
    they are (autograd's own sum is exact enough there)."""
    ulp = 2.0 ** -7  # bf16 spacing at 1
    # the last use's gradient reaches autograd's sum first (reverse creation order): 1, then the rest
    grads = [torch.full((4,), 0.4 * ulp, dtype=torch.bfloat16)] * 3 + [torch.ones(4, dtype=torch.bfloat16)]
    results = {}
    for name in ("chained", "plain"):
        t = torch.randn(4).to(torch.bfloat16).requires_grad_(True)
        uses = fp32_summed_uses(t, 4) if name == "chained" else [t] * 4
        assert all(torch.equal(u, t) for u in uses)
        sum((u * g).sum() for u, g in zip(uses, grads, strict=True)).backward()
        results[name] = t.grad
    assert torch.equal(results["chained"], torch.full((4,), 1 + ulp, dtype=torch.bfloat16))
    assert torch.equal(results["plain"], torch.ones(4, dtype=torch.bfloat16))
    t = torch.randn(3).to(torch.bfloat16).requires_grad_(True)
    (fp32_summed_uses(t, 3)[1] * 2).sum().backward()
    assert torch.equal(t.grad, torch.full((3,), 2.0, dtype=torch.bfloat16))
    for dtype in (torch.float32, torch.float64):
        t = torch.randn(3, dtype=dtype, requires_grad=True)
        assert all(u is t for u in fp32_summed_uses(t, 3))
    t = torch.randn(3).to(torch.bfloat16).requires_grad_(True)
    with torch.no_grad():
        assert all(u is t for u in fp32_summed_uses(t, 2))


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


def _run_tsp_attention(rank, group, model, module, table, shards, layout, x_local, grad_y_local, dtype, positions,
                       bucket=None, log=None):
    """TSP attention of this rank's tokens with ``module``'s weights (its shard, and the qk-norm
    weights for Qwen3) as ``dtype`` leaves, forward and backward: ``(y, x, packed shard, norms)``."""
    rotary = RotaryKind.COMPLEX if model == "llama3" else RotaryKind.COS_SIN
    norms = {}
    if model == "qwen3":
        norms = {"q_norm": module.q_norm.weight.detach().to(dtype).requires_grad_(True),
                 "k_norm": module.k_norm.weight.detach().to(dtype).requires_grad_(True),
                 "norm_eps": module.q_norm.eps}
    packed = shards.pack_attention(module.wq.weight, module.wk.weight, module.wv.weight, module.wo.weight, rank)
    packed = packed.detach().to(dtype).requires_grad_(True)
    x_local = x_local.detach().to(dtype).requires_grad_(True)
    y = tsp_attention(x_local, packed, shards, layout, group, get_backend("sdpa", dtype), HEAD_DIM ** -0.5,
                      table, positions, rotary, bucket_kv_heads=bucket, log=log, **norms)
    y.backward(grad_y_local.to(dtype))
    return y, x_local, packed, norms


def _block_on_rank(rank, world, group, model, n_heads, n_kv, dtype_name, bucket, sabotage, seed=0):
    """Errors of this rank's TSP attention and MLP against the unconverted modules (rank-local
    slices compared directly; replicated qk-norm gradients summed over the group in fp32)."""
    import titan_upipe.tsp.mlp as tsp_mlp

    dtype = getattr(torch, dtype_name)
    seq, batch = 4 * world * 2, 2
    torch.manual_seed(seed)
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
    log = CommLog()
    y, x_local, packed, norms = _run_tsp_attention(rank, group, model, module, table, shards, layout, local(x),
                                                   local(grad_y), dtype, positions, bucket, log)
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
        original = tsp_mlp.shift, tsp_mlp.start_shift
        tsp_mlp.shift = lambda t, group, step: t
        tsp_mlp.start_shift = lambda t, group, step: Pending(t, [])
    try:
        packed_mlp = shards.pack_mlp(ffn.w1.weight, ffn.w2.weight, ffn.w3.weight, rank).detach().to(dtype)
        packed_mlp.requires_grad_(True)
        x_mlp = local(x).to(dtype).requires_grad_(True)
        y_mlp = tsp_gated_mlp(x_mlp, packed_mlp, shards, group, log=log)
        y_mlp.backward(local(grad_y).to(dtype))
    finally:
        if sabotage == "ring":
            tsp_mlp.shift, tsp_mlp.start_shift = original
    expected_mlp = shards.pack_mlp(ref_mlp["dw1.weight"], ref_mlp["dw2.weight"], ref_mlp["dw3.weight"], rank)
    errors.update({"mlp out": _rel_err(y_mlp, local(ref_mlp["out"])), "mlp dx": _rel_err(x_mlp.grad, local(ref_mlp["dx"])),
                   "mlp dW (owner)": _rel_err(packed_mlp.grad, expected_mlp)})
    comm = {"counted": dict(log.received), "formula": layer_comm_bytes(shards, dim, batch, seq, dtype.itemsize)}
    if dtype != torch.float32:  # the dtype's own error: the unconverted modules run in it on one rank
        own = {}
        module_b, ffn_b = module.to(dtype), ffn.to(dtype)
        own_ref = reference_results(module_b, x.to(dtype), table, None, grad_y.to(dtype))
        # on this rank's tokens, as the TSP errors are (each normalised by the slice's own maximum)
        own["attention out"] = _rel_err(local(own_ref["out"]), local(ref["out"]))
        own["attention dx"] = _rel_err(local(own_ref["dx"]), local(ref["dx"]))
        own["attention dW (owner)"] = max(_rel_err(own_ref[f"d{w}.weight"], ref[f"d{w}.weight"])
                                          for w in ("wq", "wk", "wv", "wo"))
        xb = x.to(dtype).requires_grad_(True)
        ob = ffn_b(xb)
        ob.backward(grad_y.to(dtype))
        own["mlp out"] = _rel_err(local(ob), local(ref_mlp["out"]))
        own["mlp dx"] = _rel_err(local(xb.grad), local(ref_mlp["dx"]))
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


BF16_SEEDS = (0, 1, 2, 3)


def test_tsp_bf16_degree_3_within_twice_the_dtypes_own_error_on_every_seed():
    """Degree 3, Qwen3 12/3 heads (qk-norm), bf16, four seeds: every tensor (output, dX, each
    owner's weight gradient, the summed qk-norm weight gradients, the MLP's) within twice the
    error of the unconverted modules run in bf16 on one rank, on every rank and every seed (no
    floor). A guard of the 2x rule, not the test of the fp32 owner sums (the code before them
    passed it too; ``test_tsp_sums_each_owners_gradient_in_fp32`` is that test). Measured on CPU,
    2026-11-25, 16 seeds (scripts/tsp_bf16_error.py): worst ratio 1.92 (MLP dX); attention dX 1.69
    and dk_norm 1.58 with autograd's bf16 sums over the owners, 1.38 and 1.37 with the fp32 sums."""
    cases = [("qwen3", 12, 3, "bfloat16", None, None, seed) for seed in BF16_SEEDS]
    per_rank = run_distributed(4, _cases_on_rank, 3, cases)[:3]
    for case, results in zip(cases, zip(*per_rank, strict=True), strict=True):
        for rank, result in enumerate(results):
            for key, err in result["errors"].items():
                assert err <= 2 * result["own"][key], (case, rank, key, err, result["own"][key])


def _owner_sums_on_rank(rank, pool_size, mesh):
    """bf16 TSP attention at degree 3 with every ``fp32_summed_uses`` call spied on: each use's
    gradient captured by a hook. Per summed tensor (x, q_norm, k_norm): (its gradient == the fp32
    sum of the uses' gradients rounded once, that rounding != autograd's bf16 sum of them), for the
    real chain and for a broken variant whose uses are plain views (autograd sums them in bf16)."""
    import functools

    import titan_upipe.tsp.attention as tsp_attention_module
    from titan_upipe.tsp.grad_sum import iter_fp32_summed_uses

    world, dtype = 3, torch.bfloat16
    group = dist.new_group(list(range(world)))
    if rank >= world:
        return None
    seq = 8 * world
    torch.manual_seed(1)
    module, table = build_reference("qwen3", 12, 3, max_seq_len=2 * seq)
    x, grad_y = torch.randn(2, seq, module.wq.in_features), torch.randn(2, seq, module.wq.in_features)
    layout = ZigzagLayout(seq, ring_size=world)
    shards = TSPShards(n_heads=12, n_kv_heads=3, head_dim=HEAD_DIM, ffn_dim=12, degree=world)
    results = {}
    for variant in ("fp32 chain", "views"):
        uses = []

        def spy(t, n, variant=variant, uses=uses):
            # the aliases as the attention asks for them, one per owner (the code's lazy order)
            aliases = iter_fp32_summed_uses(t, n) if variant == "fp32 chain" else (t.view_as(t) for _ in range(n))
            grads = {}
            uses.append((t, grads, n))
            for i, alias in enumerate(aliases):
                alias.register_hook(lambda grad, i=i, grads=grads: grads.__setitem__(i, grad.clone()))
                yield alias

        original, tsp_attention_module.iter_fp32_summed_uses = tsp_attention_module.iter_fp32_summed_uses, spy
        try:
            _run_tsp_attention(rank, group, "qwen3", module, table, shards, layout, layout.shard(x, rank, seq_dim=1),
                               layout.shard(grad_y, rank, seq_dim=1), dtype, layout.positions(rank)[None])
        finally:
            tsp_attention_module.iter_fp32_summed_uses = original
        checks = []
        for t, grads, n in uses:
            per_use = [grads[i] for i in range(n)]
            # 3 bf16 terms of similar size: their fp32 sum is exact, whatever the order
            rounded_once = functools.reduce(torch.add, [g.float() for g in per_use]).to(dtype)
            checks.append((torch.equal(t.grad, rounded_once), not torch.equal(functools.reduce(torch.add, per_use),
                                                                               rounded_once)))
        results[variant] = checks
    return results


def test_tsp_sums_each_owners_gradient_in_fp32():
    """x and the qk-norm weights are used once per owner: their gradients are the fp32 sum of the
    owners' gradients, rounded to bf16 once (bitwise), on every rank. The check can fail: autograd's
    own bf16 sum differs from it for some tensor, and the plain-views variant fails it."""
    results = [r for r in run_distributed(4, _owner_sums_on_rank) if r is not None]
    chain = [check for r in results for check in r["fp32 chain"]]
    views = [check for r in results for check in r["views"]]
    assert len(chain) == len(views) == 3 * 3  # x, q_norm, k_norm on each of 3 ranks
    assert all(exact for exact, _ in chain), chain
    assert any(differs for _, differs in chain), "bf16 and fp32 sums agree everywhere: the test cannot fail"
    assert not all(exact for exact, _ in views), views


def _owner_sum_backward_peaks(rank, world, mesh):
    """Backward peak of bf16 TSP attention (live-tensor tracker) with the fp32 owner sums and with
    autograd's own bf16 sums (``iter_fp32_summed_uses`` replaced by plain uses), and the rank's |X|. Each
    the least of three runs: a collective's buffers are sometimes released a moment later (gloo's
    worker thread holds them), which adds one K/V gather or gradient buffer to a single run."""
    import gc

    import titan_upipe.tsp.attention as tsp_attention_module
    from titan_upipe.toolkit.memory_tracker import LiveTensorTracker

    torch.manual_seed(0)
    seq, heads = 128 * world, 8
    module, table = build_reference("llama3", heads, heads, max_seq_len=seq)
    layout = ZigzagLayout(seq, ring_size=world)
    shards = TSPShards(n_heads=heads, n_kv_heads=heads, head_dim=HEAD_DIM, ffn_dim=12 * world, degree=world)
    x = layout.shard(torch.randn(1, seq, module.wq.in_features), rank, seq_dim=1).to(torch.bfloat16)
    packed = shards.pack_attention(module.wq.weight, module.wk.weight, module.wv.weight, module.wo.weight, rank)
    peaks = {}
    original = tsp_attention_module.iter_fp32_summed_uses
    for name, uses in (("fp32", original), ("autograd", lambda t, n: iter([t] * n))):
        tsp_attention_module.iter_fp32_summed_uses = uses
        try:
            for _ in range(3):
                x_in, weights = x.clone().requires_grad_(True), packed.detach().to(torch.bfloat16).requires_grad_(True)
                y = tsp_attention(x_in, weights, shards, layout, mesh.get_group(), get_backend("sdpa", torch.bfloat16),
                                  HEAD_DIM ** -0.5, table, layout.positions(rank)[None], RotaryKind.COMPLEX,
                                  overlap=False)
                grad_y = torch.randn_like(y)
                gc.collect()  # no collection of earlier jobs' cycles inside the measurement
                gc.disable()
                try:
                    with LiveTensorTracker() as mem:
                        y.backward(grad_y)
                finally:
                    gc.enable()
                peaks[name] = min(peaks.get(name, mem.peak_bytes), mem.peak_bytes)
        finally:
            tsp_attention_module.iter_fp32_summed_uses = original
    return peaks, x.numel()


def test_the_fp32_owner_sum_costs_two_bytes_per_input_element():
    """Measured: the attention backward's peak with the fp32 sum of dX over the owners is autograd's
    (a bf16 sum buffer) plus exactly 2 bytes per element of the rank's X (an fp32 buffer instead)."""
    for peaks, numel in run_distributed(4, _owner_sum_backward_peaks):
        assert peaks["fp32"] - peaks["autograd"] == 2 * numel, (peaks, numel)


def _clip_across_meshes(rank, world, mesh):
    import math

    from torch.distributed.tensor import Shard, distribute_tensor

    from titan_upipe.torchtitan_common.grad_norm import clip_grad_norm_

    ring = mesh._unflatten(0, (world,), ("ring",))  # a second mesh over the same ranks, as tsp builds
    full_a, full_b = torch.arange(8.0).reshape(4, 2), torch.full((6,), 3.0)
    params = []
    for full, on in ((full_a, mesh), (full_b, ring)):
        param = torch.nn.Parameter(distribute_tensor(torch.zeros_like(full), on, [Shard(0)]))
        param.grad = distribute_tensor(full.clone(), on, [Shard(0)])
        params.append(param)
    plain = torch.nn.Parameter(torch.zeros(3))
    plain.grad = torch.full((3,), 2.0)  # a replicated plain tensor: counted once
    norm = clip_grad_norm_([*params, plain], max_norm=1.0, foreach=True)
    expected = math.sqrt(float((full_a ** 2).sum() + (full_b ** 2).sum()) + 12.0)
    scale = 1.0 / (expected + 1e-6)
    return (abs(norm.item() - expected) < 1e-5 * expected
            and torch.allclose(params[0].grad.full_tensor(), full_a * scale)
            and torch.allclose(params[1].grad.full_tensor(), full_b * scale)
            and torch.allclose(plain.grad, torch.full((3,), 2.0 * scale)))


def test_gradient_clipping_across_the_fsdp_and_tsp_meshes():
    """tsp's weights are DTensors on the TSP mesh, the rest FSDP's on another: one global norm over
    both (TorchTitan's clip_grad_norm_ refuses to stack norms across meshes), every group scaled."""
    assert run_distributed(2, _clip_across_meshes) == [True, True]


def _overlap_changes_nothing(rank, world, mesh):
    """TSP attention (2 KV-head buckets per owner) and MLP with the async prefetches on and off, the
    MLP's projections saved or recomputed: outputs and every gradient bitwise equal, and the same
    bytes received."""
    torch.manual_seed(0)
    seq, n_heads, n_kv = 16 * world, 8, 8
    module, table = build_reference("llama3", n_heads, n_kv, max_seq_len=seq)
    ffn = _feed_forward(module.wq.in_features, torch.float32)
    layout = ZigzagLayout(seq, ring_size=world)
    shards = TSPShards(n_heads=n_heads, n_kv_heads=n_kv, head_dim=HEAD_DIM, ffn_dim=ffn.w1.out_features, degree=world)
    x = layout.shard(torch.randn(2, seq, module.wq.in_features), rank, seq_dim=1)
    grad_y = torch.randn_like(x)
    runs = []
    for overlap, recompute in ((False, False), (True, True), (True, False)):
        log = CommLog()
        packed = shards.pack_attention(module.wq.weight, module.wk.weight, module.wv.weight, module.wo.weight,
                                       rank).detach().requires_grad_(True)
        packed_mlp = shards.pack_mlp(ffn.w1.weight, ffn.w2.weight, ffn.w3.weight, rank).detach().requires_grad_(True)
        x_in = x.clone().requires_grad_(True)
        y = tsp_attention(x_in, packed, shards, layout, mesh.get_group(), get_backend("sdpa", torch.float32),
                          HEAD_DIM ** -0.5, table, layout.positions(rank)[None], RotaryKind.COMPLEX,
                          bucket_kv_heads=1, log=log, overlap=overlap)
        y = tsp_gated_mlp(y, packed_mlp, shards, mesh.get_group(), log=log, overlap=overlap, recompute=recompute)
        y.backward(grad_y)
        runs.append(([y.detach(), x_in.grad, packed.grad, packed_mlp.grad], dict(log.received)))
    (first, first_bytes), *others = runs
    return all(torch.equal(a, b) and bytes_ == first_bytes for other, bytes_ in others
               for a, b in zip(first, other, strict=True))


def test_overlap_and_mlp_recompute_change_no_number():
    """The next owner's broadcast, the next bucket's K/V all-gather and the MLP ring's send/receive
    started before the compute they overlap (async), and the MLP's projections recomputed in
    backward, give the synchronous, saving run's numbers exactly."""
    assert run_distributed(4, _overlap_changes_nothing) == [True] * 4
