"""The state the job's model saves and loads, read from the model built on the meta device (no
memory, no process group): parameter names and shapes in TorchTitan's names (what a DCP
checkpoint holds) and in Hugging Face's (what ``checkpoint.initial_load_in_hf`` reads), and the
parameter count (the size of a checkpoint).

The plugin's converters keep every parameter's name and global shape (``converters.py``; TSP's
sharded weights are DTensors of the unconverted shape), so the unconverted model states what a
converted job saves and loads.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
from torchtitan.protocols.train_spec import get_train_spec

from titan_upipe.errors import ConfigError
from titan_upipe.torchtitan_0_2.flavors import BASE_MODELS, model_flavors

Shapes = dict[str, tuple[int, ...]]
"""Tensor name -> global shape."""

NON_MODEL_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")
"""The top-level checkpoint entries that are not the model's (TorchTitan flattens the model's
parameters to the top level beside these)."""



@dataclass(frozen=True)
class ModelState:
    """The parameters of one ``model.name`` / ``model.flavor``."""

    label: str
    shapes: Shapes
    """TorchTitan's state-dict names (persistent entries only)."""
    tied: dict[str, str]
    """A name sharing its tensor with another (tied embeddings) -> that other name."""
    parameters: int
    vocab_size: int
    hf_shapes: Shapes | None
    """The Hugging Face names (the train spec's state-dict adapter), None without an adapter."""


def _tied_names(model: torch.nn.Module) -> dict[str, str]:
    first: dict[int, str] = {}
    tied = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            tied[name] = first[id(parameter)]
        first.setdefault(id(parameter), name)
    return tied


def _hf_shapes(spec, args, state: dict) -> Shapes | None:
    if spec.state_dict_adapter is None:
        return None
    try:
        hf = spec.state_dict_adapter(args, None).to_hf(dict(state))
    except Exception:  # an adapter that cannot map this flavor: nothing to compare
        return None
    return {name: tuple(tensor.shape) for name, tensor in hf.items()}


@functools.lru_cache(maxsize=32)
def model_state(model_name: str, flavor: str) -> ModelState:
    """The state of ``model_name`` / ``flavor`` built on the meta device (a fraction of a second
    for an 8B model)."""
    args = copy.deepcopy(model_flavors(model_name)[flavor])
    spec = get_train_spec(model_name)
    with torch.device("meta"):
        model = spec.model_cls(args)
    state = model.state_dict()
    return ModelState(f"{model_name} / {flavor}", {k: tuple(v.shape) for k, v in state.items()}, _tied_names(model),
                      sum(p.numel() for p in model.parameters()), args.vocab_size, _hf_shapes(spec, args, state))


def job_model_state(job_config) -> ModelState | None:
    """The state of the job's model; None when ``model.name`` or ``model.flavor`` is unknown (the
    job checks name those) or the model cannot be built here."""
    try:
        flavors = model_flavors(job_config.model.name)
    except ConfigError:
        return None
    if job_config.model.flavor not in flavors:
        return None
    try:
        return model_state(job_config.model.name, job_config.model.flavor)
    except Exception:  # an unregistered spec, a model the meta device cannot build: the trainer reports its own error
        return None


def mismatches(expected: Shapes, found: Shapes, tied: dict[str, str], extra_allowed: bool) -> list[str]:
    """What differs between the model's ``expected`` tensors and a checkpoint's ``found`` ones:
    ``missing X``, ``unexpected X`` (unless ``extra_allowed``), ``shape [a] vs [b] for X``
    (checkpoint vs model). A tied name whose twin is present is not missing."""
    problems = [f"missing {name}" for name in expected
                if name not in found and tied.get(name) not in found]
    problems += [f"shape {list(found[name])} vs {list(shape)} for {name}" for name, shape in expected.items()
                 if name in found and found[name] != shape]
    if not extra_allowed:
        problems += [f"unexpected {name}" for name in found if name not in expected]
    return problems


EMBEDDINGS = ("tok_embeddings.weight", "model.embed_tokens.weight")
"""The token embedding in TorchTitan's and in Hugging Face's names: ``[vocab_size, dim]``."""


def _could_match(args, found: Shapes) -> bool:
    """A cheap look at the flavor's args before building it: the embedding's shape."""
    embedding = next((found[name] for name in EMBEDDINGS if name in found), None)
    return embedding is None or embedding == (getattr(args, "vocab_size", None), getattr(args, "dim", None))


def matching_flavors(found: Shapes, hf: bool, names: tuple[str, ...]) -> list[tuple[str, str]]:
    """``(model.name, model.flavor)`` of each flavor of ``names`` and of the plugin's train specs
    whose state is ``found`` (Hugging Face names when ``hf``)."""
    matches = []
    for name in dict.fromkeys((*names, *BASE_MODELS)):
        try:
            flavors = model_flavors(name)
        except ConfigError:
            continue
        for flavor, args in flavors.items():
            if not _could_match(args, found):
                continue
            try:
                state = model_state(name, flavor)
            except Exception:  # a flavor that cannot be built here cannot be the match
                continue
            shapes = state.hf_shapes if hf else state.shapes
            if shapes is not None and not mismatches(shapes, found, state.tied, extra_allowed=hf):
                matches.append((name, flavor))
    return matches


def _likely_cause(matches: list[tuple[str, str]]) -> str:
    if not matches:
        return "it was saved by another model or flavor: set model.name and model.flavor to the ones it was saved with"
    name, flavor = matches[0]
    twins = [f for n, f in matches[1:] if n == name]
    also = f" (or {', '.join(twins)})" if twins else ""
    return f"it holds the tensors of model.name = {name!r}, model.flavor = {flavor!r}{also}: set those"


def describe_mismatch(state: ModelState, found: Shapes, hf: bool, names: tuple[str, ...]) -> str | None:
    """``<first mismatches>; <likely cause>`` when ``found`` is not ``state``'s, else None."""
    expected = state.hf_shapes if hf else state.shapes
    if expected is None:
        return None
    problems = mismatches(expected, found, state.tied, extra_allowed=hf)
    if not problems:
        return None
    shown = ", ".join(problems[:3]) + (f" and {len(problems) - 3} more" if len(problems) > 3 else "")
    return f"{shown} (checkpoint vs model); {_likely_cause(matching_flavors(found, hf, names))}"
