"""``[context_parallel]``, the documented name of the context-parallel section, and ``[upipe]``, its
older name and the JobConfig field's: the same job from either, flags under either name, a file with
both refused (issue 43, docs/config.md)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from titan_upipe.errors import ConfigError
from titan_upipe.torchtitan_0_2.config_parse import HelpOnDemandConfigManager, parse_config

SETTINGS = 'heads_per_stage = 4\nulysses_degree = 2\nattention_backend = "math"\ndocument_balance = "zigzag"\n'
"""Every value differs from the section's default, so that a section that is not read shows."""
JOB = '[model]\nname = "upipe_llama3"\nflavor = "debug"\nconverters = ["upipe"]\n[training]\nsteps = 3\n'


def write(tmp_path, section: str, settings: str = SETTINGS) -> str:
    path = tmp_path / "job.toml"  # one path for both names: job.config_file is then equal too
    path.write_text(f"{JOB}[{section}]\n{settings}")
    return str(path)


def parsed(path: str, *flags: str):
    return parse_config(["--job.config_file", path, *flags], quiet=True)


def test_both_names_give_the_same_job_config(tmp_path):
    new = dataclasses.asdict(parsed(write(tmp_path, "context_parallel")))
    old = dataclasses.asdict(parsed(write(tmp_path, "upipe")))
    assert new == old  # field for field, every section
    assert new["upipe"] == {"heads_per_stage": 4, "ulysses_degree": 2, "attention_backend": "math",
                            "document_balance": "zigzag", "document_min_split": 16384}


def test_help_reads_context_parallel_too(tmp_path):
    """``--help`` runs TorchTitan's ``parse_args``, which reads the file through the manager's
    ``_maybe_load_toml``: the section arrives under the field's name there as well."""
    values = HelpOnDemandConfigManager()._maybe_load_toml(["--job.config_file", write(tmp_path, "context_parallel")])
    assert "context_parallel" not in values and values["upipe"]["heads_per_stage"] == 4


BOTH = ("has both [context_parallel] and [upipe], the same section under its two names ([upipe] is the older "
        "one): move the keys of [upipe] into [context_parallel] and delete [upipe]")


def test_a_file_with_both_names_is_refused(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text(f"{JOB}[context_parallel]\nheads_per_stage = 4\n[upipe]\nulysses_degree = 2\n")
    with pytest.raises(ConfigError) as err:
        parsed(str(path))
    assert str(err.value) == f"config file {path} {BOTH}"
    # ...and the trainer's launch says so in one line before any process group (exit status 2).
    from titan_upipe.torchtitan_0_2.launch import check_before_launch

    root = logging.getLogger()
    level = root.level
    try:
        with pytest.raises(SystemExit) as exit_:
            check_before_launch(["--job.config_file", str(path)], None, 1)
    finally:
        root.setLevel(level)  # (check_before_launch quiets the root logger, as its process would be)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"config file {path} {BOTH}")


@pytest.mark.parametrize("section", ["context_parallel", "upipe"])
@pytest.mark.parametrize("flag", [("--context_parallel.heads_per_stage", "8"), ("--context-parallel.heads_per_stage=8",),
                                  ("--upipe.heads_per_stage", "8"), ("--upipe.heads-per-stage=8",)],
                         ids=["context_parallel", "context-parallel=", "upipe", "upipe="])
def test_either_flag_spelling_overrides_either_section(tmp_path, section, flag):
    job = parsed(write(tmp_path, section), *flag)
    assert job.upipe.heads_per_stage == 8 and job.upipe.ulysses_degree == 2  # the flag over the file's 4


def test_a_key_typo_is_named_as_written(tmp_path):
    with pytest.raises(ConfigError, match=r'unknown key context_parallel\.heads_per_stag: did you mean '
                                          r'"context_parallel\.heads_per_stage"\?'):
        parsed(write(tmp_path, "context_parallel", "heads_per_stag = 4\n"))
    with pytest.raises(ConfigError, match=r"^unknown option --context_parallel\.heads_per_stag: did you mean "
                                          r"--context_parallel\.heads_per_stage\?$"):
        parsed(write(tmp_path, "upipe"), "--context_parallel.heads_per_stag", "8")
    with pytest.raises(ConfigError, match=r"^[^:]*job\.toml: unknown section \[contex_parallel\]: did you mean "
                                          r"\[context_parallel\]\?$"):
        parsed(write(tmp_path, "contex_parallel"))


def test_value_messages_keep_the_internal_name(tmp_path):
    """The section's own checks, the job checks and ``validate`` name ``upipe.X`` whichever name the
    file used (the field's name: dozens of messages, and the tests that read them, stay as they are)."""
    with pytest.raises(ConfigError, match=r"^invalid upipe\.attention_backend = 'sdpaa': valid values are "):
        parsed(write(tmp_path, "context_parallel", 'attention_backend = "sdpaa"\n'))


def test_torchtitans_own_parser_knows_upipe_only(tmp_path):
    """What docs/config.md says of ``-m torchtitan.train``: TorchTitan's ``ConfigManager`` reads the
    file before the plugin is imported and refuses ``[context_parallel]`` (it runs no CP converter)."""
    from torchtitan.config import ConfigManager

    module = ["--job.custom_config_module", "titan_upipe.config"]
    assert ConfigManager().parse_args(["--job.config_file", write(tmp_path, "upipe"), *module]).upipe.heads_per_stage == 4
    with pytest.raises(ValueError, match="context_parallel"):
        ConfigManager().parse_args(["--job.config_file", write(tmp_path, "context_parallel"), *module])
