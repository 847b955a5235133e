"""The plugin's datasets and tokenizer as TorchTitan 0.2.2 reads them: ``synthetic_copy`` in its
``DATASETS`` registry (``register_with_torchtitan``, called by ``registry.register_plugin``) and the
embedded tokenizer as its ``HuggingFaceTokenizer``. The documents and the tokenizer files themselves
are ``titan_upipe.data``'s (no TorchTitan there)."""

from __future__ import annotations

from datasets import IterableDataset as HFIterableDataset
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

from titan_upipe.data.synthetic import copy_text
from titan_upipe.data.tokenizer import embedded_tokenizer_dir


def _load_copy_documents(path: str):
    """Loader for TorchTitan's ``DATASETS`` registry: a lazy stream of text documents."""
    del path

    def documents():
        index = 0
        while True:
            yield {"text": copy_text(index)}
            index += 1

    return HFIterableDataset.from_generator(documents)


def register_with_torchtitan() -> None:
    """Make ``training.dataset = "synthetic_copy"`` valid for any TorchTitan train spec."""
    DATASETS.setdefault(
        "synthetic_copy",
        DatasetConfig(path="synthetic_copy", loader=_load_copy_documents, sample_processor=lambda s: s["text"]),
    )


def build_embedded_tokenizer():
    return HuggingFaceTokenizer(embedded_tokenizer_dir())
