"""What a job reads as input: the tokenizer and the data files, opened as the job will open them, before any
process group starts. Both adapters call these with their job's values (0.2.2: ``job_assets.inputs``;
0.3: ``job.check_inputs``); the messages are the same on both.

* The tokenizer of ``model.hf_assets_path`` (any dataset but the synthetic ones): present,
  loadable by TorchTitan's ``HuggingFaceTokenizer`` (a JSON file that is not JSON is named), no
  larger than the model's embedding (``vocab_size``: a larger id fails mid-step), and with an EOS
  token for a flavor that packs documents (it ends a document at each).
* ``training.dataset = "local_text"``: every ``local_data.paths`` pattern matches .jsonl/.parquet/.txt
  files, and the first records of each file (the first ``MAX_FILES_READ`` files; every file's
  size) read as the loader reads them (``local_text.check_first_records``); likewise
  ``validation.dataset_path`` for ``validation.dataset = "local_text"``.
"""

from __future__ import annotations

import json
import os

from titan_upipe.data.local_text import (
    LOCAL_TEXT_DATASET,
    check_first_records,
    check_some_document,
    expand_paths,
)
from titan_upipe.data.synthetic import SYNTHETIC_DATASETS
from titan_upipe.errors import ConfigError
from titan_upipe.spec.sections import LocalData

HF_REPOS = {"upipe_llama3": {"8B": "meta-llama/Llama-3.1-8B"}, "upipe_qwen3": {"32B": "Qwen/Qwen3-32B"},
            "llama3": {"8B": "meta-llama/Llama-3.1-8B"}, "qwen3": {"32B": "Qwen/Qwen3-32B"}}
"""The Hugging Face repositories of the recipes' models, for the download command in messages."""

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
"""The tokenizer files TorchTitan parses as JSON."""
MAX_FILES_READ = 64
"""Data files whose first records are read before launch (the others: their size only)."""


def download_hint(model_name: str, flavor: str, folder: str) -> str:
    repo = HF_REPOS.get(model_name, {}).get(flavor, "<org>/<model>")
    return (f"hf download {repo} --local-dir {folder} --include 'tokenizer*' 'config.json' "
            "'*.safetensors' 'model.safetensors.index.json'")


def _not_json(folder: str) -> tuple[str, json.JSONDecodeError | UnicodeDecodeError] | None:
    """The first tokenizer file in ``folder`` that is not JSON, with its error."""
    for name in TOKENIZER_JSON_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                return path, err
    return None


def load_tokenizer(folder: str, hint: str):
    """TorchTitan's ``HuggingFaceTokenizer`` of ``folder`` (0.2.2 and 0.3 both take ``tokenizer_path``), or a
    ConfigError naming the file that fails and ``hint``, the download command."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    try:
        return HuggingFaceTokenizer(tokenizer_path=folder)
    except Exception as err:  # tokenizers' and json's errors alike: the job could not start
        broken = _not_json(folder)
        if broken is not None:
            path, why = broken
            where = f"line {why.lineno} column {why.colno}: {why.msg}" if isinstance(why, json.JSONDecodeError) \
                else f"not UTF-8: {why.reason}"
            raise ConfigError(f"{path} is not JSON ({where}): download the tokenizer again ({hint})") from None
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"the tokenizer in {folder} cannot be loaded ({type(err).__name__}: {reason}): download "
                          f"it again ({hint})") from None


def check_document_eos(tokenizer, folder: str, flavor: str, hint: str) -> None:
    """A flavor that packs documents ends each at the tokenizer's EOS token: a tokenizer without one (its
    config names no ``eos_token``) would stop the trainer at its first batch."""
    if getattr(tokenizer, "eos_id", None) is None:
        raise ConfigError(
            f"model.flavor = {flavor!r} (attn_mask_type 'block_causal') ends a packed document at each EOS token, but "
            f"the tokenizer in model.hf_assets_path = {folder!r} has none (no eos_token in tokenizer_config.json): use "
            f"the model's own tokenizer ({hint}), or a causal flavor")


def check_tokenizer(dataset: str, folder: str, *, model_name: str, flavor: str, documents: bool,
                    vocab_size: int | None) -> None:
    """The tokenizer a job on ``dataset`` reads from ``folder`` (``model.hf_assets_path``): present and
    loadable, with an EOS where the flavor packs ``documents``, no more tokens than the model embeds
    (``vocab_size``; None: unknown here, not checked)."""
    if dataset in SYNTHETIC_DATASETS:
        return
    hint = download_hint(model_name, flavor, folder)
    present = os.path.isdir(folder) and any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES)
    if not present:
        state = "has no tokenizer.json" if os.path.isdir(folder) else "does not exist"
        raise ConfigError(
            f"model.hf_assets_path = {folder!r} {state}: training.dataset = {dataset!r} is "
            f"tokenized with the Hugging Face tokenizer there. Download it ({hint}), "
            f"or point model.hf_assets_path at the folder holding tokenizer.json")
    tokenizer = load_tokenizer(folder, hint)
    if documents:
        check_document_eos(tokenizer, folder, flavor, hint)
    tokens = tokenizer.get_vocab_size()
    if vocab_size and tokens > vocab_size:
        raise ConfigError(
            f"the tokenizer in model.hf_assets_path = {folder!r} has {tokens} tokens but {model_name} / {flavor} embeds "
            f"{vocab_size} (vocab_size), so ids from {vocab_size} on would index past the embedding: use this model's "
            f"tokenizer ({hint}) or a flavor with vocab_size >= {tokens}")


def _file_size(path: str, setting: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError as err:
        raise ConfigError(f"{path} cannot be read ({err.strerror or err}): fix it or remove it from {setting}") from None


def _check_files(files: list[str], local: LocalData, setting: str) -> None:
    """The first records of the first ``MAX_FILES_READ`` files (and of every empty one), and one
    document among them."""
    read = [path for index, path in enumerate(files) if index < MAX_FILES_READ or _file_size(path, setting) == 0]
    holds = [check_first_records(path, local.text_key, local.skip_bad_records, setting) for path in read]
    if len(read) == len(files):  # (files beyond the first MAX_FILES_READ may hold the documents)
        check_some_document(read, holds, setting)


def check_dataset(dataset: str, local: LocalData, validation_dataset: str | None = None,
                  validation_path: str | None = None) -> None:
    """The files of a ``local_text`` job (``local``: its ``[local_data]``), and of its ``local_text`` validation
    (``validation_dataset``: None where validation is off)."""
    if dataset == LOCAL_TEXT_DATASET:
        if not local.paths:
            raise ConfigError('training.dataset = "local_text" needs local_data.paths: glob patterns of '
                              '.jsonl/.parquet/.txt files, e.g. paths = ["/data/books/*.jsonl"]')
        _check_files(expand_paths(local.paths), local, "local_data.paths")
    if validation_dataset == LOCAL_TEXT_DATASET and validation_path:
        _check_files(expand_paths([validation_path], "validation.dataset_path"), local, "validation.dataset_path")
