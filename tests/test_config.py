"""Every committed TOML parses; the plugin's sections parse from TOML and CLI and reject bad input."""

from pathlib import Path

import pytest

from titan_upipe.torchtitan_0_2.config import ATTENTION_BACKENDS, ConfigError
from titan_upipe.torchtitan_0_2.config_parse import parse_config, with_plugin_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.toml"))


def write_toml(tmp_path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_configs_exist():
    assert "configs/debug/llama3_fsdp.toml" in CONFIGS


@pytest.mark.parametrize("config", CONFIGS)
def test_every_committed_config_parses(config):
    job = parse_config(["--job.config_file", str(REPO / config)])
    assert job.model.name.startswith("upipe_")
    assert job.job.custom_config_module == "titan_upipe.config"
    assert job.experimental.custom_import == "titan_upipe.plugin"


SAME_PARSE = [
    ["--job.config_file", str(REPO / "configs/llama3_8b/upipe_1m.toml")],
    ["--job.config_file", str(REPO / "configs/qwen3_32b/upipe_usp_6m.toml"), "--training.steps", "7",
     "--activation_checkpoint.no-cpu_offload", "--model.converters", "upipe,fused_ce", "--upipe.heads_per_stage=16"],
    ["--job.config_file", str(REPO / "configs/debug/llama3_upipe_docs.toml"), "--validation.enable",
     "--training.on_nonfinite", "skip_step", "--lr_scheduler.warmup_steps", "0"],
    ["--training.steps", "3"],  # no TOML: the defaults
]


@pytest.mark.parametrize("args", SAME_PARSE, ids=["recipe", "overrides", "docs", "no-toml"])
def test_the_parse_without_help_text_is_torchtitans(args):
    """``HelpOnDemandConfigManager`` (tyro without the fields' help text) gives TorchTitan's
    ``ConfigManager``'s JobConfig, field for field."""
    import dataclasses

    from torchtitan.config import ConfigManager

    from titan_upipe.torchtitan_0_2.config_parse import HelpOnDemandConfigManager

    args = with_plugin_config(args)
    assert dataclasses.asdict(HelpOnDemandConfigManager().parse_args(list(args))) == \
        dataclasses.asdict(ConfigManager().parse_args(list(args)))


def test_upipe_section_from_toml_and_cli(tmp_path):
    path = write_toml(tmp_path, '[upipe]\nheads_per_stage = 4\nattention_backend = "sdpa"\n')
    assert parse_config(["--job.config_file", path]).upipe.heads_per_stage == 4
    overridden = parse_config(["--job.config_file", path, "--upipe.heads_per_stage", "8"])
    assert overridden.upipe.heads_per_stage == 8  # CLI > TOML
    assert parse_config([]).upipe.heads_per_stage == 0  # defaults without any TOML


def test_plugin_config_module_is_added_only_when_missing(tmp_path):
    assert with_plugin_config([])[-1] == "--job.custom_config_module=titan_upipe.config"
    own = ["--job.custom_config_module", "my.module"]
    assert with_plugin_config(own) == own
    path = write_toml(tmp_path, '[job]\ncustom_config_module = "titan_upipe.config"\n')
    assert with_plugin_config(["--job.config_file", path]) == ["--job.config_file", path]


def test_unknown_key_in_plugin_section_is_named(tmp_path):
    path = write_toml(tmp_path, "[upipe]\nheads_per_stag = 4\n")
    with pytest.raises(ValueError, match="heads_per_stag"):
        parse_config(["--job.config_file", path])


@pytest.mark.parametrize(
    "toml, key",
    [
        ('attention_backend = "flash_magic"', "upipe.attention_backend"),
        ("heads_per_stage = -8", "upipe.heads_per_stage"),
        ('heads_per_stage = "eight"', "upipe.heads_per_stage"),
        ("ulysses_degree = -1", "upipe.ulysses_degree"),
    ],
)
def test_bad_value_from_toml_names_key_and_choices(tmp_path, toml, key):
    path = write_toml(tmp_path, f"[upipe]\n{toml}\n")
    with pytest.raises(ConfigError, match=key) as err:
        parse_config(["--job.config_file", path])
    assert "valid values are" in str(err.value)


def test_bad_value_from_cli_names_key_and_choices(capsys):
    # tyro's box on stderr (and its SystemExit) becomes one ConfigError line.
    with pytest.raises(ConfigError) as err:
        parse_config(["--upipe.attention_backend", "flash_magic"])
    message = str(err.value)
    assert message.startswith("invalid upipe.attention_backend = 'flash_magic': valid values are ")
    assert all(name in message for name in ATTENTION_BACKENDS)
    assert capsys.readouterr().err == ""


def test_the_plugins_fields_of_a_merged_section_have_their_defaults_stated_once():
    """``plugin_fields``: a section's own values where it has the plugin's fields (merged into
    TorchTitan's class), the dataclass defaults where a config came without the plugin's module."""
    from types import SimpleNamespace

    from titan_upipe.torchtitan_0_2.config import (
        ActivationCheckpointOffload,
        OptimizerHostState,
        plugin_fields,
    )

    merged = SimpleNamespace(mode="full", cpu_offload=True, pin_memory="no", resident_blocks=2,
                             prefetch_after_attention=False)
    offload = plugin_fields(merged, ActivationCheckpointOffload)
    assert (offload.cpu_offload, offload.pin_memory, offload.resident_blocks) == (True, "no", 2)  # as given
    assert plugin_fields(SimpleNamespace(mode="full"), ActivationCheckpointOffload) == ActivationCheckpointOffload()
    assert plugin_fields(SimpleNamespace(name="AdamW"), OptimizerHostState).state_on_host is False
