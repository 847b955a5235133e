"""The job one launch runs: its ``JobSpec`` and the CP mesh its attention runs on, built once.

TorchTitan 0.2 hands the plugin's hooks only ``(job_config, parallel_dims)``: a model converter
(``ModelConverter.__init__``), ``parallelize_fn`` and ``build_validator_fn`` get nothing else, and
the trainer builds its converters inside ``Trainer.__init__``. So the adapter keeps one
:class:`LaunchedJob` on the JobConfig it describes, and every hook of the launch asks
:func:`launched_job` for it:

==================================== =========================================================
caller                               reads
==================================== =========================================================
the CP converters (``converters``)   ``spec.layout`` (U, degrees), ``cp_mesh``
the trainer (``trainer``)            ``cp_mesh``, ``spec.layout.ring_degree``, document balance
the validation loss                  ``cp_mesh``, document balance
the parity check, the emulator       ``cp_mesh``, document balance
==================================== =========================================================

The CP mesh is built here once (``parallel.layout_mesh``: each build creates process groups), not
read back from the converted model, so nothing downstream depends on which modules the
conversion produced. A JobConfig changed since gets the spec as it is now (``parallelize`` sizes the
kept-attention plan after the converters ran), with the same mesh while the mesh's shape is unchanged:
only a new ring or Ulysses degree, or another TorchTitan mesh (a test, a tool trying candidates),
builds another one.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from titan_upipe.errors import ConfigError
from titan_upipe.parallel.mesh import layout_mesh
from titan_upipe.spec.cp_layout import CP_MODES
from titan_upipe.spec.job_spec import JobSpec
from titan_upipe.torchtitan_0_2.job_spec import job_spec

LAUNCHED_JOB_ATTRIBUTE = "_titan_upipe_launched_job"
"""Where :func:`launched_job` keeps a JobConfig's ``LaunchedJob``."""


@dataclass(frozen=True)
class LaunchedJob:
    """A launched job: what it is (``spec``) and where its sequence runs (``cp_mesh``)."""

    spec: JobSpec
    cp_mesh: DeviceMesh | None
    """The mesh of the CP attention (``layout_mesh`` of TorchTitan's ``cp`` mesh and ``spec.layout``:
    1-D, a 1-D "ring" mesh or the 2-D ``(ring, ulysses)`` one); None without CP."""
    titan_cp_mesh: DeviceMesh | None
    """TorchTitan's 1-D ``cp`` mesh it was built from (None without CP)."""

    def required_cp_mesh(self) -> DeviceMesh:
        """``cp_mesh`` of a CP job. The job checks refuse, before launch, a CP degree above 1 without
        a CP converter and a CP converter at degree 1; this names the fix should a hand-built config
        get here."""
        if self.cp_mesh is None:
            mode = self.spec.mode.value if self.spec.mode is not None else "none"
            raise ConfigError(f"no context-parallel mesh for parallelism.context_parallel_degree = "
                              f"{self.spec.cp_degree} with CP mode {mode}: a degree above 1 needs one of "
                              f"{', '.join(CP_MODES)} in model.converters, and each of them a degree of 2 or more")
        return self.cp_mesh


def mesh_shape(spec: JobSpec) -> tuple:
    """What the CP mesh depends on: the mode's ring and Ulysses degrees and whether the mesh is 2-D
    (the same on every rank: the job checks agree on the layout before any process group)."""
    layout = spec.layout
    return layout.mode is not None, layout.ring_degree, layout.ulysses_degree, layout.two_d


def launched_job(job_config, parallel_dims) -> LaunchedJob:
    """The ``LaunchedJob`` of ``job_config`` on ``parallel_dims`` (a TorchTitan 0.2 ``ParallelDims``
    with its mesh built), held on ``job_config``. The spec is the config's as it is now; the CP mesh
    is built once and kept while its shape (:func:`mesh_shape`) and TorchTitan's ``cp`` mesh are the
    same: a setting that changes on some ranks only (``parallelize`` agreeing on a kept-attention
    plan) must never make those ranks alone create process groups."""
    spec = job_spec(job_config, parallel_dims.world_size)
    titan_cp_mesh = parallel_dims.get_optional_mesh("cp")
    held = vars(job_config).get(LAUNCHED_JOB_ATTRIBUTE)
    if held is not None and held.titan_cp_mesh is titan_cp_mesh and mesh_shape(held.spec) == mesh_shape(spec):
        if held.spec == spec:
            return held
        job = LaunchedJob(spec, held.cp_mesh, titan_cp_mesh)
    else:
        cp_mesh = None
        if titan_cp_mesh is not None and spec.layout.mode is not None:
            cp_mesh = layout_mesh(titan_cp_mesh, spec.layout)
        job = LaunchedJob(spec, cp_mesh, titan_cp_mesh)
    vars(job_config)[LAUNCHED_JOB_ATTRIBUTE] = job
    return job
