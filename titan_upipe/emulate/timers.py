"""Wall-clock timers hooked into a step: the converted attention modules and the transformer blocks.

Both time a module's forward with forward hooks and its backward with gradient hooks: the
gradient of the module's output starts its backward, the gradient of its input ends it (a
tensor hook fires once that tensor's gradient is complete). Each boundary calls ``sync``
(``torch.cuda.synchronize`` on CUDA), so a boundary waits for the kernels before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor


def _input(args, kwargs, name: str) -> Tensor | None:
    x = args[0] if args else kwargs.get(name)
    return x if isinstance(x, Tensor) else None


@dataclass
class _ModuleTimer:
    """Forward and backward seconds of a kind of module, summed over its calls (module docstring)."""

    sync: Callable[[], None]
    input_name: str = "x"
    forward_s: float = 0.0
    backward_s: float = 0.0
    _calls: dict[int, tuple[float, dict[str, float] | None]] = field(default_factory=dict)

    def reset(self) -> None:
        self.forward_s = self.backward_s = 0.0

    def _counts(self, module) -> bool:
        return True

    def pre_forward(self, module, args, kwargs):
        if not self._counts(module):
            return
        self.sync()
        start = time.perf_counter()
        x = _input(args, kwargs, self.input_name)
        box: dict[str, float] | None = None
        if x is not None and x.requires_grad and torch.is_grad_enabled():
            box = {}  # this call's backward start, set by the output's gradient hook

            def end_backward(grad):
                self.sync()
                if "start" in box:
                    self.backward_s += time.perf_counter() - box.pop("start")

            x.register_hook(end_backward)
        self._calls[id(module)] = (start, box)

    def post_forward(self, module, args, kwargs, output):
        if id(module) not in self._calls:
            return
        self.sync()
        start, box = self._calls.pop(id(module))
        self.forward_s += time.perf_counter() - start
        if box is not None and isinstance(output, Tensor) and output.requires_grad:

            def start_backward(grad):
                self.sync()
                box["start"] = time.perf_counter()

            output.register_hook(start_backward)


@dataclass
class AttentionTimer(_ModuleTimer):
    """Wall time inside the converted attention modules: forward, any recomputation and backward."""


@dataclass
class BlockTimer(_ModuleTimer):
    """Wall time inside the transformer blocks. Forwards count while ``active`` (the step's
    forward): a block recomputed under activation checkpointing runs inside its backward, which
    already holds that time."""

    active: bool = False

    def _counts(self, module) -> bool:
        return self.active
