"""The adapter for TorchTitan 0.3 (``titan_upipe.adapter`` chooses it by the installed version).

TorchTitan 0.3 builds a model from a ``ModelSpec`` that a family's ``model_registry(flavor)``
returns, its shape in nested ``Module.Config`` objects (docs/torchtitan_0_3.md, section 2). What is
here so far:

=========== ===========================================================================
module      what
=========== ===========================================================================
flavors     a 0.3 ``ModelSpec``'s shape as the core's ``ModelDims`` (the JobSpec's model)
recipe      a TOML recipe and its flags onto a 0.3 ``Trainer.Config`` and the plugin's
            sections (every key mapped, read or refused by name)
job_spec    the recipe's ``JobSpec`` (equal to the 0.2 adapter's for the same recipe)
load_job    the door the version-neutral tools call (``spec_of_recipe``,
            ``flavor_model_dims``: what ``plan`` needs)
=========== ===========================================================================

Nothing here imports ``titan_upipe.torchtitan_0_2`` (``tests/test_layers.py``), and no module
outside this folder imports TorchTitan 0.3's API.
"""

COMMANDS = ("titan_upipe.plan",)
"""The ``-m`` commands this adapter runs (``titan_upipe.adapter.require_command``: read without importing
the adapter's modules, so that a command it does not run stops at once)."""
