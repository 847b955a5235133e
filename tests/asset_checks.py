"""The two pre-launch paths of a job's file checks, run in-process: the trainer's ``check_assets``
(the first problem, one ConfigError line) and ``validate`` (every problem, exit 1)."""

from __future__ import annotations

import pytest

from titan_upipe.errors import ConfigError
from titan_upipe.tools import preflight as validate
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_0_2.job_assets import check_assets


def refused(capsys, config: str, args: list[str], *fragments: str) -> str:
    """The one-line ConfigError of the trainer's pre-launch check, holding every fragment; ``validate``
    prints the same line and exits 1."""
    job = parse_config(["--job.config_file", config, *args])
    with pytest.raises(ConfigError) as err:
        check_assets(job)
    message = str(err.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert validate.main([config, "--world-size", "1", *args]) == 1
    assert f"  - {message}" in capsys.readouterr().out
    return message


def accepted(capsys, config: str, args: list[str]) -> str:
    """Both checks pass; ``validate``'s output."""
    check_assets(parse_config(["--job.config_file", config, *args]))
    assert validate.main([config, "--world-size", "1", *args]) == 0
    return capsys.readouterr().out
