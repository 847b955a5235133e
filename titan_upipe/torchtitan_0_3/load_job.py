"""The door from a command line to a job on TorchTitan 0.3: the functions the version-neutral tools
call (``titan_upipe.adapter.adapter_module("load_job")``).

* :func:`spec_of_recipe`: a recipe's ``JobSpec`` (``recipe.load_recipe`` then ``job_spec.job_spec``),
  what ``plan`` reads; :func:`flavor_model_dims`: ``plan --model <name>:<flavor>``.
* :func:`checked_job`: the spec of a job the 0.3 launch would start, with what ``validate`` prints
  beside it; a setting 0.3 does not host yet is refused as the launch refuses it
  (``job.checked_spec``).
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_upipe.spec.job_spec import JobSpec
from titan_upipe.torchtitan_0_3.flavors import flavor_model_dims
from titan_upipe.torchtitan_0_3.job import checked_spec
from titan_upipe.torchtitan_0_3.job_spec import job_spec
from titan_upipe.torchtitan_0_3.recipe import load_recipe

__all__ = ["CheckedJob", "checked_job", "flavor_model_dims", "spec_of_recipe"]


def spec_of_recipe(argv: list[str], world_size: int | None = None) -> JobSpec:
    """The ``JobSpec`` of a recipe (``--job.config_file X.toml [--section.key value ...]``) on
    ``world_size`` ranks. Raises ConfigError (the file, a key 0.3 does not read, a bad value)."""
    return job_spec(load_recipe(argv), world_size)


@dataclass(frozen=True)
class CheckedJob:
    spec: JobSpec
    model_name: str
    flavor: str
    converters: tuple[str, ...]


def checked_job(argv: list[str], world_size: int | None = None, files: bool = True) -> CheckedJob:
    """The job of a recipe as the 0.3 launch checks it before any process group (ConfigError: the
    first problem, worded as the launch words it); ``files=False``: not its tokenizer and data files."""
    recipe = load_recipe(argv)
    return CheckedJob(checked_spec(recipe, world_size, files), recipe.model_name, recipe.flavor, recipe.converters)
