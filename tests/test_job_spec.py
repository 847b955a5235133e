"""``JobSpec`` (issue 43): the job decided once by the adapter, read by the planner; the planner and
the spec are arithmetic (no torch, no TorchTitan on import)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from titan_upipe.attention.backends import BACKENDS
from titan_upipe.errors import ConfigError
from titan_upipe.plan.models import KNOWN_MODELS, MODEL_FLAVORS
from titan_upipe.plan.spec_input import plan_input_from_spec
from titan_upipe.spec import settings
from titan_upipe.spec.cp_layout import CPLayout
from titan_upipe.spec.job_spec import JobSpec
from titan_upipe.torchtitan_0_2.checks import cp_layout
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_0_2.flavors import flavor_model_dims
from titan_upipe.torchtitan_0_2.job_spec import job_spec

REPO = Path(__file__).resolve().parents[1]

PURE_IMPORT = """
import sys, time
start = time.perf_counter()
import {module}
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "torchtitan")))
print(round(time.perf_counter() - start, 3), len(loaded), loaded[:5])
"""


@pytest.mark.parametrize("module", ["titan_upipe.plan", "titan_upipe.spec.job_spec", "titan_upipe.tools.plan_arguments",
                                    "titan_upipe.costs"])
def test_the_planner_and_the_spec_load_neither_torch_nor_torchtitan(module):
    out = subprocess.run([sys.executable, "-c", PURE_IMPORT.format(module=module)], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    seconds, count, names = out.stdout.split(maxsplit=2)
    assert count == "0", names  # torch.distributed, torch and every torchtitan module among them


def test_plan_help_answers_without_torch():
    """``python -m titan_upipe.plan --help`` reads its arguments only (timed in docs/benchmarks/planner_cli.md)."""
    code = ("import runpy, sys\nsys.argv = ['plan', '--help']\ntry:\n    runpy.run_module('titan_upipe.plan', "
            "run_name='__main__')\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'torchtitan'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--model" in out.stdout and out.stdout.strip().endswith("[]"), out.stdout[-500:]


def test_the_setting_names_are_the_runtime_ones():
    from titan_upipe.attention.backends import BACKEND_SETTINGS
    from titan_upipe.spec import sections
    from titan_upipe.transforms.fused_ce import CE_BACKENDS

    assert tuple(BACKENDS) == settings.ATTENTION_BACKEND_NAMES
    # the sections' valid values (spec.sections, torch-free) are the runtime's, in its order
    assert sections.ATTENTION_BACKENDS == BACKEND_SETTINGS and sections.KERNEL_BACKENDS == CE_BACKENDS


@pytest.mark.parametrize("name", sorted(KNOWN_MODELS))
def test_the_named_models_are_torchtitans_flavors(name):
    model_name, flavor = MODEL_FLAVORS[name]
    assert dataclasses.replace(flavor_model_dims(f"{model_name}:{flavor}"), name=name) == KNOWN_MODELS[name]


RECIPES = ["configs/debug/llama3_upipe.toml", "configs/debug/llama3_upipe_usp.toml", "configs/debug/qwen3_upipe.toml",
           "configs/debug/llama3_upipe_docs.toml", "configs/debug/tsp.toml", "configs/debug/llama3_fsdp.toml",
           "configs/llama3_8b/upipe_1m.toml", "configs/qwen3_32b/upipe_8gpu_1m.toml"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_spec_holds_the_jobs_layout_and_settings(recipe):
    job_config = parse_config(["--job.config_file", str(REPO / recipe)], quiet=True)
    spec = job_spec(job_config)
    assert spec.layout is cp_layout(job_config)  # the one layout the job checks built: one per job
    assert spec.seq_len == job_config.training.seq_len and spec.model.n_layers > 0
    job = plan_input_from_spec(spec)
    assert (job.cp, job.seq_len, job.world_size) == (spec.cp_degree, spec.seq_len, spec.world_size)
    if spec.mode is not None:
        derived = ("mode", "ring_degree", "ulysses_degree", "heads_per_stage", "seq_divisor")
        assert [getattr(job.layout, f) for f in derived] == [getattr(spec.layout, f) for f in derived]


def test_a_spec_is_built_from_a_layout_the_checks_accept_only():
    job_config = parse_config(["--job.config_file", str(REPO / "configs/debug/llama3_upipe.toml"),
                               "--upipe.heads_per_stage", "3"], quiet=True)
    with pytest.raises(ConfigError, match="heads_per_stage"):
        job_spec(job_config)


def test_the_spec_is_a_frozen_value():
    spec = job_spec(parse_config(["--job.config_file", str(REPO / "configs/debug/upipe.toml")], quiet=True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seq_len = 1  # type: ignore[misc]
    assert isinstance(spec, JobSpec) and isinstance(spec.layout, CPLayout)


def test_a_spec_refuses_a_dtype_the_planner_cannot_size():
    spec = job_spec(parse_config(["--job.config_file", str(REPO / "configs/debug/upipe.toml")], quiet=True))
    with pytest.raises(ValueError, match="param_dtype = 'float64': valid values are float32, bfloat16, float16"):
        dataclasses.replace(spec, param_dtype="float64")


def test_the_kernel_table_reads_dtypes_by_name_and_refuses_one_it_does_not_measure():
    """``costs.kernel_speed`` imports no torch: a dtype is read by its name; one the table does not
    measure is refused (it would match no row, and the job would be judged by every row)."""
    import torch

    from titan_upipe.costs.kernel_speed import dtype_name

    assert [dtype_name(d) for d in (torch.bfloat16, "bfloat16", "bf16", torch.float16, "half", torch.float32)] == \
        ["bf16", "bf16", "bf16", "fp16", "fp16", "fp32"]
    assert dtype_name(None) is None
    with pytest.raises(ValueError, match="dtype torch.float64: the kernel table measures bf16, fp16, fp32"):
        dtype_name(torch.float64)
