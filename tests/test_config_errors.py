"""One clear error per mistake: the trainer prints a ConfigError once (rank 0), as one line with
its fix and no traceback, exits 2 before any process group starts, and ``validate`` finds the
same problem (exit 1). In-process: ``train.main`` / ``validate.main`` with WORLD_SIZE/RANK set."""

from __future__ import annotations

import errno
import pathlib
import re
import time

import pytest
import torch
from trainer_utils import REPO

from titan_upipe import errors
from titan_upipe.tools import preflight as validate
from titan_upipe.torchtitan_0_2 import launch as train
from titan_upipe.torchtitan_0_2.config import ConfigError, Transforms
from titan_upipe.torchtitan_0_2.config_parse import console_error_line

UPIPE = str(REPO / "configs/debug/llama3_upipe.toml")  # CP = 2, data_parallel_shard_degree = -1
PREFIX = "titan_upipe.train: error: "


def _toml_with(tmp_path, old: str, new: str) -> str:
    path = tmp_path / "job.toml"
    text = (REPO / "configs/debug/llama3_upipe.toml").read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    return str(path)


# (id, config or a function of tmp_path, overrides, world size, the message as a regex)
CASES = [
    ("converter-typo", UPIPE, ("--model.converters", "upipee"), 2,
     r"model.converters has unknown name\(s\) \['upipee'\]: valid values are .*; did you mean \"upipe\"\?$"),
    # tsp: every problem of the setting in one message (the llama3 debug flavor has 8 / 2 heads, FFN 384)
    ("tsp-degree", str(REPO / "configs/debug/tsp.toml"),
     ("--model.flavor", "debug", "--parallelism.context_parallel_degree", "4", "--model.converters",
      "tsp,tiled_mlp"), 4,
     r"^TSP degree 4 does not divide the 2 KV heads \(each rank owns K/D KV heads, .*: use 2; "
     r"model.converters has 'tsp' and 'tiled_mlp': .*; remove 'tiled_mlp'$"),
    ("tsp-cpu-offload", str(REPO / "configs/debug/tsp.toml"), ("--training.enable_cpu_offload",), 4,
     r"^training.enable_cpu_offload with tsp is not supported .*: set training.enable_cpu_offload = false$"),
    ("tsp-data-parallel", str(REPO / "configs/debug/tsp.toml"), ("--parallelism.context_parallel_degree", "2"), 4,
     r"^tsp shards the blocks' weights over the CP ranks; data parallelism on top .* "
     r"\(world size = context_parallel_degree\)$"),
    ("unknown-toml-key", lambda tmp: _toml_with(tmp, "steps = 30", "stesp = 30"), (), 2,
     r"job.toml: unknown key training.stesp: did you mean \"training.steps\"\?$"),
    ("unknown-flag", UPIPE, ("--trainin.steps", "3"), 2, r"^unknown option --trainin.steps: did you mean --training.steps\?$"),
    ("bad-backend", UPIPE, ("--upipe.attention_backend", "sdpaa"), 2,
     r"^invalid upipe.attention_backend = 'sdpaa': valid values are auto, sdpa, .*; did you mean \"sdpa\"\?$"),
    ("bad-toml-type", lambda tmp: _toml_with(tmp, "steps = 30", 'steps = "30"'), (), 2,
     r"job.toml: invalid training.steps = '30' \(str\): valid values are integers$"),
    ("bad-flag-value", UPIPE, ("--training.steps", "abc"), 2, r"^Error parsing --training.steps: invalid literal"),
    # no CP degree dividing 3 splits the 8 query / 2 KV heads (and 1 has no CP attention): none suggested
    ("nproc3-cp2", UPIPE, (), 3, r"^3 ranks are not a multiple of context_parallel_degree 2: launch 2 or 4 ranks "
                                 r"\(no context_parallel_degree fits both 3 ranks and this job's heads, .*\)$"),
    ("nproc2-cp3", UPIPE, ("--parallelism.context_parallel_degree", "3"), 2,
     r"^2 ranks are not a multiple of context_parallel_degree 3: set context_parallel_degree to 2$"),
    ("dp-shard3-on-2", UPIPE, ("--parallelism.data_parallel_shard_degree", "3"), 2,
     r"^context_parallel_degree 2 x data_parallel_shard_degree 3 need 6 ranks, but 2 are launched: launch 6 ranks, "
     r"or set data_parallel_shard_degree to 1 \(or -1"),
    ("missing-file", str(REPO / "configs/debug/llama3_upipee.toml"), (), 2,
     r"config file .*llama3_upipee.toml not found \(.*has no such file\); did you mean \".*llama3_upipe.toml\"\?$"),
    ("local-batch-0", UPIPE, ("--training.local_batch_size", "0"), 2,
     r"^training.local_batch_size = 0 is invalid \(sequences per data-parallel rank\): valid values are 1 or more$"),
    ("local-batch-neg", UPIPE, ("--training.local_batch_size", "-1"), 2, r"^training.local_batch_size = -1 is invalid"),
    ("steps-0", UPIPE, ("--training.steps", "0"), 2, r"^training.steps = 0 is invalid .*valid values are 1 or more$"),
    ("steps-neg", UPIPE, ("--training.steps", "-1"), 2, r"^training.steps = -1 is invalid"),
    ("progress-neg", UPIPE, ("--metrics.progress_after_seconds", "-1"), 2,
     r"^invalid metrics.progress_after_seconds = -1.0: valid values are 0 \(every step\) or a positive number"),
    ("global-batch", UPIPE, ("--training.global_batch_size", "3"), 2,
     r"^training.global_batch_size = 3 is not a multiple of local_batch_size 2 x data-parallel degree 1 = 2"),
]


