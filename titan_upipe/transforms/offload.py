"""Full activation checkpointing with each block's input offloaded to host memory.

Full AC keeps one tensor per block between forward and backward: the block's input (the
residual stream, ``B · S/C · d`` values). At millions of tokens and tens of layers those
inputs alone exceed the accelerator (paper section 2.3 and 4, "activation checkpointing with
CPU offloading"). :class:`OffloadedCheckpointWrapper` runs its block without recording a
graph, copies the input into a host buffer (page-locked when ``pin_memory``) and keeps only
that copy. In backward, the block fetches its input back, recomputes itself with autograd
and backpropagates, after first starting the copy of the *previous* block's input (the next
one backward needs) on a side stream, so the transfer overlaps this block's recompute. With
``prefetch_after_attention`` that copy starts only when the block's attention backward (the
peak of a block's backward at long context) has finished: one hidden state less at the peak, a
transfer the next block's backward may wait for (a block's backward takes far longer than the
copy at millions of tokens). With ``resident_blocks = K`` the last K blocks keep their input on
the device (plain full AC for them): backward needs those first, so they cost device memory only
from their forward to their backward, never at the backward peak (blocks 0-1), and save K inputs of
host memory (what bounds the longest context of a node when host memory runs out first).

The blocks of a registered model family (``attention.model_protocol``: TorchTitan's Llama3 and
Qwen3) are checkpointed as two chained autograd Functions split at ``h``, the residual stream
after attention: :class:`OffloadedAttentionHalf` (``x -> h = x + attention(attention_norm(x))``)
and :class:`OffloadedFeedForwardHalf` (``h -> out = h + ffn(ffn_norm(h))``). The autograd engine
keeps the gradient passed into a Function's backward alive until that backward returns (``del`` in
Python does not release it), so one Function around the whole block would hold the block output's
gradient (one hidden state) through the attention backward, which needs only the gradient of
``h``. Split, the feed-forward half's backward recomputes the whole block, backpropagates its own
half and returns the gradient of ``h``; the engine drops the output's gradient before the
attention half's backward runs the attention graph left to it, one hidden state below the
whole-block peak. Any other module (or a TorchTitan block with hooks of its own, which running its
halves directly would skip) is checkpointed by the whole-block
:class:`OffloadedCheckpointFunction` and holds its incoming gradient through its whole backward.

Kept attention (``keep``: a :class:`~titan_upipe.spec.keep_attention.KeepAttentionPlan`): a block that
keeps passes a :class:`~titan_upipe.attention.keep.KeptAttention` to its attention, which records its
kernel results (output and LSE) in the block's forward; the feed-forward half's backward recomputes
the block with them replayed, so the attention kernel's forward does not run twice. Kept on the
device, they cost device memory from the block's forward to its backward; kept on the host, they
travel like the block's input (the offload side stream out, the prefetch stream back, started with
the block input's prefetch).

On CPU the "host buffer" is a separate CPU tensor: the copy and the bookkeeping
(:data:`OFFLOAD_STATS`) are the same, only the streams are absent.

The wrapper subclasses torch's ``ActivationWrapper`` (as TorchTitan's ``apply_ac`` does), so
parameter FQNs get the same ``_checkpoint_wrapped_module`` prefix that checkpoint loading strips.
Blocks run no dropout (Llama3, Qwen3), so recomputation needs no RNG replay.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

from titan_upipe.attention.keep import KeptAttention
from titan_upipe.attention.model_protocol import MODEL_CLASSES
from titan_upipe.attention.module import ContextParallelAttention
from titan_upipe.errors import ConfigError
from titan_upipe.spec.keep_attention import NO_KEEP, KeepAttentionPlan, Placement

Tensor = torch.Tensor


@dataclass
class OffloadStats:
    """Host memory held by offloaded block inputs in this process (queryable, e.g. for logging)."""

    host_bytes: int = 0
    peak_host_bytes: int = 0
    saved_tensors: int = 0
    prefetched_bytes: int = 0
    """Inputs whose copy on the compute device exists ahead of their block's backward (prefetched,
    not yet fetched). On CPU the host tensor stands for that copy: the rank emulator counts these
    bytes as device memory from the prefetch on, where a GPU would hold them."""
    kept_attention_bytes: int = 0
    """Of ``host_bytes``, the kept attention results of blocks that keep them on the host."""
    peak_kept_attention_bytes: int = 0

    def add(self, nbytes: int, kept_attention: bool = False) -> None:
        self.host_bytes += nbytes
        self.saved_tensors += 1
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        if kept_attention:
            self.kept_attention_bytes += nbytes
            self.peak_kept_attention_bytes = max(self.peak_kept_attention_bytes, self.kept_attention_bytes)

    def remove(self, nbytes: int, kept_attention: bool = False) -> None:
        self.host_bytes -= nbytes
        self.saved_tensors -= 1
        if kept_attention:
            self.kept_attention_bytes -= nbytes


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
    """One block input living in host memory from forward to backward (or, ``resident``, kept on
    the device as it is: no copy either way). ``kept``: the block's kept attention, brought back
    with it (``prefetch``). ``kept_attention``: this is one of those kept tensors, not an input
    (a ``keep.Holder``; counted apart in ``OFFLOAD_STATS``)."""

    def __init__(self, x: Tensor, pin_memory: bool, streams: _Streams, previous: OffloadedInput | None,
                 resident: bool = False, kept: KeptAttention | None = None, kept_attention: bool = False) -> None:
        self.device, self.previous, self.streams, self.resident = x.device, previous, streams, resident
        self.kept, self.kept_attention = kept, kept_attention
        if resident:
            self.host, self.copied, self.fetched, self.nbytes = x, None, None, 0
            return
        # empty_like keeps a dense tensor's strides (a kernel's transposed output, say): the copy
        # that comes back is laid out as the original
        self.host: Tensor | None = torch.empty_like(x, device="cpu", pin_memory=pin_memory and x.is_cuda)
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
        OFFLOAD_STATS.add(self.nbytes, kept_attention)

    def prefetch(self) -> None:
        """Start the host-to-device copy on the prefetch stream (CUDA; on CPU only the accounting:
        ``OFFLOAD_STATS.prefetched_bytes``; nothing for a resident input), and the block's kept
        attention's (wherever its input is)."""
        if self.kept is not None:
            self.kept.prefetch()
        if self.fetched is not None or self.host is None or self.resident:
            return
        OFFLOAD_STATS.prefetched_bytes += self.nbytes
        if self.device.type != "cuda":
            self.fetched = (self.host, None)
            return
        _, prefetch_stream = self.streams.get()
        with torch.cuda.stream(prefetch_stream):
            prefetch_stream.wait_event(self.copied)
            on_device = self.host.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self.fetched = (on_device, done)

    def prefetch_previous(self) -> None:
        """Start the previous block's prefetch (the input backward needs next), once."""
        if self.previous is not None:
            self.previous.prefetch()
            self.previous = None

    def fetch(self, prefetch_previous: bool = True) -> Tensor:
        """The input on the compute device; starts the previous block's prefetch first, or leaves it
        to a later ``prefetch_previous`` call (after the attention backward)."""
        if self.host is None:
            raise RuntimeError("offloaded block input fetched twice (backward through the graph twice "
                               "needs retain_graph, which offloaded checkpointing does not support)")
        if self.kept is not None:  # all of the block's kept copies travel at once (the top block's: now)
            self.kept.prefetch()
        if prefetch_previous:
            self.prefetch_previous()
        if self.resident:
            on_device = self.host
        elif self.device.type == "cuda":
            self.prefetch()
            on_device, done = self.fetched
            torch.cuda.current_stream().wait_event(done)
            on_device.record_stream(torch.cuda.current_stream())
        else:
            on_device = self.host
        if self.fetched is not None:
            OFFLOAD_STATS.prefetched_bytes -= self.nbytes
        self.host = self.fetched = None
        if not self.resident:
            OFFLOAD_STATS.remove(self.nbytes, self.kept_attention)
        return on_device


