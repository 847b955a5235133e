"""TorchTitan's own block-causal attention, runnable on CPU: the 1-rank reference of the
packed-document trainer runs (``--experimental.custom_import tests.flex_reference``).

A flavor with ``attn_type = "flex"`` and ``attn_mask_type = "block_causal"`` makes TorchTitan's
trainer build a ``BlockMask`` from each batch (its ``get_document_mask_mod``: a document ends at
each EOS) and run its compiled ``flex_attention``, which has no CPU backward in torch 2.13
("FlexAttention does not support backward on CPU"); building the mask compiled takes ~40 s on
this box. This module keeps TorchTitan's mask and swaps only how it is computed:

* the mask is built by ``create_block_mask`` eagerly (same ``mask_mod``, no compile);
* the kernel is the mask's ``mask_mod`` materialized as a dense boolean ``[B, 1, S, S]`` mask
  (``create_mask``) and passed to ``F.scaled_dot_product_attention``.

Nothing of titan_upipe's attention runs (no ``DocumentMask``, no converter): a reference
independent of the code under test. It then registers the plugin, as ``titan_upipe.plugin``
(the configs' ``custom_import``) does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, create_mask
from torchtitan.models import attention as titan_attention
from torchtitan.models.llama3.model import model as llama3_model
from torchtitan.models.qwen3.model import model as qwen3_model

import titan_upipe.plugin  # noqa: F401  (registers the plugin, as the configs' custom_import does)


def dense_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_mask, scale=None,
                         enable_gqa: bool = False, return_lse: bool = False) -> torch.Tensor:
    """``flex_attention(q, k, v, block_mask=...)`` with the mask materialized token by token."""
    if return_lse:
        raise NotImplementedError("the dense flex reference returns no LSE")
    visible = create_mask(block_mask.mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=enable_gqa)


def eager_block_mask(mask_mod, batch, heads, q_len, kv_len):
    """TorchTitan's ``create_attention_mask`` without ``torch.compile``."""
    return create_block_mask(mask_mod, batch, heads, q_len, kv_len, device="cpu")


titan_attention.FlexAttentionWrapper._compiled_flex_attn = staticmethod(dense_flex_attention)
for _model in (llama3_model, qwen3_model):
    _model.create_attention_mask = eager_block_mask
