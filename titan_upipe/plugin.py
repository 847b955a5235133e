"""The target of TorchTitan's ``experimental.custom_import``: importing it registers the plugin.

``torchrun ... -m torchtitan.train --job.config_file X.toml`` with, in the TOML::

    [experimental]
    custom_import = "titan_upipe.plugin"
    [job]
    custom_config_module = "titan_upipe.config"

This is the one module with an import-time effect, by TorchTitan's design of custom imports;
it only calls ``titan_upipe.torchtitan_0_2.registry.register_plugin()``, which every other entry point calls
explicitly.
"""

from titan_upipe.torchtitan_0_2.registry import register_plugin

register_plugin()
