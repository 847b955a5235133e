"""The validation loss under CP on TorchTitan 0.3 (``[validation]``): 0.3's ``Validator`` with the batches
sharded in the CP attention's layout (``cp_inputs.shard_for_attention``) and its own sizes.

0.3's validator sums the loss over its steps and divides by the global valid-token count (counted
before CP sharding, summed over the batch mesh): the single-device mean. It builds its loader from
``validator.dataloader`` at every evaluation, so every point of the curve scores the same held-out
samples (the plugin's loader with ``VALIDATION_SEED``). 0.3 gives a validator the training's sequence
length and batch; ``validation.seq_len`` and ``validation.local_batch_size`` replace them here.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.components.validate import Validator

from titan_upipe.torchtitan_0_3.cp_inputs import shard_for_attention


class LayoutValidator(Validator):
    """0.3's ``Validator`` on the launch's CP layout (``launch`` is set by the trainer once it exists)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        validation_seq_len: int = 0
        """``validation.seq_len`` (0: the training's; not ``seq_len``: 0.3 passes that as a build argument)."""
        validation_local_batch_size: int = 0
        """``validation.local_batch_size`` (0: the training's)."""

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.seq_len = config.validation_seq_len or self.seq_len
        self.local_batch_size = config.validation_local_batch_size or self.local_batch_size
        self.launch = None

    def post_dataloading_process(self, input_dict, labels, model_parts):
        if self.launch is None or self.launch.cp_mesh is None:
            return super().post_dataloading_process(input_dict, labels, model_parts)
        return shard_for_attention(input_dict, labels, self.launch)
