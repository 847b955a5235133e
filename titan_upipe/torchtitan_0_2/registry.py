"""The one registration function: how TorchTitan learns about the plugin.

``register_plugin()`` is called by every entry point (``titan_upipe.train``, the tools) and,
for ``torchrun -m torchtitan.train`` launches, by importing ``titan_upipe.plugin`` (the
``experimental.custom_import`` target). No other module registers anything on import.
"""

from __future__ import annotations

from torchtitan.protocols.model_converter import register_model_converter

from titan_upipe.torchtitan_0_2 import converters, datasets, model_classes, specs
from titan_upipe.torchtitan_common import cpu_runtime


def register_converters(named: dict[str, type]) -> None:
    """Register model converters under their names (TorchTitan asserts on duplicates)."""
    for name, cls in named.items():
        try:
            register_model_converter(cls, name)
        except AssertionError:  # already registered
            pass


def register_plugin() -> None:
    """Point TorchTitan at the CPU when there is no accelerator (``cpu_runtime.activate``), then
    register Llama3's and Qwen3's classes with the core, the train specs, the synthetic dataset and
    every model converter. Idempotent."""
    cpu_runtime.activate()
    model_classes.register_model_classes()
    datasets.register_with_torchtitan()
    specs.register()
    register_converters(converters.CONVERTERS)
