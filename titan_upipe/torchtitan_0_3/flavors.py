"""A TorchTitan 0.3 model's shape as the core's ``ModelDims``.

0.3 has no train-spec registry: each family module ``torchtitan.models.<family>`` has a
``model_registry(flavor) -> ModelSpec`` and a ``<family>_configs`` dict of flavors. A
``ModelSpec.model`` is a tree of ``Module.Config`` objects; the shape is read off it:

============== ===========================================================================
``ModelDims``  read from (``layer`` = every ``model.layers[i]``, which must agree)
============== ===========================================================================
dim            ``model.dim``
n_layers       ``len(model.layers)``
n_heads, KV    ``layer.attention.n_heads``, ``.n_kv_heads`` (None: = n_heads)
head_dim       ``layer.attention.head_dim`` (None: ``dim / n_heads``, as Llama3 sets it)
ffn_dim        ``layer.feed_forward.w1.out_features`` (SwiGLU; MoE blocks are refused)
vocab, tied    ``model.vocab_size``, ``model.enable_weight_tying``
qk_norm        ``layer.attention.qk_norm`` is set (Qwen3)
rope           the RoPE config's class: ``ComplexRoPE`` -> "llama3", ``CosSinRoPE`` -> "qwen3"
============== ===========================================================================

The model names are the plugin's (``upipe_llama3``, ``upipe_qwen3``: the ones the TOML recipes
name under TorchTitan 0.2 too) or TorchTitan's families (``llama3``, ``qwen3``). The plugin's names
add the debug flavors of 0.2 (:data:`DEBUG_FLAVORS`, the same shapes: 2 blocks, d = 128, 8 / 2 heads
of 16, the embedded tokenizer's 512 ids), built with 0.3's public config builders: separate Q/K/V
projections and SDPA inside (causal rows, as 0.2's ``debug`` runs them).

The context-parallel attention reads ``wq``/``wk``/``wv`` (``model_classes``); TorchTitan's own
flavors fuse them into one ``wqkv``, so a job with a CP converter builds them separate
(:func:`with_separate_qkv`). Both save the same checkpoint keys (``qkv_linear.wq.weight``, ...).
"""

from __future__ import annotations

import dataclasses
import importlib
from functools import partial

from torch import nn

from titan_upipe.data.tokenizer import VOCAB_SIZE
from titan_upipe.errors import ConfigError, with_suggestion
from titan_upipe.spec.model_dims import ModelDims

FAMILIES = {"upipe_llama3": "llama3", "upipe_qwen3": "qwen3", "llama3": "llama3", "qwen3": "qwen3"}
"""``model.name`` -> the TorchTitan 0.3 family module under ``torchtitan.models``."""

ROPE_KINDS = {"ComplexRoPE": "llama3", "CosSinRoPE": "qwen3"}
"""0.3's RoPE classes -> the core's rotary kind (``ModelDims.rope``)."""


def family_module(model_name: str):
    """``torchtitan.models.<family>`` of ``model_name`` (ConfigError naming the valid ones)."""
    if model_name not in FAMILIES:
        raise ConfigError(with_suggestion(f"model.name = {model_name!r} is not a model titan_upipe runs on "
                                          f"TorchTitan 0.3: valid values are {', '.join(FAMILIES)}",
                                          model_name, FAMILIES))
    return importlib.import_module(f"torchtitan.models.{FAMILIES[model_name]}")


DEBUG_SHAPES = {"debug": 2, "debug_mha": 8, "debug_kv4": 4, "debug_flex": 2}
"""The plugin's debug flavors on 0.3: name -> KV heads (of 8 query heads; the rest as 0.2's)."""
QWEN3_DEBUG_FLAVORS = ("debug", "debug_flex")
DOCUMENT_FLAVORS = ("debug_flex",)
"""Flavors whose rows are packed documents (0.2's ``attn_mask_type = "block_causal"``): each ends at the
tokenizer's EOS, attends within itself; RoPE positions run through the row, as on 0.2. The plugin's CP
attention applies the documents (``cp_inputs``); 0.3's own attention does not, so these need a CP mode."""


