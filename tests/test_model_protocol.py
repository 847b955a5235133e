"""The core reads model families through ``attention.model_protocol`` (issue 43): TorchTitan's
Llama3 and Qwen3 as the adapter registers them, and the core's own RoPE, bit for bit TorchTitan's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchtitan.models.llama3.model import model as llama3
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.qwen3.model import model as qwen3
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

from titan_upipe.attention.model_protocol import MODEL_CLASSES, ModelClasses
from titan_upipe.attention.module import AttentionSpec, ContextParallelAttention
from titan_upipe.attention.projection import RotaryKind, rotate, rotate_
from titan_upipe.errors import ConfigError
from titan_upipe.torchtitan_0_2.model_classes import (
    FAMILIES,
    LLAMA3,
    QWEN3,
    FusedLlama3Transformer,
    FusedQwen3Model,
    register_model_classes,
)
from titan_upipe.transforms.model_forward import enable_fused_rope, transformed
from titan_upipe.transforms.offload import splits_at_h
from titan_upipe.transforms.tiled_mlp import is_swiglu_feed_forward

REPO = Path(__file__).resolve().parents[1]
B, L, H, D, MAX_SEQ = 2, 12, 3, 16, 40


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (so -0.0 and 0.0 differ)."""
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def _table(kind: RotaryKind) -> torch.Tensor:
    if kind is RotaryKind.COMPLEX:
        return llama3.precompute_freqs_cis(D, MAX_SEQ, 500000.0)
    return qwen3.precompute_rope_cache(D, MAX_SEQ, 1_000_000.0)


def _positions(shape: str) -> torch.Tensor | None:
    gen = torch.Generator().manual_seed(3)
    if shape == "none":
        return None
    rows = 1 if shape == "1xL" else B
    return torch.stack([torch.randperm(MAX_SEQ, generator=gen)[:L] for _ in range(rows)])


def _torchtitan_rope(kind: RotaryKind, q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, positions):
    apply = llama3.apply_rotary_emb if kind is RotaryKind.COMPLEX else qwen3.apply_rotary_emb
    return apply(q, k, table, positions)


