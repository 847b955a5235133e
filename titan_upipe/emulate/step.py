"""One measured training step of a rank (the trainer's ``train_step`` order), under a ``StepTracker``.

``zero_grad``; the global batch created on the device and sharded in the converted
attention's layout; forward; ``loss = loss_fn(pred, labels) / global_tokens``; ``del pred``;
``backward``; ``clip_grad_norm_`` (foreach); ``optimizer.step()``. The tracker's peak is
read and reset at each phase boundary; block forwards are bracketed by :class:`BlockMemory`,
blocks and attention modules timed by ``timers.BlockTimer`` and ``timers.AttentionTimer``
(:class:`StepHooks` installs all three). :func:`run_steps` runs the compile pass, the warm-up
and the timed steps and returns a ``StepSeries`` of :class:`StepResult` (definitions of every
quantity: the ``titan_upipe.emulate`` docstring).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from titan_upipe.attention import ContextParallelAttention
from titan_upipe.attention.kernel_compiles import compiled_kernels, compiles_between
from titan_upipe.emulate.compile_pass import run_compile_pass
from titan_upipe.emulate.series import StepSeries
from titan_upipe.emulate.timers import AttentionTimer, BlockTimer
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.inputs import prepare_cp_batch
from titan_upipe.toolkit.memory_tracker import StepTracker, storage_bytes
from titan_upipe.toolkit.packed_documents import packed_document_tokens
from titan_upipe.torchtitan_0_2.launched_job import LaunchedJob, launched_job
from titan_upipe.torchtitan_0_2.loss import IGNORE_INDEX
from titan_upipe.torchtitan_0_2.rank_model import TrainingRank
from titan_upipe.torchtitan_common.grad_norm import clip_grad_norm_
from titan_upipe.transforms.offload import OFFLOAD_STATS

Tensor = torch.Tensor

PHASES = ("forward", "backward", "optimizer")
"""The keys of ``phase_peak_bytes`` and ``phase_time_s``."""


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
    keeps_on_device: bool = False
    """The block keeps its attention on the device (``keep_attention``): its kept bytes are in ``delta``."""


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
    retained: list[tuple[float, bool, bool]] = field(default_factory=list)
    """(bytes kept, resident, keeps its attention on the device) per block, settled at the end of forward."""
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
                None if x is None else weakref.ref(x.untyped_storage()), bool(getattr(module, "resident", False)),
                getattr(module, "keep", None) == "device"))

    def clear(self) -> None:
        self.forwards.clear()
        self.retained.clear()

    def settle(self) -> None:
        """At the end of forward (the blocks' inputs are released or kept by now)."""
        for f in self.forwards:
            kept_input = f.input_storage is not None and f.input_storage() is not None
            self.retained.append((f.delta - f.output_bytes + (f.input_bytes if kept_input else 0), f.resident,
                                  f.keeps_on_device))
        self.forwards.clear()

    def retained_per_layer(self) -> float:
        """Mean bytes kept by the blocks a deeper model adds: offloaded ones (the last
        ``resident_blocks`` are resident in any depth), after the first (it also holds FSDP's
        all-gather buffer replacing the (smaller) embedding's one: FSDP keeps the last
        all-gather buffer until the next all-gather) where there is another."""
        pool = self._pool()
        return sum(kept for kept, _ in pool) / len(pool) if pool else 0.0

    def keeping_fraction(self) -> float:
        """Of ``retained_per_layer``'s blocks, the share that keep their attention on the device."""
        pool = self._pool()
        return sum(keeps for _, keeps in pool) / len(pool) if pool else 0.0

    def _pool(self) -> list[tuple[float, bool]]:
        offloaded = [(kept, keeps) for kept, resident, keeps in self.retained if not resident]
        offloaded = offloaded or [(kept, keeps) for kept, _, keeps in self.retained]
        return offloaded[1:] if len(offloaded) > 1 else offloaded


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
    retained_keeping_fraction: float
    """Of the blocks ``retained_bytes_per_layer`` averages, the share that keep their attention on the device."""
    kept_attention_host_bytes: int
    """Of ``host_offload_bytes``, the attention results kept on the host (``keep_attention``)."""
    attention_forward_time_s: float
    attention_backward_time_s: float
    block_forward_time_s: float
    """Inside the transformer blocks' forwards, all blocks (recomputation is backward's)."""
    block_backward_time_s: float
    """Inside the blocks' backwards (recomputation included), all blocks."""
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

    @property
    def blocks_time_s(self) -> float:
        """Inside the transformer blocks, forward and backward, all blocks together."""
        return self.block_forward_time_s + self.block_backward_time_s

    @property
    def optimizer_time_s(self) -> float:
        return self.phase_time_s["optimizer"]


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


def resident_bytes(rank: TrainingRank) -> int:
    """Bytes live between steps: parameters + optimizer state + buffers (gradients zeroed)."""
    return (storage_bytes(rank.params) + storage_bytes(rank.optimizer_tensors())
            + storage_bytes(list(rank.model.buffers())))


def _device_batch(rank: TrainingRank, job_config, device: torch.device, step: int, job: LaunchedJob) -> _Batch:
    """The global batch created on the device (the trainer's host-to-device copy), then this
    rank's shard in the converted attention's layout (``job.cp_mesh``; None without CP) and the
    job's document balance."""
    cp_mesh = job.cp_mesh
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
    batch = prepare_cp_batch(inputs, labels, cp_mesh, eos_id=eos_id, ignore_index=IGNORE_INDEX,
                             document_balance=job.spec.document_balance, document_min_split=job.spec.document_min_split)
    return _Batch(inputs, labels, batch.tokens, batch.labels, batch.model_kwargs())


def _forward_loss(rank: TrainingRank, batch: _Batch, global_tokens: float, hooks: StepHooks) -> torch.Tensor:
    """``loss_fn(model(shard), labels) / global_tokens``; the prediction is freed before backward."""
    hooks.blocks.active = hooks.block_times.active = True
    with rank.amp:
        pred = rank.model(batch.local_inputs, **batch.extra)
        loss = rank.loss_fn(pred, batch.local_labels) / global_tokens
    del pred
    hooks.blocks.active = hooks.block_times.active = False
    hooks.blocks.settle()
    return loss


def train_step(rank: TrainingRank, job_config, device: torch.device, step: int, fake: bool,
               hooks: StepHooks) -> StepResult:
    """One training step under a ``StepTracker``; the trainer's ``train_step`` order."""
    is_cuda = device.type == "cuda"
    sync, blocks = hooks.sync, hooks.blocks
    params = rank.params
    par = rank.parallel_dims
    global_tokens = float(job_config.training.local_batch_size * job_config.training.seq_len
                          * par.dp_shard * par.dp_replicate)
    job = launched_job(job_config, par)  # the CP mesh the converters built (None without CP)
    offload_start, kept_start = OFFLOAD_STATS.host_bytes, OFFLOAD_STATS.kept_attention_bytes

    def offloaded() -> int:
        return OFFLOAD_STATS.host_bytes - offload_start

    def on_host() -> int:  # a prefetched input is on the device from its prefetch on, as on a GPU
        return offloaded() - OFFLOAD_STATS.prefetched_bytes

    rank.optimizers.zero_grad()
    hooks.attention.reset()
    hooks.block_times.reset()
    blocks.clear()
    sync()
    if is_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    baseline = resident_bytes(rank)
    # On CPU the offloaded block inputs are tracked (host == device): subtract them.
    tracker = StepTracker(device.type, on_host if device.type == "cpu" else None)
    blocks.tracker = tracker
    peaks: dict[str, tuple[int, str]] = {}
    with tracker:
        t0 = time.perf_counter()
        batch = _device_batch(rank, job_config, device, step, job)
        loss = _forward_loss(rank, batch, global_tokens, hooks)
        sync()
        t1 = time.perf_counter()
        host_offload = offloaded()
        kept_on_host = OFFLOAD_STATS.kept_attention_bytes - kept_start
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
        retained_keeping_fraction=blocks.keeping_fraction(),
        kept_attention_host_bytes=kept_on_host,
        attention_forward_time_s=hooks.attention.forward_s,
        attention_backward_time_s=hooks.attention.backward_s,
        block_forward_time_s=hooks.block_times.forward_s,
        block_backward_time_s=hooks.block_times.backward_s,
        device_peak_allocated_bytes=torch.cuda.max_memory_allocated(device) if is_cuda else None,
        device_peak_reserved_bytes=torch.cuda.max_memory_reserved(device) if is_cuda else None,
        loss=loss_value,
    )


