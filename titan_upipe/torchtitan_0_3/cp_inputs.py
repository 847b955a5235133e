"""A batch's CP inputs on TorchTitan 0.3: tokens, labels and their global positions sharded in the layout
of the launch's CP attention (``parallel.inputs.prepare_cp_batch``: contiguous for Ulysses/UPipe, zigzag
over a ring), not 0.3's head-tail one. The trainer and the validator both shard with it."""

from __future__ import annotations

from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX

from titan_upipe.errors import ConfigError
from titan_upipe.parallel.inputs import prepare_cp_batch


def shard_for_attention(input_dict: dict[str, torch.Tensor], labels: torch.Tensor, launch
                        ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """0.3's ``post_dataloading_process`` triple ``(tokens [B, S/C], labels [B, S/C], {positions [B, S/C],
    attention_masks (packed documents), ...})`` of this rank for ``launch`` (``job.Launch``: its CP mesh,
    the EOS that ends a packed document, the document settings)."""
    extra = {key: value for key, value in input_dict.items() if key != "input"}
    spec = launch.spec
    batch = prepare_cp_batch(input_dict["input"], labels, launch.cp_mesh, eos_id=launch.eos_id,
                             ignore_index=IGNORE_INDEX,
                             document_balance=spec.document_balance, document_min_split=spec.document_min_split)
    model_kwargs = batch.model_kwargs()
    if model_kwargs["positions"].dim() == 1:
        # 0.3 hands ``positions`` to the loss too, whose chunked form splits every input along dim 1
        model_kwargs["positions"] = model_kwargs["positions"].expand(batch.tokens.shape[0], -1)
    return batch.tokens, batch.labels, {**extra, **model_kwargs}


def document_eos_id(tokenizer) -> int:
    """The tokenizer's EOS, which ends a packed document (ConfigError where it has none)."""
    eos_id = getattr(tokenizer, "eos_id", None)
    if eos_id is None:
        raise ConfigError("the flavor packs documents, each ending at the tokenizer's EOS, but the tokenizer has none: "
                          "give model.hf_assets_path a tokenizer whose config names an eos_token")
    return eos_id
