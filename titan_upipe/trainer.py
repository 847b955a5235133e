"""TorchTitan's ``Trainer`` with one change: how context-parallel inputs are sharded.

Under CP, TorchTitan shards tokens, labels and positions head-tail for its ring
attention. Ulysses/UPipe expect ``titan_upipe.parallel``'s layout (contiguous on a
1-D CP mesh), so tokens, labels and their global positions are sharded with
``shard_sequence``. Token counts for the loss are taken before sharding, by the
unchanged trainer, so the loss summed over CP ranks is the single-device mean.
"""

from __future__ import annotations

from typing import Any

import torch
from torchtitan.train import Trainer

from titan_upipe.parallel import shard_sequence


class ContextParallelTrainer(Trainer):
    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        if not self.parallel_dims.cp_enabled:
            return super().post_dataloading_process(input_dict, labels)
        cp_mesh = self.parallel_dims.get_mesh("cp")
        inputs, positions = shard_sequence(input_dict["input"], cp_mesh, seq_dim=1)
        labels, _ = shard_sequence(labels, cp_mesh, seq_dim=1)
        extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
        return inputs, labels, extra_inputs, {"positions": positions}
