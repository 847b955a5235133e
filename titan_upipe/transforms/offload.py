"""Full activation checkpointing with each block's input offloaded to host memory.

Full AC keeps one tensor per block between forward and backward: the block's input (the
residual stream, ``B · S/C · d`` values). At millions of tokens and tens of layers those
inputs alone exceed the accelerator (paper section 2.3 and 4, "activation checkpointing with
CPU offloading"). :class:`OffloadedCheckpointWrapper` runs its block without recording a
graph, copies the input into a host buffer (page-locked when ``pin_memory``) and keeps only
that copy. In backward, the block fetches its input back, recomputes itself with autograd
and backpropagates, after first starting the copy of the *previous* block's input (the next
one backward needs) on a side stream, so the transfer overlaps this block's recompute.

On CPU the "host buffer" is a separate CPU tensor: the copy and the bookkeeping
(:data:`OFFLOAD_STATS`) are the same, only the streams are absent.

The wrapper subclasses torch's ``ActivationWrapper`` (as TorchTitan's ``apply_ac`` does), so
parameter FQNs get the same ``_checkpoint_wrapped_module`` prefix that checkpoint loading strips.
Blocks run no dropout (Llama3, Qwen3), so recomputation needs no RNG replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

Tensor = torch.Tensor


@dataclass
class OffloadStats:
    """Host memory held by offloaded block inputs in this process (queryable, e.g. for logging)."""

    host_bytes: int = 0
    peak_host_bytes: int = 0
    saved_tensors: int = 0

    def add(self, nbytes: int) -> None:
        self.host_bytes += nbytes
        self.saved_tensors += 1
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    def remove(self, nbytes: int) -> None:
        self.host_bytes -= nbytes
        self.saved_tensors -= 1


OFFLOAD_STATS = OffloadStats()


def offloaded_host_bytes() -> int:
    """Bytes of block inputs currently held in host memory by offloaded checkpointing."""
    return OFFLOAD_STATS.host_bytes


class _Streams:
    """Side streams for device<->host copies (CUDA only), created on first use."""

    def __init__(self) -> None:
        self.offload: torch.cuda.Stream | None = None
        self.prefetch: torch.cuda.Stream | None = None

    def get(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self.offload is None:
            self.offload, self.prefetch = torch.cuda.Stream(), torch.cuda.Stream()
        return self.offload, self.prefetch


class OffloadedInput:
    """One block input living in host memory from forward to backward."""

    def __init__(self, x: Tensor, pin_memory: bool, streams: _Streams, previous: OffloadedInput | None) -> None:
        self.device, self.previous, self.streams = x.device, previous, streams
        self.host: Tensor | None = torch.empty(x.shape, dtype=x.dtype, device="cpu",
                                               pin_memory=pin_memory and x.is_cuda)
        self.copied: torch.cuda.Event | None = None
        self.fetched: tuple[Tensor, torch.cuda.Event] | None = None
        if x.is_cuda:
            offload_stream, _ = streams.get()
            offload_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(offload_stream):
                self.host.copy_(x, non_blocking=True)
                self.copied = torch.cuda.Event()
                self.copied.record()
            x.record_stream(offload_stream)  # x's memory is reused only after the copy
        else:
            self.host.copy_(x)
        self.nbytes = self.host.numel() * self.host.element_size()
        OFFLOAD_STATS.add(self.nbytes)

    def prefetch(self) -> None:
        """Start the host-to-device copy on the prefetch stream (CUDA; no-op on CPU)."""
        if self.device.type != "cuda" or self.fetched is not None or self.host is None:
            return
        _, prefetch_stream = self.streams.get()
        with torch.cuda.stream(prefetch_stream):
            prefetch_stream.wait_event(self.copied)
            on_device = self.host.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self.fetched = (on_device, done)

    def fetch(self) -> Tensor:
        """The input on the compute device; starts the previous block's prefetch first."""
        if self.host is None:
            raise RuntimeError("offloaded block input fetched twice (backward through the graph twice "
                               "needs retain_graph, which offloaded checkpointing does not support)")
        if self.previous is not None:
            self.previous.prefetch()
        if self.device.type == "cuda":
            self.prefetch()
            on_device, done = self.fetched
            torch.cuda.current_stream().wait_event(done)
            on_device.record_stream(torch.cuda.current_stream())
        else:
            on_device = self.host
        self.host = self.fetched = self.previous = None
        OFFLOAD_STATS.remove(self.nbytes)
        return on_device


class OffloadedCheckpointFunction(torch.autograd.Function):
    """``run(x)`` without a graph; x goes to host memory; backward recomputes and backpropagates."""

    @staticmethod
    def forward(ctx, run, x: Tensor, slot_factory) -> Tensor:
        with torch.no_grad():
            out = run(x)
        ctx.run = run
        ctx.saved_input = slot_factory(x)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x = ctx.saved_input.fetch().detach().requires_grad_(True)
        ctx.saved_input = None
        with torch.enable_grad():
            out = ctx.run(x)
        # Backpropagate from the output's graph edge, not the tensor: the recomputed output (one
        # hidden state; a block's last op, the residual add, does not save it) is freed here
        # instead of living through the whole block backward.
        edge = torch.autograd.graph.get_gradient_edge(out)
        del out
        torch.autograd.backward(edge, grad_out)
        return None, x.grad, None


class OffloadSchedule:
    """Links the wrappers of one model: each forward slot knows the block before it, whose
    input backward needs next."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.streams = _Streams()
        self.last: OffloadedInput | None = None

    def slot_factory(self, first_block: bool):
        def make(x: Tensor) -> OffloadedInput:
            slot = OffloadedInput(x, self.pin_memory, self.streams, None if first_block else self.last)
            self.last = slot
            return slot

        return make


class OffloadedCheckpointWrapper(ActivationWrapper):
    """A transformer block under full activation checkpointing with its input offloaded."""

    def __init__(self, block: nn.Module, schedule: OffloadSchedule, first_block: bool) -> None:
        super().__init__(block)
        self.schedule, self.first_block = schedule, first_block

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        block = self._checkpoint_wrapped_module
        if not (torch.is_grad_enabled() and x.requires_grad):
            return block(x, *args, **kwargs)

        def run(inp: Tensor) -> Tensor:
            return block(inp, *args, **kwargs)

        return OffloadedCheckpointFunction.apply(run, x, self.schedule.slot_factory(self.first_block))


def apply_offloaded_ac(model: nn.Module, pin_memory: bool) -> OffloadSchedule:
    """Wrap every block of ``model.layers`` (TorchTitan layout) in place."""
    schedule = OffloadSchedule(pin_memory)
    for index, (name, block) in enumerate(list(model.layers.named_children())):
        model.layers.register_module(name, OffloadedCheckpointWrapper(block, schedule, first_block=index == 0))
    return schedule
