"""What a job needs on disk and in host memory, checked before any process group starts."""

from __future__ import annotations

import pytest
from text_assets import write_corpus, write_hf_weights, write_tokenizer
from trainer_utils import REPO

from titan_upipe.errors import ConfigError
from titan_upipe.tools import preflight as validate
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_0_2.job_assets import check_assets

RECIPE = str(REPO / "configs/llama3_8b/upipe_4m.toml")
GIB = 1024**3


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    write_corpus(root / "data")
    write_tokenizer(root / "hf")
    write_hf_weights(root / "hf")  # the debug flavor's; only their presence is checked here
    return root


def with_assets(assets, tmp_path) -> list[str]:
    return ["--model.hf_assets_path", str(assets / "hf"), "--local_data.paths", str(assets / "data" / "*.jsonl"),
            "--job.dump_folder", str(tmp_path / "out")]


def test_validate_rejects_a_missing_tokenizer_directory_with_the_download_command(capsys, tmp_path):
    assert validate.main([RECIPE, "--world-size", "8", "--job.dump_folder", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "model.hf_assets_path = './assets/hf/Llama-3.1-8B' does not exist" in out
    assert "hf download meta-llama/Llama-3.1-8B --local-dir ./assets/hf/Llama-3.1-8B" in out
    assert "local_data.paths pattern './data/train/**/*.jsonl' matches no file" in out
    # The layout alone is fine.
    assert validate.main([RECIPE, "--world-size", "8", "--no-assets"]) == 0


def test_validate_accepts_the_recipe_once_its_files_exist(assets, tmp_path, capsys):
    assert validate.main([RECIPE, "--world-size", "8", "--host-mem", "4096", *with_assets(assets, tmp_path)]) == 0
    assert "OK for 8 ranks" in capsys.readouterr().out


def test_each_missing_file_is_named_with_its_fix(assets, tmp_path):
    def problem(*overrides: str) -> str:
        job = parse_config(["--job.config_file", RECIPE, *with_assets(assets, tmp_path), *overrides])
        with pytest.raises(ConfigError) as err:
            check_assets(job)
        return str(err.value)

    empty = tmp_path / "empty"
    empty.mkdir()
    assert "has no tokenizer.json" in problem("--model.hf_assets_path", str(empty))
    assert "matches no file" in problem("--local_data.paths", str(tmp_path / "nothing*.jsonl"))
    no_weights = tmp_path / "tokenizer_only"
    write_tokenizer(no_weights)
    message = problem("--model.hf_assets_path", str(no_weights))
    assert "has no *.safetensors" in message and "initial_load_in_hf = false" in message
    assert "does not exist" in problem("--checkpoint.initial_load_path", str(tmp_path / "missing"),
                                       "--checkpoint.no_initial_load_in_hf")


def test_host_memory_is_the_planners_offload_plus_async_staging(assets, tmp_path):
    """An independent count for Llama3-8B at 4M on 8 GPUs: 32 blocks x 512K tokens x 4096 x 2 bytes
    per rank (4 GiB blocks, powers of two, so pinning rounds nothing) and 12 bytes per parameter
    over 8 FSDP shards, times 8 ranks per node."""
    job = parse_config(["--job.config_file", RECIPE, *with_assets(assets, tmp_path)])
    needed, what = validate.host_memory_needed(job, 8)
    offload = 32 * (4 * 2**20 // 8) * 4096 * 2 * 8
    params = 8_030_261_248  # Llama-3.1-8B
    staging = 12 * params // 8 * 8
    assert needed == pytest.approx(offload + staging, rel=1e-3)
    assert "offloaded activations 1024.0 GiB" in what and "async checkpoint staging" in what
    problem = validate.host_memory_problem(job, 8, 1000 * GIB, "--host-mem")
    assert problem and "pin_memory = false" in problem
    assert validate.host_memory_problem(job, 8, 2000 * GIB, "--host-mem") is None
