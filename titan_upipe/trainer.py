"""TorchTitan's ``Trainer`` with two changes: how context-parallel inputs are sharded, and the
loader's document-length statistics passed to the metrics (``data/…`` tags).

Under CP, TorchTitan shards tokens, labels and positions head-tail for its ring
attention. Our attention expects ``titan_upipe.parallel``'s layout (contiguous for
Ulysses/UPipe on the 1-D CP mesh; zigzag over ring x contiguous over Ulysses for ring, USP
and UPipe inside USP), so tokens, labels and their global positions are sharded with
``shard_sequence`` on the mesh the converter derived (read back from the converted
attention). Token counts for the loss are taken before sharding, by the unchanged trainer, so the loss summed over CP ranks is the single-device mean.
"""

from __future__ import annotations

from typing import Any

import torch
from torchtitan.train import Trainer

from titan_upipe.attention import sequence_mesh
from titan_upipe.errors import ConfigError
from titan_upipe.parallel import shard_sequence
from titan_upipe.parallel.cp_layout import CP_MODES


class ContextParallelTrainer(Trainer):
    def __init__(self, job_config) -> None:
        super().__init__(job_config)
        # Document lengths of a packed corpus go to TensorBoard with the other metrics.
        take_stats = getattr(self.dataloader, "take_document_stats", None)
        if take_stats is not None and hasattr(self.metrics_processor, "document_stats"):
            self.metrics_processor.document_stats = take_stats

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        if not self.parallel_dims.cp_enabled:
            return super().post_dataloading_process(input_dict, labels)
        cp_mesh = self._sequence_mesh()
        inputs, positions = shard_sequence(input_dict["input"], cp_mesh, seq_dim=1)
        labels, _ = shard_sequence(labels, cp_mesh, seq_dim=1)
        extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
        return inputs, labels, extra_inputs, {"positions": positions}

    def _sequence_mesh(self):
        """The mesh of the converted attention (validation refused CP > 1 without a converter)."""
        if getattr(self, "_cp_sequence_mesh", None) is None:
            meshes = [sequence_mesh(part) for part in self.model_parts]
            self._cp_sequence_mesh = next((m for m in meshes if m is not None), None)
            if self._cp_sequence_mesh is None:
                raise ConfigError("parallelism.context_parallel_degree > 1 but no attention was converted: "
                                  f"add one of {', '.join(CP_MODES)} to model.converters")
        return self._cp_sequence_mesh
