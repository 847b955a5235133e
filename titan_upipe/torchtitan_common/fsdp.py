"""FSDP2 over a Llama3/Qwen3 decoder, with parameters left out: what both adapters wrap TSP jobs with.

TorchTitan's own wrappers (0.2.2's ``apply_fsdp``, 0.3's ``apply_fsdp_to_decoder``) shard every
parameter. TSP's weights are DTensors sharded over the CP ranks already (``tsp.modules``), so FSDP must
leave them out (``ignored_params``) and wrap the rest the way TorchTitan does:

==================================  =====================  =================================
FSDP unit                           reshard after forward  casts floating-point inputs
==================================  =====================  =================================
``tok_embeddings``                  policy                 yes (its input is token ids)
each block                          policy                 no: the residual stream is in the
                                                           parameter dtype already (0.2's RoPE
                                                           table would be copied per block)
``head`` (final norm, output)       only policy ``always`` yes
the root                            (FSDP's default)       yes
==================================  =====================  =================================

``policy``: ``"never"`` keeps the gathered parameters to backward, any other reshards (no pipeline
parallelism: ``"default"`` reshards). Gradients are summed, never divided by the ranks: the loss is
already divided by the global valid-token count.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard


def shard_decoder(model: nn.Module, mesh: DeviceMesh, head: list[nn.Module], *, param_dtype: torch.dtype,
                  reduce_dtype: torch.dtype, policy: str, cpu_offload: bool = False,
                  ignored_params: set[nn.Parameter] | None = None) -> None:
    """Wrap ``model`` (``tok_embeddings``, ``layers``, ``head``) in FSDP2 over ``mesh`` (module table)."""
    reshard = policy != "never"
    dtypes = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype}
    config = {"mesh": mesh, "ignored_params": ignored_params, "mp_policy": MixedPrecisionPolicy(**dtypes)}
    if cpu_offload:
        config["offload_policy"] = CPUOffloadPolicy()
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, **config, reshard_after_forward=reshard)
    block_policy = MixedPrecisionPolicy(**dtypes, cast_forward_inputs=False)
    for block in model.layers.values():
        fully_shard(block, **{**config, "mp_policy": block_policy}, reshard_after_forward=reshard)
    if all(part is not None for part in head):
        fully_shard(head, **config, reshard_after_forward=policy == "always")
    fully_shard(model, **config)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
