"""Memory transforms, single process: exactness against the untransformed modules and measured memory."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from fake_meshes import OneRankMesh
from torch import nn

from titan_upipe.toolkit.memory_tracker import LiveTensorTracker
from titan_upipe.transforms.fused_ce import ChunkedLinearCrossEntropy
from titan_upipe.transforms.model_forward import FinalHiddenStates, enable_fused_rope
from titan_upipe.transforms.offload import OFFLOAD_STATS, apply_offloaded_ac
from titan_upipe.transforms.surgery import fuse_cross_entropy, tile_feed_forwards, tile_rms_norms
from titan_upipe.transforms.tiled_mlp import TiledFeedForward
from titan_upipe.transforms.tiled_rmsnorm import TiledRMSNorm

FP32_RTOL = 1e-6
BF16_RTOL = 2e-2  # stated bf16 tolerance: a few bf16 ulps (2^-8) of the largest element


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-30)).item()


def llama3(n_layers=2, dim=64, vocab=300, max_seq_len=256, **kw):
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    args = TransformerModelArgs(dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=vocab,
                                multiple_of=32, rope_theta=500000, max_seq_len=max_seq_len, **kw)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def qwen3(n_layers=2, dim=64, vocab=300, max_seq_len=256):
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model

    args = Qwen3ModelArgs(dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=160,
                          vocab_size=vocab, qk_norm=True, rope_theta=1000000, max_seq_len=max_seq_len,
                          enable_weight_tying=False)
    model = Qwen3Model(args)
    with torch.no_grad():
        model.init_weights()
    return model


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


def compare_module(ref: nn.Module, converted: nn.Module, x: torch.Tensor, rtol: float) -> dict[str, float]:
    """Forward and all gradients of ``converted`` against ``ref`` (independent copies)."""
    grad_y = None
    errors = {}
    outs = []
    for module in (ref, converted):
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        if grad_y is None:
            grad_y = torch.randn_like(y)
        y.backward(grad_y)
        outs.append((y.detach(), xi.grad, grads(module)))
    (y0, dx0, g0), (y1, dx1, g1) = outs
    assert set(g0) == set(g1) and g0
    errors["out"], errors["dx"] = rel_err(y1, y0), rel_err(dx1, dx0)
    errors.update({f"d{name}": rel_err(g1[name], g0[name]) for name in g0})
    assert max(errors.values()) <= rtol, errors
    return errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_tiled_mlp_matches_feed_forward(family, dtype):
    torch.manual_seed(0)
    model = (llama3 if family == "llama3" else qwen3)(n_layers=1)
    ref = model.layers["0"].feed_forward.to(dtype)
    converted = TiledFeedForward(copy.deepcopy(ref), tile_tokens=24)  # 3 batches x 40 tokens: ragged tiles
    x = torch.randn(3, 40, 64, dtype=dtype)
    compare_module(ref, converted, x, FP32_RTOL if dtype == torch.float32 else BF16_RTOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_rmsnorm_matches_rmsnorm(dtype):
    torch.manual_seed(0)
    ref = nn.RMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    converted = TiledRMSNorm(copy.deepcopy(ref), tile_tokens=7)
    x = torch.randn(2, 33, 64, dtype=dtype) * 3
    errors = compare_module(ref, converted, x, FP32_RTOL if dtype == torch.float32 else BF16_RTOL)
    if dtype == torch.float32:
        assert errors["out"] <= 1e-7  # each row is F.rms_norm's own result


def test_tiled_rmsnorm_keeps_the_parameter_and_state_dict():
    ref = nn.RMSNorm(16)
    converted = TiledRMSNorm(ref, tile_tokens=4)
    assert converted.weight is ref.weight and converted.eps == ref.eps
    assert list(converted.state_dict()) == list(ref.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_matches_linear_and_cross_entropy(dtype):
    from torchtitan.components.loss import cross_entropy_loss

    torch.manual_seed(0)
    hidden = torch.randn(2, 37, 32, dtype=dtype)
    weight = (torch.randn(300, 32) * 0.2).to(dtype)
    labels = torch.randint(0, 300, (2, 37))
    labels[0, :5] = -100  # ignored tokens
    results = []
    for fused in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = (ChunkedLinearCrossEntropy.apply(h, w, labels, 10) if fused
                else cross_entropy_loss(F.linear(h, w), labels))
        (loss / 69.0).backward()
        results.append((loss.detach(), h.grad, w.grad))
    rtol = FP32_RTOL if dtype == torch.float32 else BF16_RTOL
    for got, want in zip(results[1], results[0], strict=True):
        assert rel_err(got, want) <= rtol, (rel_err(got, want), dtype)
    assert results[1][0].dtype == torch.float32


def test_fused_ce_never_allocates_logits():
    torch.manual_seed(0)
    model = llama3(vocab=512)
    tokens = torch.randint(0, 512, (2, 64))
    labels = torch.randint(0, 512, (2, 64))
    n_tokens, vocab = tokens.numel(), 512
    fuse_cross_entropy(model, chunk_tokens=0, backend="torch")
    sizes = []

    class Sizes(LiveTensorTracker):
        def _account(self, t, op, input_storages=frozenset()):
            sizes.append(t.numel())
            super()._account(t, op, input_storages)

    with Sizes():
        pred = model(tokens)
        assert isinstance(pred, FinalHiddenStates)
        pred.loss_sum(labels).backward()
    assert sizes and max(sizes) < n_tokens * vocab
    # The same tracker sees the stock path allocate the [tokens, vocab] logits.
    sizes.clear()
    with Sizes():
        F.linear(pred.hidden.detach(), model.output.weight)
    assert max(sizes) == n_tokens * vocab


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_model_with_all_transforms_matches_plain_model(family):
    """fp32: logits path replaced by fused CE, tiled MLP/norms, fused RoPE (batch positions too)."""
    from torchtitan.components.loss import cross_entropy_loss

    torch.manual_seed(0)
    plain = (llama3 if family == "llama3" else qwen3)()
    converted = copy.deepcopy(plain)
    enable_fused_rope(converted)
    tile_feed_forwards(converted, 16)
    tile_rms_norms(converted, 8)
    fuse_cross_entropy(converted, chunk_tokens=24, backend="torch")
    rope_buffer = "freqs_cis" if family == "llama3" else "rope_cache"
    assert getattr(converted, rope_buffer).numel() == 8  # D/2 inverse frequencies instead of [256, ...]
    tokens = torch.randint(0, 300, (2, 48))
    labels = torch.randint(0, 300, (2, 48))
    for positions in (None, torch.arange(48).unsqueeze(0) + 5, torch.arange(96).view(2, 48)):
        plain.zero_grad()
        converted.zero_grad()
        ref_loss = cross_entropy_loss(plain(tokens, positions=positions), labels)
        ref_loss.backward()
        loss = converted(tokens, positions=positions).loss_sum(labels)
        loss.backward()
        assert rel_err(loss, ref_loss) <= FP32_RTOL
        for (name, p), q in zip(plain.named_parameters(), converted.parameters(), strict=True):
            assert rel_err(q.grad, p.grad) <= FP32_RTOL, name
    # Sensitivity: other relative positions change the loss (a constant shift would not: RoPE).
    with torch.no_grad():
        spread = converted(tokens, positions=torch.arange(48).unsqueeze(0) * 3).hidden
        assert rel_err(spread, converted(tokens).hidden) > 100 * FP32_RTOL


def test_fused_rope_init_weights_builds_no_full_table():
    model = llama3(max_seq_len=4096)
    enable_fused_rope(model)
    with torch.no_grad():
        model.init_weights()
    assert model.freqs_cis.shape == (8,) and model.freqs_cis.dtype == torch.float32


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_in_place_rope_equals_torchtitan_rope_bit_for_bit_in_fp32_and_bf16(family):
    """UPipe's recompute uses the in-place RoPE while autograd uses TorchTitan's formula: they must
    agree exactly, in fp32 and bf16, or recomputed gradients drift from the reference (and a block
    keeping its attention would replay results of other Q/K than its backward rebuilds)."""
    from torchtitan.models.llama3.model.model import precompute_freqs_cis
    from torchtitan.models.qwen3.model.model import precompute_rope_cache

    from titan_upipe.attention.projection import RotaryKind, rotate, rotate_

    torch.manual_seed(0)
    if family == "llama3":
        kind, table = RotaryKind.COMPLEX, precompute_freqs_cis(64, 512, 5e5)
    else:
        kind, table = RotaryKind.COS_SIN, precompute_rope_cache(64, 512, 1e6)
    x = torch.randn(2, 300, 3, 64) * 10
    positions = torch.randint(0, 512, (2, 300))
    for dtype in (torch.float32, torch.bfloat16):  # bf16 too: a kept attention's recorded Q/K are rotate_'s
        want = rotate(x.to(dtype), table, positions, kind)
        got = rotate_(x.to(dtype), table, positions, kind)
        assert torch.equal(got, want), (dtype, (got.float() - want.float()).abs().max())


@pytest.mark.parametrize("fused_rope_first", [True, False])
def test_fused_rope_turns_on_in_place_rope_in_cp_attention_in_either_order(fused_rope_first, monkeypatch):
    """``fused_rope`` makes the CP attention rotate in place (where no gradient is recorded)
    whichever converter runs first; without it the attention keeps TorchTitan's RoPE."""
    import titan_upipe.attention.projection as projection
    from titan_upipe.torchtitan_0_2.converters import UPipeConverter

    converter = UPipeConverter.__new__(UPipeConverter)
    from titan_upipe.attention.backends import BackendChoice
    from titan_upipe.spec.cp_layout import CPLayout

    converter.cp_mesh = OneRankMesh()
    converter.layout = CPLayout(None)  # heads_per_stage 0: U = the mesh's one Ulysses rank
    converter.backend_choice, converter.compute_dtype = BackendChoice("sdpa", "sdpa"), torch.float32
    plain, fused = llama3(), llama3()
    fused.load_state_dict(plain.state_dict())
    converter.convert(plain)
    if fused_rope_first:
        enable_fused_rope(fused)
        converter.convert(fused)
    else:
        converter.convert(fused)
        enable_fused_rope(fused)
    assert {b.attention.in_place_rope for b in plain.layers.values()} == {False}
    assert {b.attention.in_place_rope for b in fused.layers.values()} == {True}

    calls = []
    monkeypatch.setattr(projection, "rotate_", lambda *a: calls.append(1) or projection.rotate(*a))
    tokens = torch.randint(0, 300, (1, 32))
    positions = torch.arange(32).unsqueeze(0)
    with torch.no_grad():
        want = plain(tokens, positions=positions)
        assert not calls
        got = fused(tokens, positions=positions)
    assert calls  # the in-place path ran, and computes the same logits
    assert rel_err(got, want) <= FP32_RTOL


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_offloaded_checkpoint_matches_and_keeps_inputs_on_host(family):
    torch.manual_seed(0)
    plain = (llama3 if family == "llama3" else qwen3)(n_layers=3)
    converted = copy.deepcopy(plain)
    apply_offloaded_ac(converted, pin_memory=True)
    tokens = torch.randint(0, 300, (2, 32))
    plain(tokens).square().mean().backward()

    # Hooks on the wrappers and submodules, not the blocks: a block's own hooks select the
    # whole-block checkpoint, and this test is about the split one TorchTitan blocks get.
    inputs: list[weakref.ref] = []
    hiddens: list[weakref.ref] = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
             for layer in converted.layers.values()]
    hooks += [layer._checkpoint_wrapped_module.ffn_norm.register_forward_pre_hook(
        lambda m, args: hiddens.append(weakref.ref(args[0]))) for layer in converted.layers.values()]
    before = (OFFLOAD_STATS.saved_tensors, OFFLOAD_STATS.host_bytes)
    out = converted(tokens)
    # Between forward and backward: every block input lives in the offload buffer, none elsewhere,
    # and no block keeps h (the residual stream after attention).
    assert OFFLOAD_STATS.saved_tensors - before[0] == 3
    assert OFFLOAD_STATS.host_bytes - before[1] == 3 * 2 * 32 * 64 * 4
    assert len(inputs) == 3 and all(ref() is None for ref in inputs)
    assert len(hiddens) == 3 and all(ref() is None for ref in hiddens)
    out.square().mean().backward()
    assert (OFFLOAD_STATS.saved_tensors, OFFLOAD_STATS.host_bytes) == before
    for hook in hooks:
        hook.remove()
    for (name, p), q in zip(plain.named_parameters(), converted.parameters(), strict=True):
        assert torch.equal(q.grad, p.grad), name  # same ops in the same order: bit for bit
    # Sensitivity: TorchTitan's full AC (non-reentrant) keeps the block inputs alive.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    stock = copy.deepcopy(plain)
    for name, block in list(stock.layers.named_children()):
        stock.layers.register_module(name, checkpoint_wrapper(block))
    inputs.clear()
    for layer in stock.layers.values():
        layer._checkpoint_wrapped_module.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
    out = stock(tokens)
    assert sum(ref() is not None for ref in inputs) >= 2
    del out


