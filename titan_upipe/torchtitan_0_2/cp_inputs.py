"""TorchTitan's side of CP input preparation: the batch's documents read off the model args and
tokenizer, the ``post_dataloading_process`` tuple in the layout of the launch's CP mesh
(``launched_job``; the preparation itself: ``titan_upipe.parallel.inputs.prepare_cp_batch``), and
the global valid-token count over TorchTitan's batch mesh.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils

from titan_upipe.costs.document_balance import ring_work_ratios, split_threshold
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.document_layout import document_lengths
from titan_upipe.parallel.document_mask import DocumentMask
from titan_upipe.parallel.inputs import prepare_cp_batch
from titan_upipe.spec.job_spec import JobSpec
from titan_upipe.spec.settings import DEFAULT_MIN_SPLIT

MASK_TYPES = ("causal", "block_causal")
"""The ``attn_mask_type`` values the converted attention runs (TorchTitan's Llama3/Qwen3 ones)."""


def document_eos_id(model_args, tokenizer) -> int | None:
    """The token that ends a packed document: the tokenizer's EOS with the model args'
    ``attn_mask_type = "block_causal"``; None for ``causal`` (one sequence per row)."""
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
    return eos_id


def shard_batch(input_dict: dict[str, torch.Tensor], labels: torch.Tensor, cp_mesh: DeviceMesh, spec: JobSpec,
                eos_id: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
    """``(tokens [B, S/C], labels [B, S/C], extra inputs, {"positions": [S/C] or [B, S/C], ...})`` of
    this CP rank (``prepare_cp_batch``) in the layout of ``cp_mesh`` and the job's document balance
    (``spec.document_balance``, ``spec.document_min_split``): the trainer's ``post_dataloading_process``
    contract."""
    batch = prepare_cp_batch(input_dict["input"], labels, cp_mesh, eos_id=eos_id, ignore_index=IGNORE_INDEX,
                             document_balance=spec.document_balance, document_min_split=spec.document_min_split)
    extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
    return batch.tokens, batch.labels, extra_inputs, batch.model_kwargs()


def global_valid_tokens(batch_valid: torch.Tensor, batch_mesh: DeviceMesh | None):
    """``Σ_d N_d``: the valid tokens of every data-parallel batch, each counted whole (before CP
    sharding; every CP rank of a batch holds the same count) and summed over the batch mesh."""
    return batch_valid.float() if batch_mesh is None else dist_utils.dist_sum(batch_valid, batch_mesh)


def document_layout_text(spec: JobSpec) -> str:
    """How packed documents are laid out over the job's ring (``spec.layout.ring_degree`` ranks, the
    ``[upipe]`` document balance): the trainer logs it once, ``validate`` prints it in its summary."""
    ring_size = spec.layout.ring_degree
    if spec.document_balance == "documents":
        threshold = split_threshold(spec.seq_len, ring_size, spec.document_min_split)
        return (f"each batch in its own layout over the ring of {ring_size} (upipe.document_balance = "
                f"\"documents\": documents of {threshold} tokens or more zigzagged inside themselves, shorter ones "
                "dealt whole)")
    return (f"the fixed zigzag over the ring of {ring_size} (upipe.document_balance = \"zigzag\"; "
            "data/ring_work_busiest_over_mean_documents shows what the document-aware layout would balance)")


RING_WORK_TAGS = ("data/ring_work_busiest_over_mean_zigzag", "data/ring_work_busiest_over_mean_documents")
"""The batch's busiest / mean ring-rank attention work under each ``[upipe] document_balance`` layout,
the fixed zigzag and the batch's document-aware one (``parallel.DocumentZigzagLayout``), logged
whichever the job runs: the one it runs is what its ring steps cost, the other what the switch would
change."""


def batch_ring_work(tokens: torch.Tensor, eos_id: int, ring_size: int,
                    min_split: int = DEFAULT_MIN_SPLIT) -> dict[str, float]:
    """``RING_WORK_TAGS`` of the global batch ``tokens [B, S]``, its documents split at each EOS as
    the mask is (``DocumentMask.from_eos``): closed-form visible pairs per ring rank."""
    ids = DocumentMask.from_eos(tokens.cpu(), eos_id).doc
    rows = [document_lengths(row) for row in ids]
    return dict(zip(RING_WORK_TAGS, ring_work_ratios(rows, ring_size, min_split), strict=True))
