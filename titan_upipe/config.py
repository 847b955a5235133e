"""The plugin's config sections, under the module name TOML files give TorchTitan:
``[job] custom_config_module = "titan_upipe.config"`` (``titan_upipe.torchtitan_0_2.config``)."""

from titan_upipe.torchtitan_0_2.config import *  # noqa: F403
from titan_upipe.torchtitan_0_2.config import JobConfig  # noqa: F401  (what TorchTitan's ConfigManager reads)
