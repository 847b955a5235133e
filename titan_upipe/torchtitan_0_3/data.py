"""The plugin's datasets on TorchTitan 0.3: one global stream split by data-parallel rank
(``titan_upipe.data.global_batch``) as 0.3's dataloader configurable.

================== =============================================================================
``dataset``        stream
================== =============================================================================
``synthetic_copy`` ``SyntheticCopyStream`` (the embedded tokenizer's ids: no files)
``synthetic_docs`` the same, packed documents (each ends with EOS)
``local_text``     ``LocalTextStream``: the ``[local_data]`` files, packed with BOS/EOS by the
                   tokenizer of ``model.hf_assets_path`` (0.3's ``HuggingFaceTokenizer``)
================== =============================================================================

The trainer builds a loader with ``dp_world_size``, ``dp_rank``, ``seq_len`` and
``local_batch_size``; the checkpoint holds the one global cursor (the same keys as on 0.2), so a
job resumes under another data-parallel or CP layout. The batches carry no ``positions``: the
converted attention derives each shard's positions from the layout (and from the documents'
EOS tokens where the flavor packs documents), as on 0.2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from torchtitan.components.dataloader import BaseDataLoader

from titan_upipe.data.global_batch import GlobalBatches
from titan_upipe.data.local_text import LOCAL_TEXT_DATASET, LocalTextStream, expand_paths
from titan_upipe.data.synthetic import SAMPLES, SYNTHETIC_DATASETS, SyntheticCopyStream
from titan_upipe.errors import ConfigError, with_suggestion

DATASETS = (*SYNTHETIC_DATASETS, LOCAL_TEXT_DATASET)
"""The ``training.dataset`` values the plugin reads on TorchTitan 0.3 (0.2.2 also reads TorchTitan's HF ones)."""


def check_dataset(name: str, key: str = "training.dataset") -> str:
    if name not in DATASETS:
        raise ConfigError(with_suggestion(f"{key} = {name!r} is not read by titan_upipe on TorchTitan 0.3 "
                                          f"yet: valid values are {', '.join(DATASETS)} (TorchTitan 0.2.2 reads "
                                          "the HF datasets too)", name, DATASETS))
    return name


class GlobalBatchDataLoader(GlobalBatches, BaseDataLoader):
    """This data-parallel rank's ``({"input": [B, S]}, labels [B, S])`` batches of one global stream."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "synthetic_copy"
        paths: list[str] = field(default_factory=list)
        """``local_data.paths`` (``local_text``)."""
        text_key: str = "text"
        skip_bad_records: bool = False
        seed: int | None = None
        """The synthetic stream's seed (None: the training one; validation: ``VALIDATION_SEED``)."""
        infinite: bool = True
        """Set by 0.3's validator; the plugin's streams repeat (the validation steps bound an evaluation)."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int, local_batch_size: int,
                 tokenizer=None, snapshot_every_n_steps: int | None = None) -> None:
        del snapshot_every_n_steps  # the checkpoint holds one small cursor
        if check_dataset(config.dataset) == LOCAL_TEXT_DATASET:
            stream = LocalTextStream(expand_paths(config.paths), partial(tokenizer.encode, add_bos=True, add_eos=True),
                                     seq_len, config.text_key, skip_bad_records=config.skip_bad_records)
        else:
            sample = SAMPLES[config.dataset]
            stream = (SyntheticCopyStream(seq_len, sample=sample) if config.seed is None else
                      SyntheticCopyStream(seq_len, seed=config.seed, sample=sample))
        GlobalBatches.__init__(self, stream, local_batch_size, dp_rank, dp_world_size)
