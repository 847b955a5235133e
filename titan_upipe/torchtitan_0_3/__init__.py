"""The adapter for TorchTitan 0.3 (``titan_upipe.adapter`` chooses it by the installed version).

TorchTitan 0.3 builds a model from a ``ModelSpec`` that a family's ``model_registry(flavor)``
returns, its shape in nested ``Module.Config`` objects (docs/torchtitan_0_3.md, section 2):

============== ========================================================================
module         what
============== ========================================================================
flavors        a 0.3 ``ModelSpec``'s shape as the core's ``ModelDims``; the plugin's debug
               flavors; separate Q/K/V for the CP attention
recipe         a TOML recipe and its flags onto a 0.3 ``Trainer.Config`` and the plugin's
               sections (every key mapped, read or refused by name)
job_spec       the recipe's ``JobSpec`` (equal to the 0.2 adapter's for the same recipe)
load_job       the door the version-neutral tools call (``spec_of_recipe``,
               ``flavor_model_dims``, ``checked_job``)
parity_job     the parity check's job (``tools.parity``): its checks, the reference and
               parallel models, the loss, the CP mesh
optimizers     AdamW with its moments in host memory (``optimizer.state_on_host``)
metrics        0.3's metrics processor with the plugin's grouped TensorBoard tags
model_classes  0.3's decoders for the core; the CP attention with 0.3's forward signature
parallelize    the ``parallelize_fn``: CP attention (TSP: attention and feed-forward), 0.3's AC
               and FSDP
trainer        the ``Trainer`` subclass: CP inputs in the attention's layout, counters
data           the plugin's datasets as 0.3's dataloader configurable
launch         ``python -m titan_upipe.train``: recipe, pre-launch refusals, trainer
torch_compat   0.3.0 on the torch builds the plugin runs on
============== ========================================================================

Nothing here imports ``titan_upipe.torchtitan_0_2`` (``tests/test_layers.py``), and no module
outside this folder imports TorchTitan 0.3's API.
"""

COMMANDS = {
    "titan_upipe.train": "titan_upipe.torchtitan_0_3.launch:train_main",
    "titan_upipe.validate": "titan_upipe.tools.spec_preflight:main",
    "titan_upipe.check": "titan_upipe.tools.parity:main",
    "titan_upipe.plan": "titan_upipe.tools.plan_cli:main",
}
"""The ``-m`` commands this adapter runs -> the ``module:function`` that runs each
(``titan_upipe.adapter.run_command``; read without importing the adapter's modules, so that a command it
does not run stops at once)."""