@dataclass
class StepHooks:
    """The hooks of a measured step: block memory, block times and (optionally) attention times."""

    sync: Callable[[], None]
    blocks: BlockMemory = field(default_factory=BlockMemory)
    block_times: BlockTimer = field(init=False)
    attention: AttentionTimer = field(init=False)
    handles: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.block_times, self.attention = BlockTimer(self.sync), AttentionTimer(self.sync)

    def install(self, model: torch.nn.Module, time_attention: bool) -> None:
        if time_attention:
            for module in model.modules():
                if isinstance(module, ContextParallelAttention):
                    self.handles.append(module.register_forward_pre_hook(self.attention.pre_forward, with_kwargs=True))
                    self.handles.append(module.register_forward_hook(self.attention.post_forward, with_kwargs=True))
        for block in model.layers.values():
            # Memory before FSDP's pre-forward (all-gather) and after its post-forward (reshard);
            # the block's clock inside the memory hooks (their tracker refresh is not block time).
            self.handles.append(block.register_forward_pre_hook(self.block_times.pre_forward, with_kwargs=True,
                                                                prepend=True))
            self.handles.append(block.register_forward_pre_hook(self.blocks.pre, with_kwargs=True, prepend=True))
            self.handles.append(block.register_forward_hook(self.block_times.post_forward, with_kwargs=True))
            self.handles.append(block.register_forward_hook(self.blocks.post, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def run_steps(rank: TrainingRank, job_config, device: torch.device, *, steps: int, warmup_steps: int, fake: bool,
              time_attention: bool, compile_pass: bool, compute_dtype: torch.dtype) -> StepSeries:
    """With ``compile_pass``, the attention kernels' first use (``compile_pass.py``), then ``steps``
    training steps, the first ``warmup_steps`` of them untimed, with the hooks installed; the
    compile counters (``attention.kernel_compiles``) are sampled around the pass, the warm-up
    and the timed steps."""
    hooks = StepHooks(lambda: torch.cuda.synchronize(device) if device.type == "cuda" else None)
    samples = [compiled_kernels()]
    compile_s = None
    if compile_pass:
        compile_s = run_compile_pass(rank.model, job_config.training.local_batch_size, job_config.training.seq_len,
                                     compute_dtype, device, hooks.sync)
    samples.append(compiled_kernels())
    results = []
    hooks.install(rank.model, time_attention)
    try:
        for step in range(steps):
            if step == warmup_steps:
                samples.append(compiled_kernels())
            results.append(train_step(rank, job_config, device, step, fake, hooks))
    finally:
        hooks.remove()
    samples.append(compiled_kernels())
    timed = steps > warmup_steps
    compiles = {"compile_pass": compiles_between(samples[0], samples[1]) if compile_pass else None,
                "warmup_steps": compiles_between(samples[1], samples[2]) if warmup_steps else None,
                "timed_steps": compiles_between(samples[-2], samples[-1]) if timed else None}
    return StepSeries(tuple(results), warmup_steps, compile_s, compiles)
