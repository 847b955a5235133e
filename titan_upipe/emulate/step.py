"""One measured training step of a rank (the trainer's ``train_step`` order), under a ``StepTracker``.

``zero_grad``; the global batch created on the device and sharded in the converted
attention's layout; forward; ``loss = loss_fn(pred, labels) / global_tokens``; ``del pred``;
``backward``; ``clip_grad_norm_`` (foreach); ``optimizer.step()``. The tracker's peak is
read and reset at each phase boundary; block forwards are bracketed by :class:`BlockMemory`
and attention modules timed by :class:`AttentionTimer`. The result is a :class:`StepResult`
(definitions of every quantity: the ``titan_upipe.emulate`` docstring).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torchtitan.components.loss import IGNORE_INDEX

from titan_upipe.attention import ContextParallelAttention, sequence_mesh
from titan_upipe.emulate.rank import TrainingRank
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.inputs import prepare_cp_batch
from titan_upipe.tools.memory_tracker import StepTracker, storage_bytes
from titan_upipe.tools.packed_documents import packed_document_tokens
from titan_upipe.torchtitan_0_2.grad_norm import clip_grad_norm_
from titan_upipe.transforms.offload import OFFLOAD_STATS

Tensor = torch.Tensor

PHASES = ("forward", "backward", "optimizer")
"""The keys of ``phase_peak_bytes`` and ``phase_time_s``."""


@dataclass
class AttentionTimer:
    """Wall time inside the converted attention modules (forward hooks; backward via
    gradient hooks on the module output, whose gradient starts its backward, and input,
    whose gradient ends it)."""

    sync: Callable[[], None]
    forward_s: float = 0.0
    backward_s: float = 0.0
    _calls: dict[int, tuple[float, dict[str, float] | None]] = field(default_factory=dict)

    def pre_forward(self, module, args, kwargs):
        self.sync()
        start = time.perf_counter()
        x = args[0] if args else kwargs.get("x")
        box: dict[str, float] | None = None
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            box = {}  # this call's backward start, set by the output's gradient hook

            def end_backward(grad):
                self.sync()
                if "start" in box:
                    self.backward_s += time.perf_counter() - box.pop("start")

            x.register_hook(end_backward)
        self._calls[id(module)] = (start, box)

    def post_forward(self, module, args, kwargs, output):
        self.sync()
        start, box = self._calls.pop(id(module))
        self.forward_s += time.perf_counter() - start
        if box is not None and isinstance(output, torch.Tensor) and output.requires_grad:

            def start_backward(grad):
                self.sync()
                box["start"] = time.perf_counter()

            output.register_hook(start_backward)


@dataclass
class _BlockForward:
    """One block forward: the tracked bytes it added (output included), its output's and input's
    bytes, and a weak reference to the input's storage (alive at the end of forward only if
    something kept it: autograd, plain AC, a resident block; not an offloaded block)."""

    delta: int
    output_bytes: int
    input_bytes: int
    input_storage: weakref.ref | None
    resident: bool


@dataclass
class BlockMemory:
    """Tracked bytes before and after each block's forward (outside recomputation).

    What a block leaves on the device for backward is ``delta - |out| + |x| [x still alive at
    the end of forward]``: the block's output becomes the next block's input (counted there),
    and its input is released once the next block runs unless something saved it. Counting the
    delta alone charged every offloaded block one hidden state it does not keep (1 GiB per block
    of Llama3-8B at 1M tokens over 8 ranks: +30 GiB in the 32-block extrapolation, seen on the
    H100, 2026-11-23)."""

    tracker: StepTracker | None = None
    active: bool = False
    forwards: list[_BlockForward] = field(default_factory=list)
    retained: list[tuple[float, bool]] = field(default_factory=list)
    """(bytes kept, resident) per block, settled at the end of forward."""
    _before: dict[int, tuple[int, Tensor | None]] = field(default_factory=dict)

    def pre(self, module, args, kwargs):
        if self.active and self.tracker is not None:
            self.tracker.refresh()
            x = args[0] if args and isinstance(args[0], Tensor) else None
            self._before[id(module)] = (self.tracker.device_bytes(), x)

    def post(self, module, args, kwargs, output):
        if self.active and self.tracker is not None and id(module) in self._before:
            self.tracker.refresh()
            before, x = self._before.pop(id(module))
            self.forwards.append(_BlockForward(
                self.tracker.device_bytes() - before, storage_bytes([output]), storage_bytes([x]),
                None if x is None else weakref.ref(x.untyped_storage()), bool(getattr(module, "resident", False))))

    def clear(self) -> None:
        self.forwards.clear()
        self.retained.clear()

    def settle(self) -> None:
        """At the end of forward (the blocks' inputs are released or kept by now)."""
        for f in self.forwards:
            kept_input = f.input_storage is not None and f.input_storage() is not None
            self.retained.append((f.delta - f.output_bytes + (f.input_bytes if kept_input else 0), f.resident))
        self.forwards.clear()

    def retained_per_layer(self) -> float:
        """Mean bytes kept by the blocks a deeper model adds: offloaded ones (the last
        ``resident_blocks`` are resident in any depth), after the first (it also holds FSDP's
        all-gather buffer replacing the (smaller) embedding's one: FSDP keeps the last
        all-gather buffer until the next all-gather) where there is another."""
        offloaded = [kept for kept, resident in self.retained if not resident] or [k for k, _ in self.retained]
        pool = offloaded[1:] if len(offloaded) > 1 else offloaded
        return sum(pool) / len(pool) if pool else 0.0


@dataclass(frozen=True)
class StepResult:
    """What one measured step of a rank gives (bytes of this rank; times in seconds)."""

    baseline_bytes: int
    phase_peak_bytes: dict[str, int]
    peak_op: str
    """The op at which the largest phase peak was reached."""
    phase_time_s: dict[str, float]
    grad_bytes: int
    layer_grad_bytes: int
    end_bytes: int
    host_offload_bytes: int
    retained_bytes_per_layer: float
    attention_forward_time_s: float
    attention_backward_time_s: float
    device_peak_allocated_bytes: int | None
    device_peak_reserved_bytes: int | None
    loss: float | None

    @property
    def peak_bytes(self) -> int:
        return max(self.phase_peak_bytes.values())

    @property
    def step_time_s(self) -> float:
        return sum(self.phase_time_s.values())

    @property
    def attention_time_s(self) -> float:
        return self.attention_forward_time_s + self.attention_backward_time_s


@dataclass
class _Batch:
    """The global token batch on the device and this rank's shard of it; all of it stays alive
    to the end of the step, as the trainer's batch does."""

    inputs: torch.Tensor
    labels: torch.Tensor
    local_inputs: torch.Tensor
    local_labels: torch.Tensor
    extra: dict[str, torch.Tensor]
    """Extra model inputs: the shard's ``positions`` under CP."""


def _device_batch(rank: TrainingRank, job_config, device: torch.device, step: int, cp_mesh) -> _Batch:
    """The global batch created on the device (the trainer's host-to-device copy), then this
    rank's shard in the converted attention's layout (``cp_mesh``; None without CP)."""
    seq, batch = job_config.training.seq_len, job_config.training.local_batch_size
    generator = torch.Generator(device=device).manual_seed(job_config.debug.seed + step)
    inputs = torch.randint(0, rank.vocab_size, (batch, seq), device=device, generator=generator)
    labels = torch.randint(0, rank.vocab_size, (batch, seq), device=device, generator=generator)
    eos_id = None
    if rank.documents:
        if cp_mesh is None:
            raise ConfigError("the emulator runs attn_mask_type 'block_causal' through a CP converter only "
                              "(TorchTitan's own flex/varlen kernels are not emulated): add one to model.converters")
        # Packed documents (the check's EOS pattern), their mask built as the trainer builds it.
        eos_id = rank.vocab_size - 1
        inputs = packed_document_tokens(inputs.clamp(max=eos_id - 1), eos_id)
    if cp_mesh is None:
        return _Batch(inputs, labels, inputs, labels, {})
    upipe = job_config.upipe
    batch = prepare_cp_batch(inputs, labels, cp_mesh, eos_id=eos_id, ignore_index=IGNORE_INDEX,
                             document_balance=upipe.document_balance, document_min_split=upipe.document_min_split)
    return _Batch(inputs, labels, batch.tokens, batch.labels, batch.model_kwargs())


def _forward_loss(rank: TrainingRank, batch: _Batch, global_tokens: float, blocks: BlockMemory) -> torch.Tensor:
    """``loss_fn(model(shard), labels) / global_tokens``; the prediction is freed before backward."""
    blocks.active = True
    with rank.amp:
        pred = rank.model(batch.local_inputs, **batch.extra)
        loss = rank.loss_fn(pred, batch.local_labels) / global_tokens
    del pred
    blocks.active = False
    blocks.settle()
    return loss


def train_step(rank: TrainingRank, job_config, device: torch.device, step: int, fake: bool, timers: AttentionTimer,
               blocks: BlockMemory) -> StepResult:
    """One training step under a ``StepTracker``; the trainer's ``train_step`` order."""
    is_cuda = device.type == "cuda"
    sync = timers.sync
    params = rank.params
    par = rank.parallel_dims
    global_tokens = float(job_config.training.local_batch_size * job_config.training.seq_len
                          * par.dp_shard * par.dp_replicate)
    cp_mesh = sequence_mesh(rank.model) if par.cp_enabled else None
    offload_start = OFFLOAD_STATS.host_bytes

    def offloaded() -> int:
        return OFFLOAD_STATS.host_bytes - offload_start

    def on_host() -> int:  # a prefetched input is on the device from its prefetch on, as on a GPU
        return offloaded() - OFFLOAD_STATS.prefetched_bytes

    rank.optimizers.zero_grad()
    timers.forward_s = timers.backward_s = 0.0
    blocks.clear()
    sync()
    if is_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    baseline = rank.resident_bytes()
    # On CPU the offloaded block inputs are tracked (host == device): subtract them.
    tracker = StepTracker(device.type, on_host if device.type == "cpu" else None)
    blocks.tracker = tracker
    peaks: dict[str, tuple[int, str]] = {}
    with tracker:
        t0 = time.perf_counter()
        batch = _device_batch(rank, job_config, device, step, cp_mesh)
        loss = _forward_loss(rank, batch, global_tokens, blocks)
        sync()
        t1 = time.perf_counter()
        host_offload = offloaded()
        peaks["forward"] = (tracker.peak_bytes, tracker.device_peak_op)
        tracker.reset_peak()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        peaks["backward"] = (tracker.peak_bytes, tracker.device_peak_op)
        tracker.reset_peak()
        layer_ids = rank.layer_ids()
        grad_bytes = storage_bytes(p.grad for p in params if p.grad is not None)
        layer_grad_bytes = storage_bytes(p.grad for p in params if p.grad is not None and id(p) in layer_ids)
        clip_grad_norm_(params, job_config.training.max_norm, foreach=True)
        rank.optimizers.step()
        sync()
        t3 = time.perf_counter()
        peaks["optimizer"] = (tracker.peak_bytes, tracker.device_peak_op)
        tracker.refresh()
        end_bytes = tracker.device_bytes()
        loss_value = None if fake else float(loss.detach().float().item())
        del loss, batch
    blocks.tracker = None
    return StepResult(
        baseline_bytes=baseline,
        phase_peak_bytes={phase: value for phase, (value, _) in peaks.items()},
        peak_op=max(peaks.values())[1],
        phase_time_s={"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2},
        grad_bytes=grad_bytes,
        layer_grad_bytes=layer_grad_bytes,
        end_bytes=end_bytes,
        host_offload_bytes=host_offload,
        retained_bytes_per_layer=blocks.retained_per_layer(),
        attention_forward_time_s=timers.forward_s,
        attention_backward_time_s=timers.backward_s,
        device_peak_allocated_bytes=torch.cuda.max_memory_allocated(device) if is_cuda else None,
        device_peak_reserved_bytes=torch.cuda.max_memory_reserved(device) if is_cuda else None,
        loss=loss_value,
    )


def run_steps(rank: TrainingRank, job_config, device: torch.device, *, steps: int, fake: bool,
              time_attention: bool) -> StepResult:
    """``steps`` training steps with the block (and, with ``time_attention``, attention) hooks
    installed; the last step's result."""
    timers = AttentionTimer(lambda: torch.cuda.synchronize(device) if device.type == "cuda" else None)
    blocks = BlockMemory()
    handles = []
    if time_attention:
        for module in rank.model.modules():
            if isinstance(module, ContextParallelAttention):
                handles.append(module.register_forward_pre_hook(timers.pre_forward, with_kwargs=True))
                handles.append(module.register_forward_hook(timers.post_forward, with_kwargs=True))
    for block in rank.model.layers.values():
        # Before FSDP's pre-forward (all-gather) and after its post-forward (reshard).
        handles.append(block.register_forward_pre_hook(blocks.pre, with_kwargs=True, prepend=True))
        handles.append(block.register_forward_hook(blocks.post, with_kwargs=True))
    try:
        for step in range(steps):
            result = train_step(rank, job_config, device, step, fake, timers, blocks)
    finally:
        for handle in handles:
            handle.remove()
    return result
