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
name under TorchTitan 0.2 too) or TorchTitan's families (``llama3``, ``qwen3``). The plugin's
debug flavors are 0.2's alone so far (issue 44).
"""

from __future__ import annotations

import importlib

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


def model_flavors(model_name: str) -> dict:
    """The flavors of ``model_name``: its family's ``<family>_configs`` (name -> config function)."""
    return getattr(family_module(model_name), f"{FAMILIES[model_name]}_configs")


def model_spec(model_name: str, flavor: str):
    """The 0.3 ``ModelSpec`` of ``model_name``'s ``flavor`` (ConfigError naming the valid flavors)."""
    flavors = model_flavors(model_name)
    if flavor not in flavors:
        raise ConfigError(with_suggestion(f"model.flavor = {flavor!r} is not a flavor of {model_name} on TorchTitan "
                                          f"0.3: valid values are {', '.join(flavors)}", flavor, flavors))
    return family_module(model_name).model_registry(flavor)


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
