"""Model converters ``ulysses``, ``upipe``, ``ring`` and ``usp``: context-parallel attention in every block.

TorchTitan applies converters on the meta device, before ``parallelize_fn`` and
``init_weights``; ``convert_attention`` shares the block's parameters, so FSDP,
checkpoints and weight initialisation see the unconverted parameter names.
The mesh is derived from ``parallel_dims``' CP mesh and ``[upipe] ulysses_degree``
(``titan_upipe.parallel.context_parallel_mesh``, the same call the trainer makes); U and
the kernel come from ``[upipe]`` (``attention_backend = "auto"`` is resolved here, once, and
logged with the reasons faster kernels were passed over).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from titan_upipe.attention import convert_attention
from titan_upipe.config import ConfigError
from titan_upipe.parallel import context_parallel_mesh, layout_for, layout_rank
from titan_upipe.validation import attention_backend_choice, check_context_parallel, compute_dtype


class _ContextParallelAttentionConverter:
    mode: str

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
        check_context_parallel(job_config)
        self.cp_mesh = context_parallel_mesh(parallel_dims.get_mesh("cp"), self.mode, job_config.upipe.ulysses_degree)
        self.heads_per_stage = job_config.upipe.heads_per_stage if self.mode == "upipe" else None
        # Resolved once here (auto included): every block gets the same kernel.
        self.backend_choice = attention_backend_choice(job_config)
        self.compute_dtype = compute_dtype(job_config)

    def convert(self, model: nn.Module) -> None:
        # fused_rope may have run first (converters apply in model.converters order).
        in_place_rope = getattr(model, "fused_rope_kind", None) is not None
        for block in model.layers.values():
            block.attention = convert_attention(
                block.attention, self.mode, self.cp_mesh,
                heads_per_stage=self.heads_per_stage, backend=self.backend_choice.name, in_place_rope=in_place_rope,
                compute_dtype=self.compute_dtype,
            )
        model.register_forward_pre_hook(_LayoutCheck(self.cp_mesh), with_kwargs=True)
        logger.info("Converted attention to %s over a CP mesh of %d ranks (%s), %s", self.mode, self.cp_mesh.size(),
                    dict(zip(self.cp_mesh.mesh_dim_names or (), self.cp_mesh.shape, strict=True)),
                    self.backend_choice.describe())

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        pass


class _LayoutCheck:
    """Once, at the first forward: the tokens must be sharded in our layout.

    TorchTitan's own trainer shards CP inputs head-tail (load balancing for its ring
    attention); the Ulysses all-to-all and our zigzag ring would then join shards in the
    wrong order and silently compute another sequence. ``titan_upipe.train`` shards in our
    layout (contiguous or zigzag, whichever this mesh's attention expects).
    """

    def __init__(self, cp_mesh) -> None:
        self.cp_mesh = cp_mesh
        self.checked = False

    def __call__(self, module, args, kwargs):
        if self.checked:
            return None
        positions = kwargs.get("positions")
        tokens = args[0] if args else kwargs["tokens"]
        local_len = tokens.shape[-1]
        layout = layout_for(self.cp_mesh, local_len * self.cp_mesh.size())
        expected = layout.positions(layout_rank(self.cp_mesh), device=tokens.device)
        if positions is None or not torch.equal(positions.reshape(-1, local_len)[0].to(expected.dtype), expected):
            raise ConfigError(
                "context-parallel inputs are not in titan_upipe's sequence layout: launch with "
                "`-m titan_upipe.train` (TorchTitan's own trainer shards CP inputs head-tail)"
            )
        self.checked = True
        return None


class UlyssesConverter(_ContextParallelAttentionConverter):
    mode = "ulysses"


class UPipeConverter(_ContextParallelAttentionConverter):
    mode = "upipe"


class RingConverter(_ContextParallelAttentionConverter):
    mode = "ring"


class USPConverter(_ContextParallelAttentionConverter):
    mode = "usp"


CONVERTERS = {"ulysses": UlyssesConverter, "upipe": UPipeConverter, "ring": RingConverter, "usp": USPConverter}