@pytest.mark.parametrize("shape", ["none", "1xL", "BxL"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(RotaryKind), ids=lambda k: k.value)
def test_rope_is_torchtitans_bit_for_bit_values_and_gradients(kind, dtype, shape):
    """Our ``rotate`` (autograd) and ``rotate_`` (in place, no grad) against TorchTitan 0.2.2's
    ``apply_rotary_emb`` of Q and K: the same bits, and the same input gradients."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, L, H, D, generator=gen).to(dtype).requires_grad_(True)
    k = torch.randn(B, L, 1, D, generator=gen).to(dtype).requires_grad_(True)
    table, positions = _table(kind), _positions(shape)
    ours_positions = torch.arange(L)[None] if positions is None else positions
    want_q, want_k = _torchtitan_rope(kind, q, k, table, positions)
    got_q, got_k = rotate(q, table, ours_positions, kind), rotate(k, table, ours_positions, kind)
    assert torch.equal(bits(got_q), bits(want_q)) and torch.equal(bits(got_k), bits(want_k))
    with torch.no_grad():
        in_place = rotate_(q.detach().clone(), table, ours_positions, kind)
    assert torch.equal(bits(in_place), bits(want_q))

    grad_q, grad_k = torch.randn(B, L, H, D, generator=gen).to(dtype), torch.randn(B, L, 1, D, generator=gen).to(dtype)
    want = torch.autograd.grad((want_q, want_k), (q, k), (grad_q, grad_k))
    got = torch.autograd.grad((got_q, got_k), (q, k), (grad_q, grad_k))
    assert all(torch.equal(bits(g), bits(w)) for g, w in zip(got, want, strict=True))


def _attention(family: str):
    if family == "llama3":
        return llama3.Attention(TransformerModelArgs(dim=64, n_heads=4, n_kv_heads=2))
    return qwen3.Attention(Qwen3ModelArgs(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True))


def test_the_adapter_registers_llama3_and_qwen3_once_and_lookups_follow_isinstance():
    classes = ModelClasses()
    register_model_classes(classes)
    register_model_classes(classes)  # idempotent
    assert classes.families == FAMILIES and classes.names() == "Llama3 and Qwen3"
    assert MODEL_CLASSES.families == FAMILIES  # register_plugin (conftest) registered them with the core

    class SubAttention(llama3.Attention):
        pass

    sub = SubAttention(TransformerModelArgs(dim=64, n_heads=4, n_kv_heads=2))
    assert classes.attention_family(sub) is LLAMA3 and classes.attention_family(_attention("qwen3")) is QWEN3
    assert classes.attention_family(torch.nn.Linear(2, 2)) is None
    block = qwen3.TransformerBlock(0, Qwen3ModelArgs(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96))
    assert classes.block_family(block) is QWEN3 and classes.feed_forward_family(block.feed_forward) is QWEN3
    assert splits_at_h(block) and is_swiglu_feed_forward(block.feed_forward) and not is_swiglu_feed_forward(None)
    assert classes.model_family(FusedLlama3Transformer.__new__(FusedLlama3Transformer)) is LLAMA3

    class SubModel(qwen3.Qwen3Model):  # its own forward: never swapped for the fused one
        pass

    assert classes.model_family(SubModel.__new__(SubModel)) is None


def test_registration_refuses_a_second_record_of_a_name_or_of_a_class():
    classes = ModelClasses()
    classes.register(LLAMA3)
    with pytest.raises(ValueError, match="'Llama3' is registered already"):
        classes.register(QWEN3.__class__(**{**vars(QWEN3), "name": "Llama3"}))
    with pytest.raises(ValueError, match=r"Attention \(Llama3\)"):
        classes.register(QWEN3.__class__(**{**vars(QWEN3), "attention": llama3.Attention}))


def test_an_unregistered_class_is_refused_with_how_to_register():
    with pytest.raises(ConfigError, match=r"none is: titan_upipe.torchtitan_0_2.registry.register_plugin\(\)"):
        AttentionSpec.of(_attention("llama3"), ModelClasses())
    with pytest.raises(ConfigError, match="supports the registered Llama3 and Qwen3 Attention modules; got Linear"):
        AttentionSpec.of(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_spec_reads_the_family_scale_and_rope_kind(family):
    module = _attention(family)
    spec = AttentionSpec.of(module)
    assert spec.rotary is (RotaryKind.COMPLEX if family == "llama3" else RotaryKind.COS_SIN)
    assert spec.scale == (module.head_dim**-0.5 if family == "llama3" else module.scaling)
    assert spec.qk_norm == (family == "qwen3") and (spec.n_heads, spec.n_kv_heads, spec.head_dim) == (4, 2, 16)
    assert ContextParallelAttention.__name__ not in {cls.__name__ for f in FAMILIES for cls in f.classes()}


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_fused_models_keep_their_fqns_and_state_dict(family):
    if family == "llama3":
        model = llama3.Transformer(TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                                                        max_seq_len=32))
    else:
        model = qwen3.Qwen3Model(Qwen3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                                hidden_dim=96, vocab_size=64, max_seq_len=32))
    keys, names = list(model.state_dict()), [n for n, _ in model.named_parameters()]
    fused = FusedLlama3Transformer if family == "llama3" else FusedQwen3Model
    assert transformed(model) is model and type(model) is fused and transformed(model) is model
    enable_fused_rope(model)
    assert model.fused_rope_kind is (LLAMA3 if family == "llama3" else QWEN3).rotary
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == names
    with torch.no_grad():
        model.init_weights()  # the compact table, through the overridden _precompute_* method
    assert model._rope_buffer.shape == (8,) and model._rope_buffer.dtype == torch.float32


def test_importing_registers_nothing():
    code = ("import titan_upipe.torchtitan_0_2.model_classes, titan_upipe.transforms.surgery\n"
            "from titan_upipe.attention.model_protocol import MODEL_CLASSES\n"
            "assert MODEL_CLASSES.families == (), MODEL_CLASSES.families\n"
            "from titan_upipe.torchtitan_0_2.registry import register_plugin\n"
            "register_plugin(); register_plugin()\n"
            "assert MODEL_CLASSES.names() == 'Llama3 and Qwen3'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "TITAN_UPIPE_DEVICE": "cpu", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]


def test_an_empty_registry_stops_the_transforms_instead_of_leaving_modules_alone(monkeypatch):
    """Before any registration, the offload split and the tiled MLP would answer "not a known module"
    for every block and feed-forward, turning themselves off without a word: they refuse instead."""
    empty = ModelClasses()
    monkeypatch.setattr("titan_upipe.transforms.offload.MODEL_CLASSES", empty)
    monkeypatch.setattr("titan_upipe.transforms.tiled_mlp.MODEL_CLASSES", empty)
    args = TransformerModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=32)
    block = llama3.TransformerBlock(0, args)
    with pytest.raises(ConfigError, match="offloaded checkpointing needs the model classes registered"):
        splits_at_h(block)
    with pytest.raises(ConfigError, match="tiled_mlp needs the model classes registered"):
        is_swiglu_feed_forward(block.feed_forward)
