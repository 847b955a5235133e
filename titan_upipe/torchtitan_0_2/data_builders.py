"""The train specs' data builders: which tokenizer and which loader ``training.dataset`` names.

=================== ================================ ==========================================
``dataset``         tokenizer                        loader
=================== ================================ ==========================================
``synthetic_copy``  embedded (no files)              :class:`~titan_upipe.torchtitan_0_2.data_loader.GlobalBatchLoader`
``synthetic_docs``  embedded (no files)              :class:`~titan_upipe.torchtitan_0_2.data_loader.GlobalBatchLoader`
``local_text``      HF, ``model.hf_assets_path``     :class:`~titan_upipe.torchtitan_0_2.data_loader.GlobalBatchLoader`
anything else       HF, ``model.hf_assets_path``     TorchTitan's text pipeline (HF hub datasets)
=================== ================================ ==========================================

The plugin datasets checkpoint one global cursor, so a run resumes under another
data-parallel or CP degree (``titan_upipe.torchtitan_0_2.data_loader``); TorchTitan's pipeline does not.

Validation (``[validation]``) reads ``validation.dataset``: the synthetic datasets draw held-out
samples (another seed), ``local_text`` packs the files of the glob ``validation.dataset_path``;
all start from their first sample at every evaluation, so every point of the validation curve
scores the same tokens. Other names go to TorchTitan's validation pipeline.
"""

from __future__ import annotations

from functools import partial

from titan_upipe.data.local_text import LOCAL_TEXT_DATASET, LocalTextStream, expand_paths
from titan_upipe.data.packing import Cursor
from titan_upipe.data.synthetic import SAMPLES, SYNTHETIC_DATASETS, VALIDATION_SEED, SyntheticCopyStream
from titan_upipe.torchtitan_0_2.data_loader import GlobalBatchLoader
from titan_upipe.torchtitan_0_2.datasets import build_embedded_tokenizer

PLUGIN_DATASETS = (*SYNTHETIC_DATASETS, LOCAL_TEXT_DATASET)

STREAM_STATE_KEYS: dict[str, tuple[str, ...]] = {
    **{name: tuple(SyntheticCopyStream(1).state_dict()) for name in SYNTHETIC_DATASETS},
    LOCAL_TEXT_DATASET: (*Cursor().as_dict(), "file_path"),
}
"""The data cursor each plugin dataset's stream checkpoints (``SampleStream.state_dict``'s keys)."""


def loader_state_keys(dataset: str) -> frozenset[str]:
    """What a checkpoint holds under ``dataloader`` for the plugin dataset ``dataset``, as DCP flattens
    it (``stream.index``): the loader's global cursor and its stream's. DCP loads a checkpoint into
    the job's own state, so a job resumes only from a checkpoint holding every one of them."""
    own = [key for key in GlobalBatchLoader(SyntheticCopyStream(1), 1, 0, 1).state_dict() if key != "stream"]
    return frozenset({*own, *(f"stream.{key}" for key in STREAM_STATE_KEYS[dataset])})


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, infinite: bool = True):
    training = job_config.training
    if training.dataset not in PLUGIN_DATASETS:
        from torchtitan.hf_datasets.text_datasets import build_text_dataloader

        return build_text_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite)
    if training.dataset == LOCAL_TEXT_DATASET:
        local = job_config.local_data
        stream = LocalTextStream(expand_paths(local.paths), partial(tokenizer.encode, add_bos=True, add_eos=True),
                                 training.seq_len, local.text_key, skip_bad_records=local.skip_bad_records)
    else:
        stream = SyntheticCopyStream(training.seq_len, sample=SAMPLES[training.dataset])
    return GlobalBatchLoader(stream, training.local_batch_size, dp_rank, dp_world_size)


def build_validation_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config):
    """A loader of ``validation.local_batch_size`` x ``validation.seq_len`` batches from the start
    of ``validation.dataset`` (plugin datasets: a new one per evaluation, infinite)."""
    validation = job_config.validation
    if validation.dataset not in PLUGIN_DATASETS:
        from torchtitan.hf_datasets.text_datasets import build_text_validation_dataloader

        return build_text_validation_dataloader(job_config=job_config, dp_world_size=dp_world_size, dp_rank=dp_rank,
                                                 tokenizer=tokenizer, infinite=validation.steps != -1)
    if validation.dataset == LOCAL_TEXT_DATASET:
        stream = LocalTextStream(expand_paths([validation.dataset_path], "validation.dataset_path"),
                                 partial(tokenizer.encode, add_bos=True, add_eos=True), validation.seq_len,
                                 job_config.local_data.text_key,
                                 skip_bad_records=job_config.local_data.skip_bad_records)
    else:
        stream = SyntheticCopyStream(validation.seq_len, seed=VALIDATION_SEED, sample=SAMPLES[validation.dataset])
    return GlobalBatchLoader(stream, validation.local_batch_size, dp_rank, dp_world_size)


def build_tokenizer(job_config):
    """The synthetic datasets bring their own vocabulary; real data uses ``model.hf_assets_path``."""
    from torchtitan.components.tokenizer import build_hf_tokenizer

    if job_config.training.dataset in SYNTHETIC_DATASETS:
        return build_embedded_tokenizer()
    return build_hf_tokenizer(job_config)