class OffloadedCheckpointFunction(torch.autograd.Function):
    """``run(x)`` without a graph; x goes to host memory; backward recomputes and backpropagates."""

    @staticmethod
    def forward(ctx, run, x: Tensor, slot_factory, prefetch_late: bool = False) -> Tensor:
        with torch.no_grad():
            out = run(x)
        ctx.run = run
        ctx.saved_input = slot_factory(x)
        ctx.prefetch_late = prefetch_late
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        slot = ctx.saved_input
        x = slot.fetch(prefetch_previous=not ctx.prefetch_late).detach().requires_grad_(True)
        ctx.saved_input = None
        with torch.enable_grad():
            out = ctx.run(x)
        # Backpropagate from the output's graph edge, not the tensor: the recomputed output (one
        # hidden state; a block's last op, the residual add, does not save it) is freed here
        # instead of living through the whole block backward.
        edge = get_gradient_edge(out)
        del out
        torch.autograd.backward(edge, grad_out)
        slot.prefetch_previous()  # a no-op when fetch started it
        return None, x.grad, None, None


class SplitBlock:
    """One TorchTitan block's two halves, and what its two checkpoint Functions share: the
    offloaded input, from forward to the feed-forward half's backward; the recomputed attention
    graph, from there to the attention half's backward."""

    def __init__(self, block: nn.Module, attention_args: tuple, prefetch_late: bool = False,
                 kept: KeptAttention | None = None) -> None:
        self.block, self.attention_args, self.prefetch_late, self.kept = block, attention_args, prefetch_late, kept
        self.saved_input: OffloadedInput | None = None
        self.fetched_input: OffloadedInput | None = None
        """The fetched slot, whose ``prefetch_previous`` the attention half's backward calls."""
        self.recomputed: tuple[GradientEdge, Tensor] | None = None

    def attention_half(self, x: Tensor) -> Tensor:
        block = self.block
        if self.kept is None:
            return x + block.attention(block.attention_norm(x), *self.attention_args)
        return x + block.attention(block.attention_norm(x), *self.attention_args, kept=self.kept)

    def feed_forward_branch(self, h: Tensor) -> Tensor:
        block = self.block
        ffn = block.moe if getattr(block, "moe_enabled", False) else block.feed_forward
        return ffn(block.ffn_norm(h))

    def feed_forward_half(self, h: Tensor) -> Tensor:
        return h + self.feed_forward_branch(h)

    def take_recomputed(self) -> tuple[GradientEdge, Tensor]:
        if self.recomputed is None:
            raise RuntimeError("offloaded attention half has no recomputed graph (backward through the graph "
                               "twice needs retain_graph, which offloaded checkpointing does not support)")
        recomputed, self.recomputed = self.recomputed, None
        return recomputed


