"""Selective activation checkpointing with the context-parallel converters (issue 16, item 3).

TorchTitan's default ``[activation_checkpoint]`` is ``mode = "selective"``, ``selective_ac_option =
"2"``: every 2nd block checkpointed, the others keep their activations. With a CP converter that is
refused before launch, with the measured cost and the setting to use; ``"op"`` and ``"1"`` (which
are full AC in this plugin) and every setting without a CP converter pass. Numbers and commands:
docs/benchmarks/selective_ac.md. The config is parsed once (parsing costs ~0.5 s) and varied in copies.
"""

from __future__ import annotations

import copy
import re
import types

import pytest
import torch
import torch.nn as nn
from trainer_utils import REPO

from titan_upipe.tools import preflight as validate
from titan_upipe.torchtitan_0_2 import launch as train
from titan_upipe.torchtitan_0_2 import parallelize
from titan_upipe.torchtitan_0_2.checks import check_job
from titan_upipe.torchtitan_0_2.checks.training import check_activation_checkpointing
from titan_upipe.torchtitan_0_2.config import ConfigError
from titan_upipe.torchtitan_0_2.config_parse import parse_config

UPIPE = REPO / "configs/debug/llama3_upipe.toml"  # CP = 2, world 2, mode = "none"


@pytest.fixture(scope="module")
def upipe_job():
    return parse_config(["--job.config_file", str(UPIPE)])


def with_ac(job, mode: str, option: str = "2", converters: list[str] | None = None):
    job = copy.deepcopy(job)
    job.activation_checkpoint.mode, job.activation_checkpoint.selective_ac_option = mode, option
    if converters is not None:
        job.model.converters = converters
    return job


@pytest.mark.parametrize(
    "converter, option, figures",
    [
        ("upipe", "2", "8 ranks: 118 GiB per rank against 54 with full AC and 26 offloaded"),
        ("ulysses", "2", "8 ranks: 163 GiB per rank against 57 with full AC and 29 offloaded"),
        ("ring", "2", "8 ranks: 169 GiB per rank against 63 with full AC and 35 offloaded"),
        ("usp", "2", "16 ranks: 86 GiB per rank against 33 with full AC and 19 offloaded"),
        ("upipe", "4", "8 ranks: 118 GiB"),
    ],
)
def test_selective_layer_ac_with_a_cp_converter_is_refused_with_its_cost_and_fix(upipe_job, converter, option,
                                                                                  figures):
    job = with_ac(upipe_job, "selective", option, [converter, "fused_ce"])
    with pytest.raises(ConfigError) as err:
        check_activation_checkpointing(job, 1)
    message = str(err.value)
    assert f'selective_ac_option = "{option}"' in message and f"one block in {option}" in message
    assert f"too many for {converter} at long contexts (Llama3-8B, 1M tokens, {figures}" in message
    assert message.endswith('set activation_checkpoint.mode = "full" (with activation_checkpoint.cpu_offload = true '
                            'for long contexts), or "none" for short debug runs')
    assert ("TorchTitan's default" in message) == (option == "2")
    assert "\n" not in message


@pytest.mark.parametrize(
    "mode, option, converters",
    [
        ("selective", "op", ["upipe"]),  # op-level AC without a save list: full AC (test below)
        ("selective", "1", ["upipe"]),  # every block checkpointed
        ("full", "2", ["upipe"]),
        ("none", "2", ["ring"]),
        ("selective", "2", []),  # plain FSDP: TorchTitan's default, unchanged
        ("selective", "2", ["tiled_mlp", "fused_ce"]),
        ("selective", "op", []),
    ],
)
def test_other_settings_pass(upipe_job, mode, option, converters):
    check_activation_checkpointing(with_ac(upipe_job, mode, option, converters), 1)


def test_op_level_ac_passes_the_whole_job_and_reaches_torchtitan_without_a_save_list(upipe_job, monkeypatch):
    """``"op"`` passes because the plugin's ``parallelize`` gives TorchTitan's op-level AC no save
    list, so every op is recomputed: the same bytes as full AC (measured). Passing TorchTitan's
    Llama3 list would keep every UPipe stage's matmul and attention outputs (measured in the
    benchmark), and the check would have to refuse ``"op"`` too."""
    job = with_ac(upipe_job, "selective", "op")
    check_job(job, world_size=2)
    calls = []
    monkeypatch.setattr(parallelize, "apply_ac", lambda model, ac_config, **kwargs: calls.append((ac_config, kwargs)))
    dims = types.SimpleNamespace(world_size=2, fsdp_enabled=False, dp_replicate_enabled=False)
    parallelize.parallelize(nn.Module(), dims, job)
    assert len(calls) == 1 and calls[0][0].selective_ac_option == "op"
    assert not calls[0][1].get("op_sac_save_list"), calls[0][1]


def test_invalid_selective_option_is_refused_for_every_job(upipe_job):
    with pytest.raises(ConfigError, match=r"selective_ac_option = 'every2' is invalid: valid values are \"op\" or"):
        check_activation_checkpointing(with_ac(upipe_job, "selective", "every2", []), 1)


def test_a_cp_toml_without_the_section_stops_before_launch_and_validate_reports_it(tmp_path, monkeypatch, capsys):
    """The case of the issue: the section omitted, TorchTitan's default applies."""
    text = UPIPE.read_text()
    assert '[activation_checkpoint]\nmode = "none"\n' in text
    path = tmp_path / "job.toml"
    path.write_text(text.replace('[activation_checkpoint]\nmode = "none"\n', ""))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(train, "run", lambda config: pytest.fail("the job was launched"))
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--job.config_file", str(path)])
    assert exit_info.value.code == 2 and not torch.distributed.is_initialized()
    err = capsys.readouterr().err
    assert re.fullmatch(r'titan_upipe\.train: error: activation_checkpoint\.mode = "selective" \(selective_ac_option = '
                        r'"2"; TorchTitan\'s default .* or "none" for short debug runs\n', err), err

    assert validate.main([str(path), "--world-size", "2", "--no-assets"]) == 1
    out = capsys.readouterr().out
    assert '1 problem(s) for 2 ranks:\n  - activation_checkpoint.mode = "selective"' in out, out


def test_the_planner_plans_the_full_ac_selective_settings_as_full_and_no_other(upipe_job):
    from titan_upipe.torchtitan_0_2.job_plan import plan_input_from_job_config

    for option in ("op", "1"):
        assert plan_input_from_job_config(with_ac(upipe_job, "selective", option), 2).ac_mode == "full"
    with pytest.raises(ValueError, match="selective_ac_option = '2'"):
        plan_input_from_job_config(with_ac(upipe_job, "selective", "2"), 2)
