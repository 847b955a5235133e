"""The models the planner knows by name, read from the plugin's train-spec flavors (no table of
their own): ``llama3_8b`` is ``upipe_llama3/8B``, ``qwen3_32b`` is ``upipe_qwen3/32B``; any
``<model.name>:<flavor>`` works too. Reading a flavor imports TorchTitan; nothing is registered.
"""

from __future__ import annotations

from titan_upipe.plan.dims import ModelDims, model_dims_from_args
from titan_upipe.torchtitan_0_2.flavors import LLAMA3_SPEC, QWEN3_SPEC, model_flavors

MODEL_FLAVORS = {"llama3_8b": (LLAMA3_SPEC, "8B"), "qwen3_32b": (QWEN3_SPEC, "32B")}
"""The paper's two models: ``name -> (model.name, model.flavor)``."""

KNOWN_MODELS: dict[str, ModelDims] = {
    name: model_dims_from_args(name, model_flavors(spec)[flavor]) for name, (spec, flavor) in MODEL_FLAVORS.items()
}


def model_dims(spec: str) -> ModelDims:
    """``llama3_8b``, ``qwen3_32b`` or ``<model.name>:<flavor>`` (a train spec's flavor)."""
    if spec in KNOWN_MODELS:
        return KNOWN_MODELS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown model {spec!r}: use one of {', '.join(KNOWN_MODELS)} or <model.name>:<flavor>")
    name, flavor = spec.split(":", 1)
    flavors = model_flavors(name)
    if flavor not in flavors:
        raise ValueError(f"{flavor!r} is not a flavor of {name}: valid values are {', '.join(flavors)}")
    return model_dims_from_args(spec, flavors[flavor])
