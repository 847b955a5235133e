"""``python -m titan_upipe.validate X.toml`` on TorchTitan 0.3 (``tools/spec_preflight.py``): the launch's checks
before any process group, the files the job opens, the planner's memory verdict; exit 0 / 1 / 2."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from titan_upipe.tools.spec_preflight import main as validate

TSP_RECIPE = "configs/llama3_8b/tsp_1m.toml"  # local_text, D = 8, bf16: a GPU job


def test_a_recipe_validates_with_its_layout(capsys):
    assert validate([TSP_RECIPE, "--no-assets"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{TSP_RECIPE}: OK for 8 ranks\n")
    assert "context parallel tsp: ulysses 1 x ring 8" in out and "tokens per rank  131072 of 1048576" in out
    assert not dist.is_initialized()


def test_the_data_files_are_opened_unless_no_assets(capsys):
    """The recipe reads ``./data/train/**/*.jsonl``, which this checkout does not hold."""
    assert validate([TSP_RECIPE]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{TSP_RECIPE}: 1 problem(s):\n  - local_data.paths pattern './data/train/**/*.jsonl' "
                          "matches no file")


def test_a_job_that_does_not_fit_is_one_problem_with_the_length_that_fits(capsys):
    assert validate(["configs/llama3_8b/upipe_1m.toml", "--no-assets", "--training.seq_len", "16777216"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("configs/llama3_8b/upipe_1m.toml: 1 problem(s) for 8 ranks:\n  - training.seq_len = "
                          "16,777,216 does not fit")


def test_a_usage_error_is_status_2(capsys):
    with pytest.raises(SystemExit) as stop:
        validate(["configs/llama3_8b/upipe_1m.toml", "--world-size", "0"])
    assert stop.value.code == 2
