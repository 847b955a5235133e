"""One place that registers the plugin with TorchTitan; idempotent."""

from __future__ import annotations

CONFIG_MODULE = "titan_upipe.config"


def register_all() -> None:
    from titan_upipe import converters, specs, transforms
    from titan_upipe.data import synthetic

    synthetic.register_with_torchtitan()
    specs.register()
    converters.register()
    transforms.register()
