"""One place that registers the plugin with TorchTitan; idempotent."""

from __future__ import annotations

CONFIG_MODULE = "titan_upipe.config"


def register_converters(converters: dict[str, type]) -> None:
    """Register model converters under their names (TorchTitan asserts on duplicates)."""
    from torchtitan.protocols.model_converter import register_model_converter

    for name, cls in converters.items():
        try:
            register_model_converter(cls, name)
        except AssertionError:  # already registered
            pass


def register_all() -> None:
    from titan_upipe import converters, specs
    from titan_upipe.data import synthetic
    from titan_upipe.transforms import converters as transform_converters

    synthetic.register_with_torchtitan()
    specs.register()
    register_converters(converters.CONVERTERS)
    register_converters(transform_converters.CONVERTERS)
