"""The door from a command line to a job on TorchTitan 0.3: the same functions the 0.2 adapter's
``load_job`` offers the version-neutral tools (``titan_upipe.adapter.adapter_module("load_job")``).

So far the planner's pair: :func:`spec_of_recipe` (a recipe's ``JobSpec``: ``recipe.load_recipe``
then ``job_spec.job_spec``) and :func:`flavor_model_dims` (``plan --model <name>:<flavor>``). The
job checks and the launch are issue 44's next steps.
"""

from __future__ import annotations

from titan_upipe.spec.job_spec import JobSpec
from titan_upipe.torchtitan_0_3.flavors import flavor_model_dims
from titan_upipe.torchtitan_0_3.job_spec import job_spec
from titan_upipe.torchtitan_0_3.recipe import load_recipe

__all__ = ["flavor_model_dims", "spec_of_recipe"]



def spec_of_recipe(argv: list[str], world_size: int | None = None) -> JobSpec:
    """The ``JobSpec`` of a recipe (``--job.config_file X.toml [--section.key value ...]``) on
    ``world_size`` ranks. Raises ConfigError (the file, a key 0.3 does not read, a bad value)."""
    return job_spec(load_recipe(argv), world_size)
