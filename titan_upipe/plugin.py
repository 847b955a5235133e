"""The target of TorchTitan's ``experimental.custom_import``: importing it registers the plugin.

``torchrun ... -m torchtitan.train --job.config_file X.toml`` with, in the TOML::

    [experimental]
    custom_import = "titan_upipe.plugin"
    [job]
    custom_config_module = "titan_upipe.config"

This is the one module with an import-time effect, by TorchTitan's design of custom imports;
it calls ``titan_upipe.torchtitan_0_2.registry.register_plugin()``, which every other entry point calls
explicitly, and, under ``-m torchtitan.train``, refuses a job TorchTitan's trainer cannot run (a
context-parallel converter) in one line before any process group
(``titan_upipe.torchtitan_0_2.torchtitan_launch``).
"""

from titan_upipe.torchtitan_0_2.registry import register_plugin
from titan_upipe.torchtitan_0_2.torchtitan_launch import refuse_unsupported_launch

register_plugin()
refuse_unsupported_launch()
