"""The one door from a command line to a job: register the plugin, parse, check, build the spec.

==================== ============================================================ ==============
step                 what                                                         refuses with
==================== ============================================================ ==============
register             ``registry.register_plugin()`` (idempotent)                  -
parse                the TOML and ``--section.key value`` flags, with the plugin's  ConfigError
                     sections (``config_parse.parse_config``)
check                every job check that needs no process group                  ConfigError
                     (``checks.check_job``) for ``world_size`` ranks
prepare              what the caller decides before launch (the launch sizes      ConfigError
                     ``keep_attention = "auto"``)
spec                 the job's ``JobSpec`` (``job_spec``: the only mapping)        -
==================== ============================================================ ==============

``emulate`` comes in through :func:`load_job`; ``check`` through :func:`parse_job` and
:func:`checked_job_of` (it refuses a launch of the wrong size first, in its own words); the launch
(``launch.checked_config``, which registers the plugin first thing in ``launch.main``) through
:func:`checked_job_of`; ``validate`` (every problem, not the first) through :func:`parse_job`, the first two steps; ``plan``
(a TOML for another cluster, planned whether or not this machine could launch it) through
:func:`spec_of_recipe`, which every adapter has (``titan_upipe.adapter.adapter_module``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from titan_upipe.spec.job_spec import JobSpec, degrees_world_size
from titan_upipe.torchtitan_0_2.checks import check_job
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_0_2.flavors import flavor_model_dims
from titan_upipe.torchtitan_0_2.job_spec import job_spec
from titan_upipe.torchtitan_0_2.registry import register_plugin

__all__ = ["JobPreparation", "LoadedJob", "checked_job_of", "flavor_model_dims", "load_job", "parse_job",
           "spec_of_recipe"]

JobPreparation = Callable[[Any, int], object]
"""``prepare(job_config, world_size)``: what an entry point decides for the job after its checks and
before any process group starts, left on the job config (``titan_upipe.train``: the planner sizes
``keep_attention = "auto"``, ``torchtitan_0_2.job_plan.size_keep_attention_of_job``)."""



@dataclass(frozen=True)
class LoadedJob:
    """A checked job: TorchTitan 0.2's ``JobConfig`` (what the adapter's builders take) and its spec
    (what the core, the planner and the tools read)."""

    config: Any
    spec: JobSpec

    @property
    def world_size(self) -> int:
        return self.spec.world_size


def parse_job(argv: list[str], quiet: bool = True):
    """The plugin registered and ``argv`` (``--job.config_file X.toml [--section.key value ...]``)
    parsed into a JobConfig with the plugin's sections; ``quiet``: without TorchTitan's parse-time
    warnings. Raises ConfigError."""
    register_plugin()
    return parse_config(argv, quiet=quiet)


def checked_job_of(config, world_size: int, prepare: JobPreparation | None = None) -> LoadedJob:
    """A parsed job on ``world_size`` ranks, checked (``checks.check_job``), prepared and described:
    the last three steps of the module table. Raises ConfigError."""
    check_job(config, world_size)
    if prepare is not None:
        prepare(config, world_size)
    return LoadedJob(config, job_spec(config, world_size))


def load_job(argv: list[str], world_size: int | None = None, prepare: JobPreparation | None = None,
             quiet: bool = True) -> LoadedJob:
    """The job of ``argv`` on ``world_size`` ranks (default: the configured degrees' product), parsed,
    checked, prepared and described (every step of the module table). Raises ConfigError."""
    config = parse_job(argv, quiet)
    return checked_job_of(config, world_size or degrees_world_size(config.parallelism), prepare)


def spec_of_recipe(argv: list[str], world_size: int | None = None) -> JobSpec:
    """The ``JobSpec`` of a recipe on ``world_size`` ranks, parsed without the job checks (the planner
    plans a TOML for another cluster). The same function on every adapter (``titan_upipe.adapter``),
    with ``flavor_model_dims``: what the version-neutral planner CLI reads. Raises ConfigError."""
    return job_spec(parse_job(argv), world_size)
