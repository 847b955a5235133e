"""A batch sharded in the converted attention's sequence layout (training and validation alike).

Every CP rank of a data-parallel group reads the same ``[B, S]`` batch. Rank ``c`` keeps the
``S / C`` tokens that ``titan_upipe.parallel``'s layout gives it (contiguous for Ulysses/UPipe
on the 1-D CP mesh; zigzag over ring x contiguous over Ulysses for ring, USP and UPipe inside
USP) and their global positions, which the attention checks on every forward
(``converters._LayoutCheck``) and RoPE reads. TorchTitan shards head-tail for its own ring
attention; our all-to-alls would join those shards in the wrong order.

Packed documents: with the model args' ``attn_mask_type = "block_causal"`` the converted
attention gets ``attention_masks``, a :class:`~titan_upipe.attention.documents.DocumentMask`
built from the *global* ``[B, S]`` tokens (a document ends at each EOS token, TorchTitan's
rule), whatever the ``attn_type``: the attention reads global positions, so every rank holds
the mask of the whole batch and the sequence shards carry no document boundaries of their own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.distributed import utils as dist_utils

from titan_upipe.attention import sequence_mesh
from titan_upipe.attention.documents import DocumentMask
from titan_upipe.errors import ConfigError
from titan_upipe.parallel import shard_sequence
from titan_upipe.parallel.cp_layout import CP_MODES


def model_sequence_mesh(model_parts: list[nn.Module]) -> DeviceMesh:
    """The mesh of the converted attention (validation refused CP > 1 without a converter)."""
    for part in model_parts:
        mesh = sequence_mesh(part)
        if mesh is not None:
            return mesh
    raise ConfigError("parallelism.context_parallel_degree > 1 but no attention was converted: "
                      f"add one of {', '.join(CP_MODES)} to model.converters")


MASK_TYPES = ("causal", "block_causal")
"""The ``attn_mask_type`` values the converted attention runs (TorchTitan's Llama3/Qwen3 ones)."""


def document_attention_masks(tokens: torch.Tensor, model_args, tokenizer) -> DocumentMask | None:
    """The converted attention's ``attention_masks`` for the global batch ``tokens [B, S]``: with
    ``model_args.attn_mask_type = "block_causal"`` the documents that end at each of the
    tokenizer's EOS tokens, else None (causal)."""
    mask_type = getattr(model_args, "attn_mask_type", "causal")
    if mask_type not in MASK_TYPES:
        raise ConfigError(f"attn_mask_type = {mask_type!r} is not run by the context-parallel attention: "
                          f"valid values are {', '.join(MASK_TYPES)}; pick a model.flavor with one of them")
    if mask_type == "causal":
        return None
    eos_id = getattr(tokenizer, "eos_id", None)
    if eos_id is None:
        raise ConfigError("attn_mask_type = 'block_causal' ends a document at each EOS token, but the tokenizer "
                          "has no EOS: give model.hf_assets_path a tokenizer whose config names an eos_token")
    return DocumentMask.from_eos(tokens, eos_id)


def shard_batch(input_dict: dict[str, torch.Tensor], labels: torch.Tensor, cp_mesh: DeviceMesh,
                attention_masks: DocumentMask | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
    """``(tokens [B, S/C], labels [B, S/C], extra inputs, {"positions": [S/C]})`` of this CP rank:
    the trainer's ``post_dataloading_process`` contract; ``attention_masks`` (the whole batch's,
    :func:`document_attention_masks`) joins the keyword arguments when given."""
    inputs, positions = shard_sequence(input_dict["input"], cp_mesh, seq_dim=1)
    labels, _ = shard_sequence(labels, cp_mesh, seq_dim=1)
    extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
    extra_kwargs: dict[str, Any] = {"positions": positions}
    if attention_masks is not None:
        extra_kwargs["attention_masks"] = attention_masks
    return inputs, labels, extra_inputs, extra_kwargs


def global_valid_tokens(batch_valid: torch.Tensor, batch_mesh: DeviceMesh | None):
    """``Σ_d N_d``: the valid tokens of every data-parallel batch, each counted whole (before CP
    sharding; every CP rank of a batch holds the same count) and summed over the batch mesh."""
    return batch_valid.float() if batch_mesh is None else dist_utils.dist_sum(batch_valid, batch_mesh)


# --------------------------------------------- packed batches of the tools (check, emulator)


def packed_document_tokens(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``tokens [B, S]`` (none equal to ``eos_id``) with EOS at positions ``0`` (a 1-token
    document), ``S/3 + b`` and ``S/3 + b + 1`` (another 1-token document) and ``2S/3 + 1 - b``
    for row ``b``: documents that cross the CP shard boundaries, split differently per row."""
    packed = tokens.clone()
    seq = tokens.shape[1]
    for row in range(tokens.shape[0]):
        for position in (0, seq // 3 + row, seq // 3 + row + 1, 2 * seq // 3 + 1 - row):
            packed[row, min(max(position, 0), seq - 1)] = eos_id
    return packed


def document_runs(inputs: torch.Tensor, eos_id: int) -> list[list[tuple[int, int]]]:
    """Per row, the ``[start, stop)`` runs of each document: a document ends at its EOS token."""
    runs = []
    for row in inputs.tolist():
        stops = [i + 1 for i, token in enumerate(row) if token == eos_id]
        stops = [s for s in stops if s < len(row)] + [len(row)]
        runs.append(list(zip([0, *stops[:-1]], stops, strict=True)))
    return runs