def splits_at_h(block: nn.Module) -> bool:
    """A block of a registered family (``model_protocol.BlockModule``: TorchTitan's Llama3/Qwen3)
    with no hooks of its own (running its halves skips them)."""
    hooks = (block._forward_pre_hooks, block._forward_hooks, block._backward_pre_hooks, block._backward_hooks)
    return MODEL_CLASSES.require("offloaded checkpointing").block_family(block) is not None and not any(hooks)


def attention_args(block: nn.Module, x: Tensor, *args, **kwargs) -> tuple:
    """What the block's forward passes to its attention after the normed input: (freqs_cis or
    rope_cache, attention_masks, positions), bound as the block's own signature binds them."""
    bound = inspect.signature(block.forward).bind(x, *args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())[1:]


class OffloadedAttentionHalf(torch.autograd.Function):
    """``x -> h`` without a graph; x goes to host memory. Backward runs the attention graph that
    :class:`OffloadedFeedForwardHalf`'s backward recomputed."""

    @staticmethod
    def forward(ctx, x: Tensor, split: SplitBlock, slot_factory) -> Tensor:
        with torch.no_grad():
            h = split.attention_half(x)
        if split.kept is not None:
            split.kept.seal()  # the recomputation replays what this forward recorded
        split.saved_input = slot_factory(x, split.kept)
        ctx.split = split
        return h

    @staticmethod
    def backward(ctx, grad_h: Tensor):
        split = ctx.split
        edge, x = split.take_recomputed()
        torch.autograd.backward(edge, grad_h)
        if split.fetched_input is not None:  # the late prefetch: after the attention backward
            split.fetched_input.prefetch_previous()
            split.fetched_input = None
        return x.grad, None, None


class OffloadedFeedForwardHalf(torch.autograd.Function):
    """``h -> out`` without a graph, keeping nothing (h neither). Backward recomputes the whole
    block from the fetched input, backpropagates the feed-forward half and returns h's gradient."""

    @staticmethod
    def forward(ctx, h: Tensor, split: SplitBlock) -> Tensor:
        with torch.no_grad():
            out = split.feed_forward_half(h)
        ctx.split = split
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        split = ctx.split
        slot = split.saved_input
        x = slot.fetch(prefetch_previous=not split.prefetch_late).detach().requires_grad_(True)
        if split.prefetch_late:
            split.fetched_input = slot
        with torch.enable_grad():
            h = split.attention_half(x)
            h_leaf = h.detach().requires_grad_(True)
            branch = split.feed_forward_branch(h_leaf)
            identity = h_leaf.view_as(h_leaf)  # see below
        # The attention graph waits for the attention half's backward, which the engine runs
        # after this one returns and releases grad_out. Only its edge is kept: h itself (the
        # residual add saves nothing) lives on only as h_leaf, which ffn_norm saves anyway.
        split.recomputed = (get_gradient_edge(h), x)
        del h
        # out = h + branch is not recomputed (one hidden state less). Its two inputs get grad_out
        # directly: the branch through its edge, h through a view (the add's identity, no
        # memory). The view's node is newer than the branch's, so the engine runs it first and
        # h's gradient sums grad_out first, then ffn_norm's contributions, in autograd's order
        # for the unwrapped block: bit for bit the same gradient.
        edges = [get_gradient_edge(branch), get_gradient_edge(identity)]
        del branch, identity
        torch.autograd.backward(edges, [grad_out, grad_out])
        return h_leaf.grad, None


