"""The plugin's data loader on TorchTitan 0.2.2: the core's global-batch split
(``titan_upipe.data.global_batch``) as a TorchTitan ``BaseDataLoader``."""

from __future__ import annotations

from torchtitan.components.dataloader import BaseDataLoader

from titan_upipe.data.global_batch import GlobalBatches, SampleStream

__all__ = ["GlobalBatchLoader", "SampleStream"]


class GlobalBatchLoader(GlobalBatches, BaseDataLoader):
    """This data-parallel rank's batches from one global stream (``GlobalBatches``)."""
