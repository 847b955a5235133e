"""titan_upipe: UPipe context parallelism and long-context memory transforms for TorchTitan 0.2.2.

Importing the package registers everything (train specs, datasets, model
converters), so both launch styles work:

* ``torchrun ... -m titan_upipe.train --job.config_file X.toml`` (our entry point), or
* ``torchrun ... -m torchtitan.train`` with ``experimental.custom_import = "titan_upipe"``
  and ``job.custom_config_module = "titan_upipe.config"`` in the TOML.

On a machine without an accelerator the CPU runtime is switched on first,
before TorchTitan's device globals are read (see ``titan_upipe.cpu_runtime``).
"""

from titan_upipe import cpu_runtime

cpu_runtime.activate()

from titan_upipe.registry import register_all  # noqa: E402  (after the device is chosen)

register_all()

__version__ = "0.1.0"
