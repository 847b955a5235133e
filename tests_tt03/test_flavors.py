"""The TorchTitan 0.3 adapter reads the models' shapes as the 0.2 one does.

The planner's named models (``plan.models.KNOWN_MODELS``, the paper's Llama3-8B and Qwen3-32B) are
checked against 0.2's flavors in ``tests/test_job_spec.py``; here the same rows against 0.3's, so
a job spec's model is the same on both versions. The adapter chooser names the 0.3 adapter here.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from titan_upipe.adapter import adapter_package
from titan_upipe.errors import ConfigError
from titan_upipe.plan.models import KNOWN_MODELS, MODEL_FLAVORS
from titan_upipe.torchtitan_0_3 import flavors


def test_the_installed_torchtitan_chooses_the_0_3_adapter():
    assert adapter_package() == "titan_upipe.torchtitan_0_3"
    importlib.import_module(adapter_package())


@pytest.mark.parametrize("name", sorted(KNOWN_MODELS))
def test_the_named_models_are_torchtitan_0_3s_flavors(name):
    model_name, flavor = MODEL_FLAVORS[name]
    assert dataclasses.replace(flavors.flavor_model_dims(f"{model_name}:{flavor}"), name=name) == KNOWN_MODELS[name]


def test_the_shape_is_read_off_the_config_tree():
    """TorchTitan's own debug flavors: Llama3's head_dim from dim / heads, Qwen3's set, tied and qk-norm."""
    llama = flavors.flavor_model_dims("llama3:debugmodel")
    assert (llama.dim, llama.n_layers, llama.n_heads, llama.n_kv_heads, llama.head_dim, llama.rope) == \
        (256, 6, 16, 16, 16, "llama3")
    qwen = flavors.flavor_model_dims("qwen3:debugmodel")
    assert (qwen.head_dim, qwen.qk_norm, qwen.tied, qwen.rope) == (128, True, True, "qwen3")
    # the reader fails a model whose blocks differ (a broken variant of the same tree)
    spec = flavors.model_spec("llama3", "debugmodel")
    wider = dataclasses.replace(spec.model.layers[1].feed_forward,
                                w1=dataclasses.replace(spec.model.layers[1].feed_forward.w1, out_features=1024))
    spec.model.layers[1] = dataclasses.replace(spec.model.layers[1], feed_forward=wider)
    with pytest.raises(ConfigError, match="its blocks differ in shape"):
        flavors.model_dims_from_config("broken", spec.model)


@pytest.mark.parametrize("name,message", [
    ("qwen3:30B-A3B", r"feed-forward is none \(a mixture-of-experts block\) is not run by titan_upipe: valid blocks"),
    ("upipe_llama3:9B", r"model.flavor = '9B' is not a flavor of upipe_llama3 on TorchTitan 0.3: valid values are "
                        r"debugmodel, 1B, 3B, 8B"),
    ("deepseek_v3:16B", r"model.name = 'deepseek_v3' is not a model titan_upipe runs on TorchTitan 0.3: valid values "
                        r"are upipe_llama3, upipe_qwen3, llama3, qwen3"),
    ("llama3", r"use <model.name>:<flavor>"),
])
def test_a_model_the_adapter_cannot_run_is_named_with_the_valid_ones(name, message):
    with pytest.raises(ConfigError, match=message):
        flavors.flavor_model_dims(name)


def test_every_module_of_the_0_3_adapter_imports_on_torchtitan_0_3():
    """The main suite imports the installed adapter's modules only (tests/test_layers.py); this pass, 0.3's."""
    import pkgutil

    import titan_upipe.torchtitan_0_3 as adapter_0_3

    names = [m.name for m in pkgutil.walk_packages(adapter_0_3.__path__, "titan_upipe.torchtitan_0_3.")]
    assert len(names) >= 4
    for name in names:
        importlib.import_module(name)



@pytest.mark.parametrize("command", ["gpu_suite", "emulate"])
def test_a_command_0_3_does_not_run_yet_is_one_line_and_status_2(command):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", f"titan_upipe.{command}", "configs/debug/upipe.toml"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == "", out.stderr[-2000:]
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(
        f"titan_upipe.{command}: error: titan_upipe.{command} does not run on torchtitan 0.3.0 yet: its adapter runs "
        "titan_upipe.train, titan_upipe.validate, titan_upipe.check, titan_upipe.plan")


def test_every_command_the_0_3_adapter_runs_resolves_here():
    import importlib

    from titan_upipe import adapter
    from titan_upipe.torchtitan_0_3 import COMMANDS

    for command, entry in COMMANDS.items():
        assert adapter.require_command(command) == entry
        module, function = entry.split(":")
        assert callable(getattr(importlib.import_module(module), function)), entry


def initialised_weights(model_config, convert=None) -> dict:
    """The state dict of ``model_config`` built on meta (``convert(model)`` applied there, as ``parallelize``
    converts), materialised on the CPU and initialised by 0.3's ``init_weights`` under seed 0."""
    import torch

    with torch.device("meta"):
        model = model_config.build()
    if convert is not None:
        convert(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.state_dict()


def test_separate_qkv_draws_the_fused_projections_weights():
    """``with_separate_qkv`` (what a CP job builds from TorchTitan's fused flavors) initialises wq/wk/wv with
    the very values the fused ``wqkv`` gets under the same seed: its checkpoint keys are the same too."""
    import torch

    from titan_upipe.torchtitan_0_3.flavors import model_spec, with_separate_qkv

    fused = initialised_weights(model_spec("llama3", "debugmodel").model)
    separate = initialised_weights(with_separate_qkv(model_spec("llama3", "debugmodel").model))
    keys = [k for k in separate if ".qkv_linear." in k]
    assert keys and set(separate) == set(fused)
    for key in keys:
        assert torch.equal(separate[key], fused[key]), key


def test_a_converted_model_draws_the_unconverted_models_weights():
    """0.3's ``init_states`` reaches the CP attention's children in the block's order (it is a 0.3 ``Module``):
    a CP job started from random weights starts where a one-rank job does."""
    import torch

    from titan_upipe.attention.backends import get_backend
    from titan_upipe.attention.module import AttentionSpec
    from titan_upipe.spec.head_schedule import build_schedule
    from titan_upipe.torchtitan_0_3.flavors import model_spec
    from titan_upipe.torchtitan_0_3.model_classes import ContextParallelGQAttention, register_model_classes

    register_model_classes()

    def convert(model) -> None:
        for block in model.layers.values():
            spec = AttentionSpec.of(block.attention)
            block.attention = ContextParallelGQAttention(block.attention, spec, "ulysses", None,
                                                         build_schedule(8, 2, 1, 8), get_backend("sdpa", torch.float32))

    converted = initialised_weights(model_spec("upipe_llama3", "debug").model, convert)
    plain = initialised_weights(model_spec("upipe_llama3", "debug").model)
    assert set(converted) == set(plain)
    assert [key for key in plain if not torch.equal(converted[key], plain[key])] == []
