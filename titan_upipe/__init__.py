"""titan_upipe: UPipe context parallelism and long-context memory transforms for TorchTitan 0.2.2.

Three layers, one folder each at least, imports pointing down only (docs/architecture.md,
enforced by tests/test_layers.py):

==============  ===========================================================================
layer           folders (and the root's modules)
==============  ===========================================================================
core            ``spec`` (the job as pure values: ``JobSpec``, CP layout, head schedule),
                ``parallel`` (sequence layouts, meshes, documents, CP input preparation),
                ``attention``, ``tsp``, ``transforms``, ``optim``, ``costs`` (analytic models),
                ``contracts`` (kernel contract harnesses), ``resources`` (package data),
                ``errors``: torch only, no TorchTitan (model classes are registered by the adapter)
glue            ``torchtitan_0_2`` (everything that speaks TorchTitan 0.2.2's API), ``data``;
                ``plugin`` and ``config`` (TorchTitan's ``custom_import`` / ``custom_config_module``)
tools           ``toolkit`` (what the tools share), ``plan``, ``emulate``, ``tools``; the ``-m`` shims ``train``, ``validate``,
                ``check``, ``gpu_suite``
==============  ===========================================================================

Importing the package or any module has no side effects. Registration with TorchTitan is
``titan_upipe.torchtitan_0_2.registry.register_plugin()``, called by the entry points:

* ``torchrun ... -m titan_upipe.train --job.config_file X.toml`` (ours), or
* ``torchrun ... -m torchtitan.train`` with ``experimental.custom_import = "titan_upipe.plugin"``
  and ``job.custom_config_module = "titan_upipe.config"`` in the TOML.
"""

__version__ = "0.1.0"
