"""The plugin's recipes as TorchTitan 0.3 config functions, for TorchTitan's own entry point:

    torchrun --nproc_per_node 8 -m torchtitan.train --module titan_upipe.torchtitan_0_3 \
        --config llama3_8b_upipe_1m [--training.steps 100 ...]

``--module titan_upipe.torchtitan_0_3`` finds this module (0.3 tries ``<module>.config_registry``);
``--config NAME`` calls the zero-argument function ``NAME``, which returns the recipe's
``ContextParallelTrainer.Config`` (``trainer.plugin_config``: the same config ``python -m
titan_upipe.train`` builds from the TOML file). There is one function per recipe of ``configs/``, named
by its path (``configs/llama3_8b/upipe_1m.toml`` is ``llama3_8b_upipe_1m``, ``configs/debug/upipe.toml``
``debug_upipe``), generated with the TOML files from one table (``scripts/gen_configs.py`` writes both,
the package's copy in ``resources/recipes.json``).

TorchTitan's flags override its own fields (``--training.seq_len``, ``--parallelism.*``, ...); the
trainer builds the job's ``JobSpec`` from the config as it stands then and checks it before any process
group. The plugin's sections (``[upipe]``, ``[transforms]``, ...) are the recipe's: change them with
``python -m titan_upipe.train --job.config_file X.toml --upipe.heads_per_stage 4``.
"""

from __future__ import annotations

import functools
import json

from titan_upipe.resources import resource
from titan_upipe.torchtitan_0_3.recipe import recipe_of_tables
from titan_upipe.torchtitan_0_3.trainer import plugin_config


@functools.cache
def recipe_tables() -> dict[str, dict]:
    """Config name -> ``{"path", "sections"}`` of every recipe (``resources/recipes.json``)."""
    return json.loads(resource("recipes.json").read_text())


def trainer_config(name: str):
    """The ``ContextParallelTrainer.Config`` of the recipe ``name`` (a key of :func:`recipe_tables`)."""
    table = recipe_tables()[name]
    return plugin_config(recipe_of_tables(table["path"], table["sections"]))


def __getattr__(name: str):
    if name in recipe_tables():
        return functools.partial(trainer_config, name)
    raise AttributeError(f"module {__name__!r} has no config function {name!r}: valid names are those of "
                         f"configs/ (llama3_8b_upipe_1m, ...): {', '.join(sorted(recipe_tables()))}")


def __dir__() -> list[str]:
    return sorted([*globals(), *recipe_tables()])