def packs_documents(flavor: str) -> bool:
    return flavor in DOCUMENT_FLAVORS


def debug_flavors(model_name: str) -> tuple[str, ...]:
    """The plugin's debug flavors of ``model_name`` (none for TorchTitan's own names)."""
    if model_name == "upipe_llama3":
        return tuple(DEBUG_SHAPES)
    return QWEN3_DEBUG_FLAVORS if model_name == "upipe_qwen3" else ()


def model_flavors(model_name: str) -> dict:
    """The flavors of ``model_name``: its family's ``<family>_configs`` (name -> config function), and
    the plugin's debug flavors for the plugin's names."""
    return {**family_configs(model_name), **{flavor: partial(debug_model, model_name, flavor) for flavor in debug_flavors(model_name)}}


def model_spec(model_name: str, flavor: str):
    """The 0.3 ``ModelSpec`` of ``model_name``'s ``flavor`` (ConfigError naming the valid flavors)."""
    flavors = model_flavors(model_name)
    if flavor not in flavors:
        raise ConfigError(with_suggestion(f"model.flavor = {flavor!r} is not a flavor of {model_name} on TorchTitan "
                                          f"0.3: valid values are {', '.join(flavors)}", flavor, flavors))
    family = family_module(model_name)
    if flavor in debug_flavors(model_name):
        # The family's spec (its parallelize, pipelining and checkpoint adapter) with the debug model.
        return dataclasses.replace(family.model_registry(next(iter(family_configs(model_name)))),
                                   flavor=flavor, model=debug_model(model_name, flavor))
    return family.model_registry(flavor)


def family_configs(model_name: str) -> dict:
    return getattr(family_module(model_name), f"{FAMILIES[model_name]}_configs")


def _normal(std: float, truncated: bool) -> dict:
    init = partial(nn.init.trunc_normal_, std=std) if truncated else partial(nn.init.normal_, std=std)
    return {"weight": init, "bias": nn.init.zeros_}


def debug_model(model_name: str, flavor: str):
    """A plugin debug flavor as a 0.3 model config: 0.2's model math (``torchtitan_0_2.flavors``: the same
    shapes, norms and RoPE, so a 0.2 checkpoint gives the same losses), separate Q/K/V, SDPA. Llama3:
    complex RoPE (theta 5e5, Llama 3.1 scaling), norm eps 1e-5; Qwen3: QK norms, cos||sin RoPE (theta
    1e6), eps 1e-6. The random init is this flavor's own (std 0.02 for every linear, no depth scaling):
    runs compared across versions start from one checkpoint."""
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.common.feed_forward import compute_ffn_hidden_dim

    dim, n_heads, head_dim, n_layers = 128, 8, 16, 2
    qwen = model_name == "upipe_qwen3"
    family = family_module(model_name)
    model_class = family.Qwen3Model if qwen else family.Llama3Model
    block_class = family.model.Qwen3TransformerBlock if qwen else family.model.Llama3TransformerBlock
    linear = _normal(0.02, truncated=not qwen)
    norm = partial(RMSNorm.Config, eps=1e-6 if qwen else 1e-5, param_init={"weight": nn.init.ones_})
    rope = (CosSinRoPE.Config(dim=head_dim, max_seq_len=8192, theta=1e6) if qwen else
            ComplexRoPE.Config(dim=head_dim, max_seq_len=8192, theta=5e5, scaling="llama"))
    hidden = 384 if qwen else compute_ffn_hidden_dim(dim, multiple_of=64)
    layers = [block_class.Config(
        attention_norm=norm(normalized_shape=dim), ffn_norm=norm(normalized_shape=dim),
        attention=make_gqa_config(dim=dim, n_heads=n_heads, n_kv_heads=DEBUG_SHAPES[flavor], head_dim=head_dim,
                                  wqkv_param_init=linear, wo_param_init=linear,
                                  inner_attention=ScaledDotProductAttention.Config(), rope=rope, fuse_qkv=False,
                                  qk_norm=norm(normalized_shape=head_dim) if qwen else None),
        feed_forward=make_ffn_config(dim=dim, hidden_dim=hidden, w1_param_init=linear, w2w3_param_init=linear),
    ) for _ in range(n_layers)]
    return model_class.Config(
        dim=dim, vocab_size=VOCAB_SIZE,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB_SIZE, embedding_dim=dim,
                                        param_init={"weight": partial(nn.init.normal_, std=0.02 if qwen else 1.0)}),
        norm=norm(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB_SIZE, param_init=_normal(dim**-0.5, True)),
        layers=layers)


