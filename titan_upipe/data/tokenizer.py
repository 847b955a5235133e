"""The embedded tokenizer: a word-level vocabulary built with ``tokenizers`` at first use.

It needs no download. The vocabulary is fixed by code (special tokens, then
``w0000``…), so every process and every machine builds the same file; it is
written once per user into a cache directory (atomically, so concurrent ranks
are safe) and loaded through TorchTitan's own ``HuggingFaceTokenizer``, the
class the real-data path uses.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SEP_TOKEN = "<|sep|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, SEP_TOKEN, UNK_TOKEN)

VOCAB_SIZE = 512
"""Total ids, special tokens included; the debug flavors' ``vocab_size`` equals it."""

NUM_WORDS = VOCAB_SIZE - len(SPECIAL_TOKENS)
WORD_OFFSET = len(SPECIAL_TOKENS)
BOS_ID, EOS_ID, SEP_ID, UNK_ID = range(len(SPECIAL_TOKENS))


def word(index: int) -> str:
    return f"w{index:04d}"


def vocabulary() -> dict[str, int]:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({word(i): WORD_OFFSET + i for i in range(NUM_WORDS)})
    return vocab


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    tokenizer = Tokenizer(WordLevel(vocab=vocabulary(), unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return tokenizer.to_str()


def _tokenizer_config() -> dict[str, object]:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "sep_token": SEP_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 1 << 30,
    }


def _cache_root() -> Path:
    base = os.environ.get("TITAN_UPIPE_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return Path(base) if base else Path.home() / ".cache" / "titan_upipe"


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def embedded_tokenizer_dir() -> str:
    """Directory holding ``tokenizer.json`` and ``tokenizer_config.json``; built on first use."""
    files = {
        "tokenizer.json": _tokenizer_json(),
        "tokenizer_config.json": json.dumps(_tokenizer_config(), indent=2),
    }
    digest = hashlib.sha256("".join(files.values()).encode()).hexdigest()[:12]
    directory = _cache_root() / f"tokenizer-{digest}"
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        if not (directory / name).exists():
            _write_atomically(directory / name, text)
    return str(directory)


if __name__ == "__main__":
    print(embedded_tokenizer_dir())