def test_offloaded_backward_frees_the_recomputed_block_output():
    """The wrapper's backward does not hold the recomputed block output while the block
    backpropagates: its peak is at least one output below a recompute that holds it."""
    from titan_upipe.transforms.offload import OffloadedCheckpointWrapper, OffloadSchedule

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            return x + self.lin(torch.relu(x))  # a residual block: the add saves nothing

    torch.manual_seed(0)
    block = Block()
    x, grad = torch.randn(512, 64), torch.randn(512, 64)
    out_bytes = x.numel() * x.element_size()

    def holding_output():
        leaf = x.clone().requires_grad_(True)
        with torch.enable_grad():
            out = block(leaf)
        torch.autograd.backward(out, grad)  # the output stays referenced during backward
        return leaf.grad

    wrapped = OffloadedCheckpointWrapper(block, OffloadSchedule(pin_memory=False), first_block=True)
    leaf = x.clone().requires_grad_(True)
    y = wrapped(leaf)
    with LiveTensorTracker() as mem:
        y.backward(grad)
    wrapper_peak = mem.peak_bytes
    with LiveTensorTracker() as mem:
        want = holding_output()
    block.zero_grad(set_to_none=True)
    assert torch.equal(leaf.grad, want)
    assert mem.peak_bytes - wrapper_peak >= out_bytes, (mem.peak_bytes, wrapper_peak, out_bytes)