def _file_with(content: bytes):
    """A config file holding ``content``, at ``job.toml`` under the test's folder."""
    def write(tmp_path) -> str:
        path = tmp_path / "job.toml"
        path.write_bytes(content)
        return str(path)
    return write


UPIPE_BYTES = (REPO / "configs/debug/llama3_upipe.toml").read_bytes()

# A config file that is not UTF-8 TOML text, or holds nothing: one line naming the file (TorchTitan's
# reader: a UnicodeDecodeError traceback on every rank, "Invalid statement" for a BOM, an empty file
# trains the defaults). The unquoted glob: tyro's "Unrecognized options: /data/b.jsonl" before.
FILE_CASES = [
    ("file-bom", _file_with(b"\xef\xbb\xbf" + UPIPE_BYTES), (), 2,
     r"^config file \S+job.toml starts with a UTF-8 byte-order mark \(BOM\), .*: save it as UTF-8 without a BOM$"),
    ("file-utf16", _file_with(UPIPE_BYTES.decode().encode("utf-16")), (), 2,
     r"^config file \S+job.toml is UTF-16 text .*: save it as UTF-8$"),
    ("file-not-utf8", _file_with(UPIPE_BYTES.replace(b"# ", b"# caf\xe9 ", 1)), (), 2,
     r"^config file \S+job.toml is not UTF-8 text \(byte 0xe9 at line 1, column 6\): save it as UTF-8$"),
    ("file-binary", _file_with(b"\x7fELF\x02\x01\x01\x00\x00"), (), 2,
     r"^config file \S+job.toml is a binary file, not TOML text \(a NUL byte at line 1, column 8\)"),
    ("file-empty", _file_with(b""), (), 2,
     r"^config file \S+job.toml is empty: TorchTitan would train its defaults; name a config with \[model\] and "
     r"\[training\]"),
    ("file-comments-only", _file_with(b"# a job\n\n"), (), 2,
     r"^config file \S+job.toml holds no settings \(only comments\): TorchTitan would train its defaults"),
    ("unquoted-glob", UPIPE, ("--local_data.paths", "/data/a.jsonl", "/data/b.jsonl", "--training.steps", "3"), 2,
     r"^--local_data.paths takes one value but got /data/a.jsonl /data/b.jsonl: an unquoted glob that the shell "
     r"expanded\? quote it .*, e.g. --local_data.paths '/data/\*.jsonl' \(a list is one comma-separated value\)$"),
]
CASES += FILE_CASES


def _config(case_config, tmp_path) -> str:
    return case_config(tmp_path) if callable(case_config) else case_config


def _launch_env(monkeypatch, world: int, rank: int) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", str(rank))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_once_and_validate_agrees(case, tmp_path, monkeypatch, capsys):
    _, config, overrides, world, message = case
    config = _config(config, tmp_path)
    _launch_env(monkeypatch, world, rank=0)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--job.config_file", config, *overrides])
    assert exit_info.value.code == 2
    assert not torch.distributed.is_initialized()  # refused before any process group
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(PREFIX)]
    assert len(lines) == 1 and err.count(PREFIX) == 1, err
    assert re.search(message, lines[0][len(PREFIX):]), lines[0]
    assert "Traceback" not in err and "╭" not in err and "Value error" not in err

    assert validate.main([config, "--world-size", str(world), "--no-assets", *overrides]) == 1
    reported = capsys.readouterr().out
    assert any(re.search(message, line.removeprefix("  - ")) for line in reported.splitlines()), reported


def test_other_ranks_leave_after_rank_zero_and_speak_only_if_it_did_not(monkeypatch, capsys):
    """Under torchrun a rank other than 0 outlives rank 0 by the grace period (torchrun stops it
    once rank 0 has printed and exited: tests/test_launch.py); still alive after it, it reports
    for its node."""
    _launch_env(monkeypatch, 3, rank=2)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setenv("LOCAL_RANK", "0")  # a second node's first rank
    monkeypatch.setattr(errors, "RANK_ZERO_GRACE_SECONDS", 0.2)
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--job.config_file", UPIPE])
    assert exit_info.value.code == 2
    assert time.monotonic() - start >= 0.2
    captured = capsys.readouterr()
    assert captured.err.count("error") == 1 and "error" not in captured.out, captured
    assert captured.err.startswith("titan_upipe.train: error on rank 2: 3 ranks are not")


def test_an_unreadable_config_file_is_one_line(tmp_path, monkeypatch, capsys):
    """(Faked: the tests run as root, who reads any file.)"""
    path = tmp_path / "job.toml"
    path.write_bytes(UPIPE_BYTES)

    def denied(self):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "read_bytes", denied)
    _launch_env(monkeypatch, 2, rank=0)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--job.config_file", str(path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"{PREFIX}config file {path} cannot be read (permission denied): make it readable by the user running the "
        "job (chmod a+r)")


def test_ce_backend_typo_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"^invalid transforms.ce_backend = 'torh': valid values are auto, torch, "
                                          r"liger; did you mean \"torch\"\?$"):
        Transforms(ce_backend="torh")


@pytest.mark.parametrize("drawing", ["utf8", "ascii"])
def test_tyro_error_box_becomes_its_message(drawing):
    """tyro draws with UTF-8 box characters or ASCII, depending on stdout's encoding."""
    utf8 = ("╭─ Value error ─────────────╮\n│ Error parsing --training.steps: invalid │\n│ literal 'abc'  │\n"
            "│ ───────────── │\n│ Argument helptext: │\n╰─────────────╯\n")
    ascii_ = " Value error \n ------------- \n  Error parsing --training.steps: invalid \n  literal 'abc' \n" \
             " ------------- \n  Argument helptext: \n"
    text = utf8 if drawing == "utf8" else ascii_
    assert console_error_line(text) == "Error parsing --training.steps: invalid literal 'abc'"
