"""The models the planner knows by name: the paper's two, as ``ModelDims`` (pure values).

``llama3_8b`` is TorchTitan's ``llama3`` ``8B`` flavor and ``qwen3_32b`` its ``qwen3`` ``32B``
(the plugin's ``upipe_llama3`` / ``upipe_qwen3`` specs); ``tests/test_job_spec.py`` checks these
rows against the flavors the adapter reads, so the table cannot drift from TorchTitan's. Any
other ``<model.name>:<flavor>`` is read through the adapter by the command line
(``torchtitan_0_2.flavors.flavor_model_dims``).
"""

from __future__ import annotations

from titan_upipe.spec.model_dims import ModelDims

MODEL_FLAVORS = {"llama3_8b": ("upipe_llama3", "8B"), "qwen3_32b": ("upipe_qwen3", "32B")}
"""The paper's two models: ``name -> (model.name, model.flavor)``."""

KNOWN_MODELS: dict[str, ModelDims] = {
    "llama3_8b": ModelDims("llama3_8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                           ffn_dim=14336, vocab=128256, rope="llama3"),
    "qwen3_32b": ModelDims("qwen3_32b", dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128,
                           ffn_dim=25600, vocab=151936, qk_norm=True, rope="qwen3"),
}


def model_dims(name: str) -> ModelDims:
    """``llama3_8b`` or ``qwen3_32b`` (a ValueError naming them for anything else)."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}: use one of {', '.join(KNOWN_MODELS)} (a train spec's flavor, "
                         "<model.name>:<flavor>, is read through the adapter: torchtitan_0_2.flavors.flavor_model_dims)")
    return KNOWN_MODELS[name]
