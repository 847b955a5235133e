"""titan_upipe: UPipe context parallelism and long-context memory transforms for TorchTitan 0.2.2.

Three layers, imports pointing down only (docs/architecture.md):

==============  ===========================================================================
layer           modules
==============  ===========================================================================
core            ``errors``, ``parallel`` (CP layout, sequence layouts, meshes), ``attention``
                (Ulysses, UPipe, ring, USP, kernels), ``transforms`` (tiling, fused RoPE/CE,
                offload), ``memory_tracker``: torch and TorchTitan's model classes only
TorchTitan      ``config``, ``flavors``, ``validation`` (job checks), ``loss``, ``metrics``,
glue            ``parallelize``, ``specs``, ``converters``, ``trainer``, ``cpu_runtime``,
                ``data``, ``registry`` (``register_plugin``), ``plugin``, ``train``
tools           ``validate``, ``check``, ``plan``, ``emulate``, ``gpu_suite`` (+ ``gpu_kernels``,
                ``gpu_wheels``), ``paper_tables``
==============  ===========================================================================

Importing the package or any module has no side effects. Registration with TorchTitan is
``titan_upipe.torchtitan_0_2.registry.register_plugin()``, called by the entry points:

* ``torchrun ... -m titan_upipe.train --job.config_file X.toml`` (ours), or
* ``torchrun ... -m torchtitan.train`` with ``experimental.custom_import = "titan_upipe.plugin"``
  and ``job.custom_config_module = "titan_upipe.config"`` in the TOML.
"""

__version__ = "0.1.0"