class OffloadSchedule:
    """Links the wrappers of one model: each forward slot knows the block before it, whose
    input backward needs next."""

    def __init__(self, pin_memory: bool, prefetch_after_attention: bool = False) -> None:
        self.pin_memory, self.prefetch_after_attention = pin_memory, prefetch_after_attention
        self.streams = _Streams()
        self.last: OffloadedInput | None = None

    def slot_factory(self, first_block: bool, resident: bool = False):
        def make(x: Tensor, kept: KeptAttention | None = None) -> OffloadedInput:
            slot = OffloadedInput(x, self.pin_memory, self.streams, None if first_block else self.last, resident,
                                  kept)
            self.last = slot
            return slot

        return make

    def kept_attention(self, placement: Placement | None) -> KeptAttention | None:
        """A new record of one block call's kept attention: on the device, in host memory (the
        offload streams, pinned as the block inputs are), or None for a block that does not keep."""
        if placement is None:
            return None
        if placement == "device":
            return KeptAttention()
        return KeptAttention(lambda t: OffloadedInput(t, self.pin_memory, self.streams, None, kept_attention=True))


class OffloadedCheckpointWrapper(ActivationWrapper):
    """A transformer block under full activation checkpointing with its input offloaded; ``keep``:
    where it keeps its attention's kernel results (None: it recomputes them)."""

    def __init__(self, block: nn.Module, schedule: OffloadSchedule, first_block: bool, resident: bool = False,
                 keep: Placement | None = None) -> None:
        super().__init__(block)
        if keep is not None:
            check_keeps(block)
        self.schedule, self.first_block, self.resident, self.keep = schedule, first_block, resident, keep

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        block = self._checkpoint_wrapped_module
        if not (torch.is_grad_enabled() and x.requires_grad):
            return block(x, *args, **kwargs)

        slot_factory = self.schedule.slot_factory(self.first_block, self.resident)
        if splits_at_h(block):
            split = SplitBlock(block, attention_args(block, x, *args, **kwargs),
                               self.schedule.prefetch_after_attention, self.schedule.kept_attention(self.keep))
            h = OffloadedAttentionHalf.apply(x, split, slot_factory)
            return OffloadedFeedForwardHalf.apply(h, split)

        def run(inp: Tensor) -> Tensor:
            return block(inp, *args, **kwargs)

        return OffloadedCheckpointFunction.apply(run, x, slot_factory, self.schedule.prefetch_after_attention)


def check_keeps(block: nn.Module) -> None:
    """A block can keep its attention: a TorchTitan Llama3/Qwen3 block (split at ``h``) whose
    attention is context-parallel (it takes the ``kept`` record). ConfigError otherwise."""
    if not splits_at_h(block):
        raise ConfigError(f"activation_checkpoint.keep_attention needs TorchTitan's Llama3/Qwen3 blocks without "
                          f"hooks of their own; got {type(block).__name__}: set keep_attention = \"off\"")
    if not isinstance(block.attention, ContextParallelAttention):
        raise ConfigError("activation_checkpoint.keep_attention keeps the results of the plugin's context-parallel "
                          f"attention; this block's is TorchTitan's {type(block.attention).__name__}: add a CP "
                          "converter (ulysses, upipe, ring, usp, tsp) to model.converters, or set keep_attention = "
                          "\"off\"")


def apply_offloaded_ac(model: nn.Module, pin_memory: bool, prefetch_after_attention: bool = False,
                       resident_blocks: int = 0, keep: KeepAttentionPlan = NO_KEEP) -> OffloadSchedule:
    """Wrap every block of ``model.layers`` (TorchTitan layout) in place; the last ``resident_blocks``
    keep their input on the device; ``keep`` says which blocks keep their attention, and where."""
    schedule = OffloadSchedule(pin_memory, prefetch_after_attention)
    blocks = list(model.layers.named_children())
    for index, (name, block) in enumerate(blocks):
        resident = index >= len(blocks) - resident_blocks
        model.layers.register_module(name, OffloadedCheckpointWrapper(block, schedule, first_block=index == 0,
                                                                      resident=resident,
                                                                      keep=keep.placement(index, len(blocks))))
    return schedule
