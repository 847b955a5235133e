"""The launch's one job (``torchtitan_0_2.launched_job``) and the tools' one door (``load_job``).

* The converters, the trainer, the validation loss, the parity check and the emulator read one
  ``LaunchedJob``: the same spec and the same CP mesh object the converted attention runs on (the
  mesh built once: each build creates process groups), on real gloo ranks. A setting changed on one
  rank only (``parallelize``'s agreed kept-attention plan) refreshes the spec and keeps the mesh; a
  new mesh shape builds a new mesh; a job without a CP mesh names the fix.
* ``load_job`` registers, parses, checks and describes a job in one call: its spec is the adapter's
  ``job_spec`` of the checked config; a job the checks refuse is refused by the door.
* Registration is the door's (and the launch's, the rank builder's, the plugin module's): the tools
  no longer register in preambles of their own. Only the job checks and the spec builder fetch a
  JobConfig's layout, and nothing reads the mesh back from a converted model.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from dist_utils import run_distributed

from titan_upipe.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "titan_upipe"


def _one_job_per_launch(rank: int, world_size: int, mesh, config: str) -> dict:
    import torch

    from titan_upipe.attention import sequence_mesh
    from titan_upipe.spec.keep_attention import KeepAttentionPlan
    from titan_upipe.torchtitan_0_2.checks.keep_attention import set_keep_attention_plan
    from titan_upipe.torchtitan_0_2.config_parse import parse_config
    from titan_upipe.torchtitan_0_2.converters import CP_CONVERTERS
    from titan_upipe.torchtitan_0_2.launched_job import launched_job
    from titan_upipe.torchtitan_0_2.rank_model import build_parallel_dims, build_rank_model

    job_config = parse_config(["--job.config_file", str(REPO / config), "--parallelism.data_parallel_shard_degree",
                               "1", "--parallelism.context_parallel_degree", str(world_size),
                               "--activation_checkpoint.keep_attention", "auto"], quiet=True)
    parallel_dims = build_parallel_dims(job_config, world_size)
    built = build_rank_model(job_config, parallel_dims, torch.device("cpu"), seed=0, parallelize=False)
    job = launched_job(job_config, parallel_dims)  # what the trainer and the validation loss ask for
    converter = CP_CONVERTERS[job.spec.mode.value](job_config, parallel_dims)  # a converter built after
    again = launched_job(job_config, parallel_dims)
    # parallelize agrees on a kept-attention plan after the converters ran, and changes it on some ranks only
    if rank == 1:
        set_keep_attention_plan(job_config, KeepAttentionPlan(device_blocks=1))
    one_rank = launched_job(job_config, parallel_dims)
    job_config.upipe.document_balance = "documents" if job.spec.document_balance == "zigzag" else "zigzag"
    changed = launched_job(job_config, parallel_dims)
    reshaped = None
    if job.spec.mode.value == "upipe":  # UPipe in USP: a new mesh shape on every rank, ring of C x Ulysses 1
        job_config.upipe.ulysses_degree = 1
        reshaped = launched_job(job_config, parallel_dims)
    return {
        "model_runs_on_the_launched_mesh": sequence_mesh(built.model) is job.cp_mesh,
        "converter_reads_it": converter.cp_mesh is job.cp_mesh and converter.layout is job.spec.layout,
        "same_object": again is job,
        "shape": tuple(job.cp_mesh.shape), "names": tuple(job.cp_mesh.mesh_dim_names),
        "one_rank_change_keeps_the_mesh": one_rank.cp_mesh is job.cp_mesh
        and (one_rank.spec.keep_plan == KeepAttentionPlan(device_blocks=1)) == (rank == 1),
        "changed_spec_same_mesh": changed.spec.document_balance != job.spec.document_balance
        and changed.cp_mesh is job.cp_mesh,
        "new_shape_new_mesh": reshaped is None or reshaped.cp_mesh is not job.cp_mesh
        and tuple(reshaped.cp_mesh.shape) == (world_size, 1),
    }


@pytest.mark.parametrize("config,world,shape,names", [
    ("configs/debug/upipe.toml", 2, (2,), ("cp",)),
    ("configs/debug/usp.toml", 4, (2, 2), ("ring", "ulysses")),
])
def test_the_converters_the_model_and_the_trainer_share_one_job_and_one_mesh(config, world, shape, names):
    results = run_distributed(world, _one_job_per_launch, config)
    for result in results:
        assert result == {"model_runs_on_the_launched_mesh": True, "converter_reads_it": True, "same_object": True,
                          "shape": shape, "names": names, "one_rank_change_keeps_the_mesh": True,
                          "changed_spec_same_mesh": True, "new_shape_new_mesh": True}


def test_a_job_without_a_cp_mesh_names_the_fix():
    from titan_upipe.torchtitan_0_2.launched_job import LaunchedJob
    from titan_upipe.torchtitan_0_2.load_job import load_job

    spec = load_job(["--job.config_file", str(REPO / "configs/debug/llama3_fsdp.toml")], 2).spec
    with pytest.raises(ConfigError, match=r"no context-parallel mesh for parallelism.context_parallel_degree = 1 "
                                          r"with CP mode none: a degree above 1 needs one of ulysses, upipe, ring"):
        LaunchedJob(spec, None, None).required_cp_mesh()


def test_the_door_registers_parses_checks_and_describes():
    from titan_upipe.torchtitan_0_2.config_parse import parse_config
    from titan_upipe.torchtitan_0_2.job_spec import job_spec
    from titan_upipe.torchtitan_0_2.load_job import load_job

    args = ["--job.config_file", str(REPO / "configs/debug/upipe_usp.toml"), "--upipe.heads_per_stage", "4"]
    job = load_job(args)
    assert job.world_size == 4 and job.spec.layout.heads_per_stage == 4 and job.spec.layout.two_d
    assert job.spec == job_spec(parse_config(args, quiet=True), 4)
    prepared = []
    load_job(args, 8, prepare=lambda config, world: prepared.append(world))
    assert prepared == [8]
    with pytest.raises(ConfigError, match=r"upipe.heads_per_stage=3 is invalid"):  # the checks' own refusal
        load_job([*args[:2], "--upipe.heads_per_stage", "3"])
    with pytest.raises(ConfigError, match="world size|ranks"):
        load_job(args, 3)


REGISTERING = {"plugin.py", "torchtitan_0_2/load_job.py", "torchtitan_0_2/launch.py",
               "torchtitan_0_2/rank_model.py", "emulate/measure.py", "tools/gpu_suite.py"}
"""Modules that call ``register_plugin()`` (``registry`` defines it): the tools' door, the launch, the rank
builder (and ``measure_step``, an API the tests and the GPU suite call with a parsed config), the GPU
suite's stages, and the ``custom_import`` module."""