class _NotATitanBlock(nn.Module):
    """A TorchTitan block behind a generic module: offloading checkpoints it as one Function."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x, *args):
        return self.block(x, *args)


def test_offloaded_llama3_block_frees_the_output_gradient_before_the_attention_backward():
    """The engine holds a Function's incoming gradient until its backward returns. A TorchTitan
    block's checkpoint is split at h, so the block output's gradient is dead when the attention
    backward runs, and that phase's peak is one hidden state below the whole-block Function's."""
    from titan_upipe.transforms.offload import OffloadedCheckpointWrapper, OffloadSchedule

    torch.manual_seed(0)
    model = llama3(n_layers=1, max_seq_len=512)
    block = model.layers["0"]
    x, weight = torch.randn(2, 512, 64), torch.randn(2, 512, 64)
    hidden_bytes = x.numel() * x.element_size()

    def attention_backward(module: nn.Module) -> tuple[bool, int]:
        """Whether the block output's gradient is alive when the attention backward starts, and
        the peak bytes from there to the end of backward."""
        wrapped = OffloadedCheckpointWrapper(module, OffloadSchedule(pin_memory=False), first_block=True)
        grad_out: list[weakref.ref] = []
        alive: list[bool] = []

        def on_attention_grad(grad: torch.Tensor) -> None:
            alive.append(grad_out[0]() is not None)
            mem.reset_peak()

        def on_attention_forward(m, args, out):
            if out.requires_grad:  # the recompute inside backward
                out.register_hook(on_attention_grad)

        hook = block.attention.register_forward_hook(on_attention_forward)
        block.zero_grad(set_to_none=True)  # both runs allocate the parameter gradients alike
        with LiveTensorTracker() as mem:
            y = wrapped(x.clone().requires_grad_(True), model.freqs_cis, None)
            y.register_hook(lambda grad: grad_out.append(weakref.ref(grad)))
            # The engine makes y's gradient (y * weight); the test keeps only a weakref to it.
            (y * weight).sum().backward()
        hook.remove()
        assert len(grad_out) == 1 and len(alive) == 1
        return alive[0], mem.peak_bytes

    split_alive, split_peak = attention_backward(block)
    whole_alive, whole_peak = attention_backward(_NotATitanBlock(block))
    assert not split_alive
    assert whole_alive  # sensitivity: one Function for the whole block keeps the gradient
    assert whole_peak - split_peak >= hidden_bytes, (whole_peak, split_peak, hidden_bytes)


def test_offloaded_titan_block_with_its_own_hooks_still_runs_them():
    """Running a block's halves directly would skip hooks on the block itself (e.g. FSDP applied
    to the block, not the wrapper): such a block gets the whole-block checkpoint."""
    from titan_upipe.transforms.offload import OffloadedCheckpointWrapper, OffloadSchedule

    torch.manual_seed(0)
    plain = llama3(n_layers=1)
    hooked = copy.deepcopy(plain)
    block = hooked.layers["0"]
    calls: list[str] = []
    block.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    block.register_forward_hook(lambda m, args, out: calls.append("post"))
    hooked.layers.register_module("0", OffloadedCheckpointWrapper(block, OffloadSchedule(False), first_block=True))
    tokens = torch.randint(0, 300, (2, 32))
    plain(tokens).square().mean().backward()
    hooked(tokens).square().mean().backward()
    assert calls == ["pre", "post", "pre", "post"]  # forward, and the recompute in backward
    for (name, p), q in zip(plain.named_parameters(), hooked.parameters(), strict=True):
        assert torch.equal(q.grad, p.grad), name


def test_offloaded_checkpoint_keeps_parameter_fqns_clean():
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    plain = llama3()
    converted = copy.deepcopy(plain)
    apply_offloaded_ac(converted, pin_memory=False)
    assert list(get_model_state_dict(converted)) == list(get_model_state_dict(plain))


def test_tiled_mlp_peak_intermediates_scale_with_tile():
    torch.manual_seed(0)
    ff = llama3(n_layers=1, dim=64).layers["0"].feed_forward
    hidden = ff.w1.out_features
    x = torch.randn(1, 512, 64)
    grad_y = torch.randn(1, 512, 64)

    def measure(module) -> tuple[int, int]:
        xi = x.clone().requires_grad_(True)
        with LiveTensorTracker() as mem:
            y = module(xi)
            saved = mem.current_bytes - y.numel() * 4  # what forward keeps besides its output
            mem.reset_peak()
            y.backward(grad_y)
        return saved, mem.peak_bytes

    plain_saved, plain_peak = measure(ff)
    tiled_saved, tiled_peak = measure(TiledFeedForward(ff, tile_tokens=64))
    # Plain: w1 x, w3 x, silu(w1 x), product -> 4 x S x hidden fp32 values kept.
    assert plain_saved >= 4 * 512 * hidden * 4
    assert tiled_saved == 0
    # Backward peak of the tiled version: weight grads (fp32 accumulators + results) and
    # dx plus one tile's intermediates; the intermediate part is ~ tile / S of the plain one.
    weights = 3 * 64 * hidden * 4
    plain_intermediate = plain_peak - weights - x.numel() * 4
    tiled_intermediate = tiled_peak - 2 * weights - x.numel() * 4
    ratio = tiled_intermediate / plain_intermediate
    assert ratio < 2.5 * 64 / 512, (ratio, plain_peak, tiled_peak)


TRANSFORMS_CONFIG = "configs/debug/llama3_upipe_transforms.toml"


def transforms_job(*overrides: str):
    from titan_upipe.torchtitan_0_2.config_parse import parse_config

    return parse_config(["--job.config_file", TRANSFORMS_CONFIG, *overrides])


def test_transforms_config_is_valid_and_parsed():
    from titan_upipe.torchtitan_0_2.checks import check_job

    job = transforms_job()
    check_job(job, world_size=2)
    assert job.activation_checkpoint.cpu_offload and isinstance(job.activation_checkpoint.pin_memory, bool)
    assert job.activation_checkpoint.mode == "full"  # TorchTitan's own field, same section
    assert (job.transforms.mlp_tile_tokens, job.transforms.ce_backend) == (0, "auto")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("--model.converters", "upipe,tiled_mpl"), r"unknown name\(s\) \['tiled_mpl'\]: valid values are .*tiled_mlp"),
        (("--model.converters", "upipe,fused_ce,fused_ce"), "more than once"),
        (("--activation_checkpoint.mode", "none"), r"cpu_offload = true needs activation_checkpoint.mode = \"full\""),
        (("--activation_checkpoint.mode", "selective"), "valid values with offload: full"),
        (("--compile.enable",), "does not support compile.enable"),
        (("--transforms.ce_backend", "liger"), "ce_backend = 'liger' needs CUDA and liger-kernel"),
    ],
)
def test_invalid_transform_jobs_are_rejected_before_any_process_group(overrides, message):
    from titan_upipe.torchtitan_0_2.checks import check_job
    from titan_upipe.torchtitan_0_2.config import ConfigError

    if "liger" in overrides and torch.cuda.is_available():
        pytest.skip("CUDA present: liger may be usable")
    with pytest.raises(ConfigError, match=message):
        check_job(transforms_job(*overrides), world_size=2)


@pytest.mark.parametrize("key", ["mlp_tile_tokens", "rmsnorm_tile_tokens", "ce_chunk_tokens"])
def test_negative_tile_sizes_name_the_key(tmp_path, key):
    from titan_upipe.torchtitan_0_2.config import ConfigError
    from titan_upipe.torchtitan_0_2.config_parse import parse_config

    path = tmp_path / "job.toml"
    path.write_text(f"[transforms]\n{key} = -4\n")
    with pytest.raises(ConfigError, match=f"transforms.{key} = -4: valid values are 0 .automatic"):
        parse_config(["--job.config_file", str(path)])


@pytest.mark.parametrize("hooked", [False, True], ids=["split-block", "whole-block"])
@pytest.mark.parametrize("late", [False, True], ids=["prefetch-before-recompute", "prefetch-after-attention"])
def test_offload_prefetch_starts_before_the_recompute_or_after_the_attention_backward(monkeypatch, late, hooked):
    """``prefetch_after_attention``: the copy of the input the next block's backward needs starts
    after this block's attention backward (the backward peak), not before its recompute; the
    gradients are unchanged (bit for bit)."""
    from titan_upipe.transforms import offload

    events: list[tuple[str, int]] = []
    real_prefetch = offload.OffloadedInput.prefetch
    start, held = offload.OFFLOAD_STATS.prefetched_bytes, []

    def spy(slot):
        events.append(("prefetch", slot.block))
        real_prefetch(slot)
        held.append(offload.OFFLOAD_STATS.prefetched_bytes - start)

    monkeypatch.setattr(offload.OffloadedInput, "prefetch", spy)
    torch.manual_seed(0)
    plain = llama3(n_layers=3)
    converted = copy.deepcopy(plain)
    apply_offloaded_ac(converted, pin_memory=False, prefetch_after_attention=late)
    for index, layer in enumerate(converted.layers.values()):
        block = layer._checkpoint_wrapped_module
        if hooked:  # a block hook of its own selects the whole-block checkpoint Function
            block.register_forward_hook(lambda *args: None)
        block.attention.register_full_backward_hook(lambda m, gi, go, i=index: events.append(("attention", i)))
        block.attention_norm.register_forward_pre_hook(lambda m, a, i=index: events.append(("recompute", i)))
    created = []
    real_init = offload.OffloadedInput.__init__

    def numbered(slot, *args, **kwargs):
        real_init(slot, *args, **kwargs)
        slot.block = len(created)
        created.append(slot)

    monkeypatch.setattr(offload.OffloadedInput, "__init__", numbered)
    tokens = torch.randint(0, 300, (2, 32))
    plain(tokens).square().mean().backward()
    converted(tokens).square().mean().backward()
    backward = events[events.index(("recompute", 2)) + 1:]  # after the forward (blocks 0, 1, 2)
    for block in (2, 1):
        prefetch = backward.index(("prefetch", block - 1))
        if late:
            assert backward.index(("attention", block)) < prefetch < backward.index(("recompute", block - 1))
        else:
            assert prefetch < backward.index(("attention", block))
    # The inputs copied ahead of their block's backward (device memory a CPU run must count as
    # such): early, block 0's copy starts while block 1's own prefetched copy is still counted
    # (fetched just after); late, each is alone. Every count is taken back by the fetch.
    one_input = 2 * 32 * 64 * 4
    assert held == ([one_input, one_input] if late else [one_input, 2 * one_input])
    assert offload.OFFLOAD_STATS.prefetched_bytes == start
    for (name, p), q in zip(plain.named_parameters(), converted.parameters(), strict=True):
        assert torch.equal(q.grad, p.grad), name


def test_resident_blocks_keep_the_last_inputs_on_the_device():
    """``resident_blocks = 2`` of 3: only block 0's input goes to the host; gradients bit for bit."""
    torch.manual_seed(0)
    plain = llama3(n_layers=3)
    converted = copy.deepcopy(plain)
    apply_offloaded_ac(converted, pin_memory=False, resident_blocks=2)
    tokens = torch.randint(0, 300, (2, 32))
    plain(tokens).square().mean().backward()
    before = (OFFLOAD_STATS.saved_tensors, OFFLOAD_STATS.host_bytes)
    out = converted(tokens)
    assert OFFLOAD_STATS.saved_tensors - before[0] == 1 and OFFLOAD_STATS.host_bytes - before[1] == 2 * 32 * 64 * 4
    out.square().mean().backward()
    assert (OFFLOAD_STATS.saved_tensors, OFFLOAD_STATS.host_bytes) == before
    for (name, p), q in zip(plain.named_parameters(), converted.parameters(), strict=True):
        assert torch.equal(q.grad, p.grad), name