def with_separate_qkv(model_config):
    """``model_config`` with every fused ``wqkv`` built as separate ``wq``/``wk``/``wv`` (what the
    context-parallel attention reads). Their init is the one TorchTitan's builders give the fused
    projection's parts, which they give ``feed_forward.w1`` as well (Llama3, Qwen3): the same draws,
    in the same order (tests_tt03 compares the weights). The checkpoint keys do not change."""
    from torchtitan.models.common import Linear
    from torchtitan.models.common.attention import FusedQKVLinear, QKVLinear

    for layer in model_config.layers:
        qkv = layer.attention.qkv_linear
        if not isinstance(qkv, FusedQKVLinear.Config):
            continue
        init, dim = layer.feed_forward.w1.param_init, qkv.wqkv.in_features
        layer.attention.qkv_linear = QKVLinear.Config(
            head_dim=qkv.head_dim,
            wq=Linear.Config(in_features=dim, out_features=qkv.n_heads * qkv.head_dim, param_init=init),
            wkv=Linear.Config(in_features=dim, out_features=qkv.n_kv_heads * qkv.head_dim, param_init=init))
    return model_config


def _block_shape(model_name: str, layer) -> tuple:
    attention, feed_forward = layer.attention, layer.feed_forward
    rope = type(attention.rope).__qualname__.split(".")[0]
    if rope not in ROPE_KINDS:
        raise ConfigError(f"{model_name}: RoPE {rope} is not run by the plugin's attention: valid kinds are "
                          f"{', '.join(ROPE_KINDS)}")
    w1 = getattr(feed_forward, "w1", None)
    if w1 is None:
        what = "none (a mixture-of-experts block)" if feed_forward is None else type(feed_forward).__qualname__
        raise ConfigError(f"{model_name}: a block whose feed-forward is {what} is not run by titan_upipe: valid "
                          "blocks have a dense SwiGLU feed-forward (w1, w2, w3); pick a dense flavor")
    n_heads = attention.n_heads
    return (n_heads, attention.n_kv_heads or n_heads, attention.head_dim, w1.out_features,
            attention.qk_norm is not None, ROPE_KINDS[rope])


def model_dims_from_config(name: str, model_config) -> ModelDims:
    """``ModelDims`` (named ``name``) of a 0.3 decoder's ``Module.Config`` (module table)."""
    layers = list(model_config.layers)
    if not layers:
        raise ConfigError(f"{name}: the model has no transformer block")
    shapes = {_block_shape(name, layer) for layer in layers}
    if len(shapes) != 1:
        raise ConfigError(f"{name}: its blocks differ in shape ({len(shapes)} kinds): titan_upipe runs models "
                          "whose blocks are all alike")
    n_heads, n_kv_heads, head_dim, ffn_dim, qk_norm, rope = shapes.pop()
    dim = model_config.dim
    return ModelDims(name, dim=dim, n_layers=len(layers), n_heads=n_heads, n_kv_heads=n_kv_heads,
                     head_dim=head_dim or dim // n_heads, ffn_dim=ffn_dim, vocab=model_config.vocab_size,
                     tied=bool(model_config.enable_weight_tying), qk_norm=qk_norm, rope=rope)


def flavor_model_dims(name: str) -> ModelDims:
    """``ModelDims`` of ``<model.name>:<flavor>`` on TorchTitan 0.3 (the planner's ``--model``)."""
    if ":" not in name:
        raise ConfigError(f"unknown model {name!r}: use <model.name>:<flavor>, e.g. upipe_llama3:8B")
    model_name, flavor = name.split(":", 1)
    return model_dims_from_config(name, model_spec(model_name, flavor).model)
