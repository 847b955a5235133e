"""``compile.enable`` for converted models: each block's norms and feed-forward compiled, attention eager.

Compiled in place (``fullgraph=True``), per block and for the final norm:

* ``attention_norm``, ``ffn_norm``, ``norm`` (``nn.RMSNorm``):
  ``y = x · rsqrt(mean(x², -1) + eps) · w``, ``[B, S/C, dim] -> [B, S/C, dim]``;
* ``feed_forward`` (Llama3/Qwen3 SwiGLU): ``y = w2(silu(w1 x) ⊙ w3 x)``, ``[B, S/C, dim] -> [B, S/C, dim]``.

Everything else runs eagerly as before: the attention (its collectives in the same order on
every rank), the tiled modules, the residual adds, the embedding and the output head. The loss
is compiled by TorchTitan's loss builder when ``compile.components`` names ``"loss"``. Blocks of
the same shapes share one compiled graph per part (parameters are graph inputs).

Why not TorchTitan's whole-block ``fullgraph`` compile: converted attention reads its positions
on the host (the RoPE range check), calls process-group collectives and, for UPipe, runs an
autograd Function whose backward calls ``torch.autograd.grad``. The tiled transforms are autograd
Functions looping over sequence tiles: ``tiled_rmsnorm``'s backward calls ``torch.autograd.grad``
too (dynamo refuses it), and ``tiled_mlp``'s loop would be unrolled into a graph of
``S/C / tile`` tiles (hundreds at long contexts).

How: the module's ``forward`` becomes its ``torch.compile``'d bound ``forward``; the module keeps
its class, parameters, names, state dict and FSDP grouping. ``nn.Module.compile`` is not used: it
compiles ``_call_impl``, which torch 2.13's dynamo skips, so ``nn.RMSNorm`` would silently stay
eager.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_upipe.attention.module import ContextParallelAttention
from titan_upipe.transforms.tiled_mlp import TiledFeedForward, is_swiglu_feed_forward
from titan_upipe.transforms.tiled_rmsnorm import TiledRMSNorm

PARTS = ("attention_norm", "ffn_norm", "feed_forward", "norm")
"""Child names of the modules compiled (block norms and feed-forward, the model's final norm)."""

WHOLE_BLOCK_BLOCKERS = (ContextParallelAttention, TiledFeedForward, TiledRMSNorm)
"""Modules TorchTitan's whole-block ``fullgraph`` compile cannot trace (or, ``tiled_mlp``, would unroll)."""


def needs_part_compile(model: nn.Module) -> bool:
    """True when some block holds one of :data:`WHOLE_BLOCK_BLOCKERS`."""
    return any(isinstance(module, WHOLE_BLOCK_BLOCKERS) for module in model.modules())


def is_compiled_part(name: str, module: nn.Module) -> bool:
    """A plain RMSNorm or SwiGLU feed-forward at one of :data:`PARTS` (tiled ones stay eager)."""
    return name in PARTS and (type(module) is nn.RMSNorm or is_swiglu_feed_forward(module, "compile"))


def compile_parts(model: nn.Module, backend: str = "inductor") -> list[str]:
    """Compile every block's norms and feed-forward and the final norm in place (``fullgraph``);
    returns their qualified names. Works under activation-checkpoint wrappers, applied before or
    after."""
    compiled = []
    for prefix, owner in model.named_modules():
        for name, child in owner.named_children():
            if is_compiled_part(name, child):
                child.forward = torch.compile(child.forward, backend=backend, fullgraph=True)
                compiled.append(f"{prefix}.{name}" if prefix else name)
    return compiled