LAYOUT_READERS = {"torchtitan_0_2/job_spec.py", "torchtitan_0_2/checks/model.py",
                  "torchtitan_0_2/checks/parallelism.py", "torchtitan_0_2/checks/training.py"}
"""Modules that fetch a JobConfig's layout (``checks.cp_layout``): its builder, the job checks, and the spec
builder that carries it; everything else reads ``spec.layout``."""


def calling_modules(root: Path, function: str) -> set[str]:
    """Modules under ``root`` that call ``function`` (by name or as an attribute)."""
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == function:
                found.add(path.relative_to(root).as_posix())
    return found


def test_only_the_door_and_the_adapter_register_the_plugin(tmp_path):
    assert calling_modules(PACKAGE, "register_plugin") == REGISTERING
    # the rule fails a tool that registers in a preamble of its own
    broken = tmp_path / "titan_upipe"
    (broken / "tools").mkdir(parents=True)
    (broken / "tools" / "preflight.py").write_text("from x import register_plugin\n\ndef main():\n    register_plugin()\n")
    assert calling_modules(broken, "register_plugin") == {"tools/preflight.py"}


def test_nothing_reads_the_layout_back_from_the_config_or_the_mesh_from_the_model(tmp_path):
    assert calling_modules(PACKAGE, "cp_layout") == LAYOUT_READERS
    assert calling_modules(PACKAGE, "sequence_mesh") == set()  # the mesh comes from the launched job
    broken = tmp_path / "titan_upipe"
    (broken / "tools").mkdir(parents=True)
    (broken / "tools" / "parity.py").write_text("import checks\n\ndivisor = checks.cp_layout(config).seq_divisor\n"
                                                "mesh = sequence_mesh(model)\n")
    assert calling_modules(broken, "cp_layout") == calling_modules(broken, "sequence_mesh") == {"tools/parity.py"}


def test_a_loaded_job_is_frozen():
    from titan_upipe.torchtitan_0_2.load_job import load_job

    job = load_job(["--job.config_file", str(REPO / "configs/debug/upipe.toml")])
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.spec = None
