"""A tiny corpus (JSONL, Parquet, plain text) and a BPE tokenizer trained on it, written on the fly."""

from __future__ import annotations

import json
import random
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TOKENIZER_VOCAB = 400
"""Under the debug flavors' vocabulary of 512."""

WORDS = ("the cat sat on a mat while every dog ran past quick brown foxes jumping over lazy rivers "
         "under seven bright stars and one pale moon").split()


def documents(count: int, seed: int, min_words: int = 3, max_words: int = 120) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(count)]


TEXT_JOB_SEQ = 128
TEXT_JOB_STEPS = 4


def text_job_overrides(assets: Path) -> tuple[str, ...]:
    """A debug config turned into a recipe-like job: local text, HF weights, full checkpoints every 2 steps."""
    return ("--training.dataset", "local_text", "--local_data.paths", str(assets / "data" / "*"),
            "--model.hf_assets_path", str(assets / "hf"), "--training.seq_len", str(TEXT_JOB_SEQ),
            "--training.steps", str(TEXT_JOB_STEPS), "--checkpoint.enable", "--checkpoint.interval", "2",
            "--checkpoint.no_last_save_model_only", "--checkpoint.initial_load_in_hf",
            *text_validation_overrides(assets))


TEXT_VALIDATION_FILE = "d.jsonl"
TEXT_VALIDATION_BATCH = 2


def text_validation_overrides(assets: Path) -> tuple[str, ...]:
    """One validation batch of the file ``TEXT_VALIDATION_FILE`` after steps 2 and 4."""
    return ("--validation.enable", "--validation.dataset", "local_text", "--validation.dataset_path",
            str(assets / "data" / TEXT_VALIDATION_FILE), "--validation.seq_len", str(TEXT_JOB_SEQ),
            "--validation.local_batch_size", str(TEXT_VALIDATION_BATCH), "--validation.steps", "1",
            "--validation.freq", "2")


def write_corpus(folder: Path) -> dict[str, list[str]]:
    """Files of every supported type; returns each file's documents (in file order)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    files = {"a.jsonl": documents(40, 1), "b.parquet": documents(30, 2), "c.txt": documents(1, 3, 400, 600),
             "d.jsonl": documents(25, 4)}
    for name, docs in files.items():
        path = folder / name
        if name.endswith(".jsonl"):
            lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)]
            lines.insert(3, "")  # a blank line is not a document
            path.write_text("\n".join(lines) + "\n")
        elif name.endswith(".parquet"):
            pq.write_table(pa.table({"text": docs}), path, row_group_size=7)
        else:
            path.write_text(docs[0])
    return {str((folder / name).resolve()): docs for name, docs in files.items()}


def write_tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer trained on the corpus words, with Llama-3-style BOS/EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(documents(200, 0), trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return folder


def hf_model(model_name: str = "upipe_llama3", flavor: str = "debug", seed: int = 0):
    """A TorchTitan model of the flavor with seeded weights, and its train spec's HF adapter."""
    import copy

    import torch
    from torchtitan.protocols.train_spec import get_train_spec

    from titan_upipe.torchtitan_0_2.flavors import model_flavors

    args = copy.deepcopy(model_flavors(model_name)[flavor])
    spec = get_train_spec(model_name)
    torch.manual_seed(seed)
    model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights()
    return model, spec.state_dict_adapter(args, None)


def write_hf_weights(folder: Path, model_name: str = "upipe_llama3", flavor: str = "debug", seed: int = 0):
    """The seeded model's weights as a Hugging Face ``model.safetensors`` in ``folder``; returns the model."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    model, adapter = hf_model(model_name, flavor, seed)
    hf = {k: v.contiguous() for k, v in adapter.to_hf(model.state_dict()).items()}
    save_file(hf, str(folder / "model.safetensors"))
    return model
