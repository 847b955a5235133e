"""What a job needs on disk and in host memory, checked before any process group starts."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from asset_checks import accepted, refused
from text_assets import write_corpus, write_tokenizer
from trainer_utils import REPO

from titan_upipe.errors import ConfigError
from titan_upipe.tools import preflight as validate
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_0_2.job_assets import check_assets

RECIPE = str(REPO / "configs/llama3_8b/upipe_4m.toml")
GIB = 1024**3


def write_hf_header(folder, model_name: str, flavor: str) -> None:
    """``model.safetensors`` with the flavor's Hugging Face names and shapes (bf16) in its header and
    no data: a sparse file of the size the header states (the checks read headers and sizes only)."""
    from titan_upipe.torchtitan_0_2.job_assets.model_state import model_state

    header, offset = {}, 0
    for name, shape in model_state(model_name, flavor).hf_shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + offset)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    write_corpus(root / "data")
    write_tokenizer(root / "hf")
    write_hf_header(root / "hf", "upipe_llama3", "8B")  # the recipe's model: 16 GB in bf16, sparse
    return root


@pytest.fixture
def roomy_disk(monkeypatch):
    """A disk with room for an 8B checkpoint (96 GB), whatever this machine has."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=10**12))


def with_assets(assets, tmp_path) -> list[str]:
    return ["--model.hf_assets_path", str(assets / "hf"), "--local_data.paths", str(assets / "data" / "*.jsonl"),
            "--job.dump_folder", str(tmp_path / "out")]


def test_validate_rejects_a_missing_tokenizer_directory_with_the_download_command(capsys, tmp_path):
    assert validate.main([RECIPE, "--world-size", "8", "--device", "cuda", "--job.dump_folder", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "model.hf_assets_path = './assets/hf/Llama-3.1-8B' does not exist" in out
    assert "hf download meta-llama/Llama-3.1-8B --local-dir ./assets/hf/Llama-3.1-8B" in out
    assert "local_data.paths pattern './data/train/**/*.jsonl' matches no file" in out
    # The layout alone is fine.
    assert validate.main([RECIPE, "--world-size", "8", "--no-assets", "--device", "cuda"]) == 0


def test_validate_accepts_the_recipe_once_its_files_exist(assets, tmp_path, capsys, roomy_disk):
    assert validate.main([RECIPE, "--world-size", "8", "--device", "cuda", "--host-mem", "4096", *with_assets(assets, tmp_path)]) == 0
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


DEBUG = str(REPO / "configs/debug/llama3_fsdp.toml")


def text_job(hf, data, tmp_path, *overrides: str) -> list[str]:
    """The Llama3 debug flavor (vocab_size 512) on local text tokenized with ``hf``'s tokenizer."""
    return ["--training.dataset", "local_text", "--model.hf_assets_path", str(hf), "--local_data.paths", str(data),
            "--job.dump_folder", str(tmp_path / "out"), *overrides]


def test_a_tokenizer_that_is_not_json_is_named(assets, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(assets / "hf", hf, ignore=shutil.ignore_patterns("*.safetensors"))
    accepted(capsys, DEBUG, text_job(hf, assets / "data" / "*.jsonl", tmp_path))
    text = (hf / "tokenizer.json").read_text()
    (hf / "tokenizer.json").write_text(text[: len(text) // 2])  # an interrupted download
    refused(capsys, DEBUG, text_job(hf, assets / "data" / "*.jsonl", tmp_path),
            f"{hf}/tokenizer.json is not JSON (line ", "download the tokenizer again (hf download")


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(assets, tmp_path, capsys):
    """2003 ids for an embedding of 512 would fail as an IndexError in the first step."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    hf = tmp_path / "big"
    hf.mkdir()
    Tokenizer(WordLevel({f"w{i}": i for i in range(2003)}, unk_token="w0")).save(str(hf / "tokenizer.json"))
    refused(capsys, DEBUG, text_job(hf, assets / "data" / "*.jsonl", tmp_path),
            f"the tokenizer in model.hf_assets_path = '{hf}' has 2003 tokens but upipe_llama3 / debug embeds 512 "
            "(vocab_size)", "use this model's tokenizer", "a flavor with vocab_size >= 2003")


def test_data_files_are_read_before_launch(assets, tmp_path, capsys):
    """An empty file, a text key absent from the first records, and a broken line: each named with
    its file (and line), before any process group; ``skip_bad_records`` lets the job skip them."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(assets / "data" / "a.jsonl", data / "a.jsonl")
    files = str(data / "*.jsonl")
    (data / "b.jsonl").write_text("")  # an empty shard beside others: the stream skips it
    accepted(capsys, DEBUG, text_job(assets / "hf", files, tmp_path))
    refused(capsys, DEBUG, text_job(assets / "hf", str(data / "b.jsonl"), tmp_path),
            f"no file of local_data.paths holds a document (empty, or only blank records: {data}/b.jsonl)",
            "point local_data.paths at the data")
    (data / "b.jsonl").write_text('{"body": "one"}\n{"body": "two"}\n')
    refused(capsys, DEBUG, text_job(assets / "hf", files, tmp_path),
            f"{data}/b.jsonl, line 1: no 'text' key (keys: ['body']): set local_data.text_key")
    (data / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "two"\n{"text": "three"}\n')
    refused(capsys, DEBUG, text_job(assets / "hf", files, tmp_path),
            f"{data}/b.jsonl, line 3: not JSON (Expecting ',' delimiter at column 15): fix or remove the line, or set "
            "local_data.skip_bad_records = true to skip bad records")
    accepted(capsys, DEBUG, text_job(assets / "hf", files, tmp_path, "--local_data.skip_bad_records"))
