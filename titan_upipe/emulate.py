"""Rank emulator: one rank of an N-rank context-parallel job, measured in a single process.

``measure_step(job_config, world_size, fake=...)`` builds the configured model for one rank
exactly as TorchTitan's trainer does (train spec, flavor args + ``update_from_config``, meta
device, ``model.converters``, the spec's ``parallelize_fn`` — AC then FSDP —, ``to_empty``,
``init_weights``, the spec's optimizer builder and loss) and runs training steps on a
synthetic batch sharded in the converted attention's layout
(``titan_upipe.parallel.shard_sequence`` on ``titan_upipe.attention.sequence_mesh``).
The same code runs in two situations:

* ``fake=False``: inside a real multi-process job whose default process group the caller
  started (gloo on CPU, nccl on GPU), one call per rank;
* ``fake=True``: in ONE process, on torch's ``fake`` process-group backend
  (``torch.testing._internal.distributed.fake_pg``) with ``world_size`` ranks: every
  collective returns at once and leaves its output buffer as it was (uninitialised memory),
  so this process runs rank ``rank``'s kernels and transforms with correctly shaped tensors
  and no peers. Numerics are meaningless there (weights gathered by FSDP, received Q/K/V
  and the loss are garbage, possibly NaN); only memory and time are measured. On CPU
  denormal flushing is switched on in fake mode so garbage cannot hit the slow denormal path.

What one measured step is (the trainer's ``train_step`` without data loading, logging,
checkpointing and the LR scheduler): ``zero_grad``; forward on this rank's shard;
``loss = loss_fn(pred, labels) / global_tokens``; ``del pred``; ``backward``;
``clip_grad_norm_`` (foreach, as the trainer); ``optimizer.step()``. Before the measured
step(s), the optimizer state is materialised by one optimizer step on all-zero gradients
(no forward/backward), so even ``steps=1`` measures a steady-state step, not the first
step that creates Adam's moments. With ``steps > 1`` the numbers are those of the last step.

Memory (bytes, this rank, identical definition in fake and real runs):

``state_bytes``
    parameters + gradients + optimizer state of this rank (FSDP: the local shards of the
    DTensors), counted by unique storage. Split into ``param_bytes``, ``grad_bytes``
    (measured after backward) and ``optimizer_bytes``; ``buffer_bytes`` are the model
    buffers (the RoPE table: not sharded, not scaled with layers).
``baseline_bytes``
    what is live on the device when the step starts: params + optimizer state + buffers
    (gradients were freed by ``zero_grad``).
``peak_bytes``
    the peak of live tensor bytes *created during the step*, tracked by
    :class:`StepTracker` (a :class:`~titan_upipe.memory_tracker.LiveTensorTracker` that
    accounts DTensors by their local shard, only tensors on the compute device, and
    re-measures storages FSDP2 frees/re-allocates with ``untyped_storage().resize_()``). It
    contains activations, gradients, communication buffers, FSDP's unsharded parameters,
    optimizer temporaries, and the global token batch and its shards (created on the
    device inside the step, as the trainer's host-to-device copy does). On CPU, host and
    device are the same memory: block inputs offloaded by ``activation_checkpoint.cpu_offload``
    are subtracted (``OFFLOAD_STATS``), so the number means what it means on a GPU.
    ``phase_peak_bytes`` gives the same peak per phase: ``forward`` (to the loss),
    ``backward``, ``optimizer`` (clip + step).
``total_peak_bytes``
    ``baseline_bytes + peak_bytes``: the tracked equivalent of ``max_memory_allocated``.
``device_peak_allocated_bytes`` / ``device_peak_reserved_bytes``
    CUDA only: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` after
    ``reset_peak_memory_stats`` at the start of the measured step (absolute, baseline
    included, plus what the tracker cannot see: kernel workspaces, NCCL buffers,
    allocator rounding). None on CPU, where there is no caching allocator.
``host_offload_bytes``
    host memory held by offloaded block inputs at the end of forward (its maximum).
``retained_bytes_per_layer``
    bytes one transformer block leaves alive after its forward (saved activations, its
    output), averaged over the blocks after the first (the first one's also holds FSDP's
    all-gather buffer replacing the embedding's): what each further layer adds to the
    activation peak. With ``n_layers=1`` only the first block exists; use >= 2.

Fewer layers (``n_layers``) run a model with that many blocks; ``full`` holds the
estimate for the configured flavor's layer count, or ``full_layers``
(:func:`extrapolate_layers`, a pure function: state, offloaded host bytes, communication
and time scale with layers; the transient peak inside one block does not; each extra block
adds ``retained_bytes_per_layer`` to the forward/backward peak, or its gradients where
those are larger).

Time (seconds, wall clock; on CUDA with ``synchronize`` at every boundary):
``step_time_s`` and per phase; ``attention_time_s`` is the time spent inside the converted
attention modules (projections, RoPE, all-to-alls, kernel, output projection; forward,
backward and any recomputation; forward timed with module hooks, backward with gradient
hooks on the module's output and input); ``other_compute_time_s = step_time_s -
attention_time_s``. Communication is *modeled*, not measured: the all-to-all bytes of every
converted attention call follow from its head schedule (:func:`attention_comm_bytes`), and
``comm_time_s = a2a wire bytes / a2a_gbps + ring p2p bytes / p2p_gbps`` (GB = 1e9 bytes;
the default 150 GB/s per direction is an NVLink-class all-to-all bandwidth per GPU, e.g. 8x
H100 in one node; the wire bytes of an all-to-all exclude the chunk a rank keeps). In fake
mode the collectives take no time, so ``step_time_s + comm_time_s`` is the modeled step
time (no overlap assumed: the all-to-alls block the compute stream). In a real run the
measured times already contain the communication. FSDP's all-gather/reduce-scatter are
not modeled (they overlap compute in TorchTitan). Under activation checkpointing the
forward's all-to-alls run again in backward (``recompute_fraction``).

API (stable; the memory planner compares against it)::

    m = measure_step(job_config, world_size, fake=True, n_layers=2)   # -> StepMeasurement
    m.total_peak_bytes, m.peak_bytes, m.phase_peak_bytes, m.state_bytes, m.host_offload_bytes
    m.full.total_peak_bytes            # the same, extrapolated to the full depth
    m.to_dict()                        # JSON-ready (what scripts/emulate_rank.py --json prints)

A fake measurement needs a process without a default process group (it starts and ends a
fake one); run it in a subprocess where other code uses ``torch.distributed``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from titan_upipe.memory_tracker import LiveTensorTracker, plain_tensors

GB = 1e9
DEFAULT_A2A_GBPS = 150.0
PHASES = ("forward", "backward", "optimizer")
"""The keys of ``phase_peak_bytes`` and ``phase_time_s``."""


# --------------------------------------------------------------------------- memory tracking


class StepTracker(LiveTensorTracker):
    """``LiveTensorTracker`` for a training step of a sharded model.

    * Wrapper subclasses (DTensor) are accounted by their local tensors, as in the base class.
    * Storages resized in place without an op (FSDP2 frees and re-allocates unsharded
      parameters and all-gather buffers with ``untyped_storage().resize_()``, which no
      dispatch mode sees) are re-measured: those an op touches, at that op; all of them
      before a new peak is recorded and when ``refresh()`` is called.
    * Only tensors on ``device_type`` are accounted (on CUDA the host copies of offloaded
      activations and CPU scalars are not device memory).
    * ``host_bytes()`` (bytes of tracked tensors that are really host memory, i.e. offloaded
      block inputs on CPU) is subtracted from every reading.
    """

    def __init__(self, device_type: str, host_bytes: Callable[[], int] | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.host_bytes = host_bytes or (lambda: 0)
        self.device_peak = 0
        self.device_peak_op = ""

    def _resync(self, keys) -> None:
        """Re-read the sizes of these tracked storages. The storages are fetched under the lock
        but measured, and let go, outside it: dropping the last reference runs ``_release``,
        which takes the (non-reentrant) lock."""
        found, alive = [], None
        with self._lock:
            for key in keys:
                entry = self._storages.get(key)
                alive = entry.finalizer.peek() if entry is not None else None
                if alive is not None:
                    found.append((key, alive[0]))
            del alive
        sizes = [(key, storage.nbytes()) for key, storage in found]
        del found
        with self._lock:
            for key, nbytes in sizes:
                entry = self._storages.get(key)
                if entry is not None and entry.nbytes != nbytes:
                    self.current_bytes += nbytes - entry.nbytes
                    entry.nbytes = nbytes

    def refresh(self) -> None:
        """Re-measure every tracked storage (sizes changed by ``resize_`` outside any op)."""
        with self._lock:
            keys = list(self._storages)
        self._resync(keys)

    def device_bytes(self) -> int:
        return self.current_bytes - self.host_bytes()

    def reset_peak(self) -> None:
        self.refresh()
        super().reset_peak()
        self.device_peak, self.device_peak_op = self.device_bytes(), "reset"

    @property
    def peak_bytes(self) -> int:
        return self.device_peak

    def _account(self, t: torch.Tensor, op: str, input_storages: frozenset[int] = frozenset()) -> None:
        super()._account(t, op, input_storages)
        if self.device_bytes() > self.device_peak:
            self.refresh()  # a storage freed by resize_(0) since the last op must not set a peak
            if self.device_bytes() > self.device_peak:
                self.device_peak, self.device_peak_op = self.device_bytes(), op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [plain for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)
                  for plain in plain_tensors(leaf) if plain.device.type != "meta"]
        input_storages = frozenset(plain.untyped_storage()._cdata for plain in inputs)
        self._resync(input_storages)  # re-allocated by resize_ before this op used them
        out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                for plain in plain_tensors(leaf):
                    if plain.device.type == self.device_type:
                        self._account(plain, name, input_storages)
        return out


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        for plain in plain_tensors(t):
            if plain.device.type == "meta":
                continue
            storage = plain.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


# --------------------------------------------------------------------------- communication model


@dataclass(frozen=True)
class CommBytes:
    """Bytes one rank sends in one converted attention call (one layer), per pass."""

    a2a_forward: int = 0
    """All-to-all send-buffer bytes of the forward (including the chunk the rank keeps)."""
    a2a_backward: int = 0
    p2p_forward: int = 0
    """Ring attention point-to-point bytes (K/V blocks) of the forward."""
    p2p_backward: int = 0
    """Ring backward: K/V blocks again plus the fp32 dK/dV blocks that travel back."""
    ulysses_degree: int = 1

    def a2a_wire(self, a2a_bytes: float) -> float:
        """Of an all-to-all's send bytes, those that leave the rank ((C-1)/C of them)."""
        c = self.ulysses_degree
        return a2a_bytes * (c - 1) / c

    def per_step(self, n_layers: int, recompute_fraction: float) -> dict[str, float]:
        """Send bytes of one training step: forward, its recomputation under activation
        checkpointing (``recompute_fraction`` of the layers), backward."""
        fwd = 1.0 + recompute_fraction
        a2a = n_layers * (fwd * self.a2a_forward + self.a2a_backward)
        p2p = n_layers * (fwd * self.p2p_forward + self.p2p_backward)
        return {"a2a_bytes": a2a, "a2a_wire_bytes": self.a2a_wire(a2a), "p2p_bytes": p2p}


def attention_comm_bytes(schedule, mode: str, ring_degree: int, batch: int, local_len: int, head_dim: int,
                         elem_size: int, ulysses_rank: int = 0) -> CommBytes:
    """Bytes exchanged by one converted attention call, from its head schedule.

    ``schedule``: the module's :class:`~titan_upipe.attention.HeadSchedule` (its
    ``cp_degree`` is the Ulysses degree C); ``local_len`` the tokens of this rank (L = S/CP).
    Every all-to-all buffer is ``[C, L, B, h, D]`` (h heads per destination rank).

    * Ulysses (``ulysses``/``usp``; ``ring`` has C = 1 and no all-to-all): Q, K, V and the
      output forward; their gradients backward. K/V carry each destination's KV heads
      (replicated when C > KV).
    * UPipe, per stage: Q and the output forward, plus K and V when the stage starts a new
      KV group; backward: Q (recomputed), output, dOutput, dQ, plus per KV group K and V
      again and dK, dV back.
    * Ring (``ring_degree`` R > 1; zigzag, ``ring.py``): per ring call the packed K/V block
      ``[2, B, h_kv, S/R, D]`` makes R-1 hops forward and R-1 backward, and the fp32 dK/dV
      block R hops. Ulysses/USP make one ring call per layer, UPipe one per stage.
    """
    c = schedule.cp_degree
    b, seq, d, es = batch, local_len, head_dim, elem_size
    a2a_f = a2a_b = 0
    ring_calls: list[int] = []  # K/V heads of each ring call
    if mode == "upipe":
        hq = schedule.query_heads_per_rank
        for stage in schedule.stages:
            q_bytes = c * seq * b * hq * d * es
            a2a_f += 2 * q_bytes
            a2a_b += 4 * q_bytes
            if stage.sends_kv:
                kv_bytes = c * seq * b * len(stage.kv_heads_per_rank[0]) * d * es
                a2a_f += 2 * kv_bytes
                a2a_b += 4 * kv_bytes
            index = stage.local_kv_index(ulysses_rank, schedule.n_rep)
            ring_calls.append(hq if index is not None else len(stage.kv_heads_per_rank[ulysses_rank]))
    else:
        (stage,) = schedule.stages
        if c > 1:
            q_bytes = seq * b * schedule.n_heads * d * es
            kv_bytes = seq * b * sum(len(run) for run in stage.kv_heads_per_rank) * d * es
            a2a_f = a2a_b = 2 * q_bytes + 2 * kv_bytes
        ring_calls.append(len(stage.kv_heads_per_rank[ulysses_rank]))
    p2p_f = p2p_b = 0
    if ring_degree > 1:
        ring_seq = seq * c  # tokens of the ring-local sequence after the Ulysses all-to-all
        for h_kv in ring_calls:
            block = 2 * b * h_kv * ring_seq * d
            p2p_f += (ring_degree - 1) * block * es
            p2p_b += (ring_degree - 1) * block * es + ring_degree * block * 4
    return CommBytes(a2a_f, a2a_b, p2p_f, p2p_b, c)


def recompute_fraction(ac_config) -> float:
    """Fraction of the layers whose forward runs again in backward under the AC config.
    Selective per-op AC is counted as recomputing the attention (its collectives and the
    UPipe/Ulysses autograd functions are not in TorchTitan's save list)."""
    mode = ac_config.mode
    if mode == "none":
        return 0.0
    if mode == "selective":
        option = str(ac_config.selective_ac_option)
        return 1.0 / int(option) if option.isdigit() and int(option) > 0 else 1.0
    return 1.0


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class FullModelEstimate:
    """A measurement with fewer layers, extrapolated to ``n_layers`` (see ``extrapolate_layers``)."""

    n_layers: int
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    state_bytes: float
    baseline_bytes: float
    phase_peak_bytes: dict[str, float]
    peak_bytes: float
    total_peak_bytes: float
    host_offload_bytes: float
    device_peak_allocated_bytes: float | None
    device_peak_reserved_bytes: float | None
    a2a_bytes: float
    a2a_wire_bytes: float
    p2p_bytes: float
    comm_time_s: float
    attention_time_s: float
    other_compute_time_s: float
    step_time_s: float
    """Measured compute time scaled to the layer count (embedding/head/loss scaled too: an
    upper bound, small next to the blocks at long context)."""
    modeled_step_time_s: float
    """``step_time_s + comm_time_s``."""


@dataclass(frozen=True)
class StepMeasurement:
    """One emulated (or real) rank's training step. Bytes are per rank; see the module docstring."""

    config: str
    model: str
    flavor: str
    cp_mode: str | None
    world_size: int
    cp_degree: int
    dp_shard: int
    ulysses_degree: int
    ring_degree: int
    heads_per_stage: int | None
    seq_len: int
    batch: int
    local_tokens: int
    n_layers: int
    """Blocks in the measured model."""
    n_layers_full: int
    """Blocks of the configured flavor (or ``full_layers``): the depth ``full`` estimates."""
    fake: bool
    rank: int
    device: str
    param_dtype: str
    activation_checkpoint: str
    steps: int
    # memory
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    state_bytes: int
    layer_param_bytes: int
    layer_grad_bytes: int
    layer_optimizer_bytes: int
    baseline_bytes: int
    peak_bytes: int
    phase_peak_bytes: dict[str, int]
    peak_op: str
    total_peak_bytes: int
    end_bytes: int
    """Tracked bytes still live at the end of the step (the gradients, mostly)."""
    retained_bytes_per_layer: float
    host_offload_bytes: int
    device_peak_allocated_bytes: int | None
    device_peak_reserved_bytes: int | None
    device_total_bytes: int | None
    """CUDA: the device's memory (``total_memory``); None on CPU."""
    # time
    step_time_s: float
    phase_time_s: dict[str, float]
    attention_time_s: float
    attention_forward_time_s: float
    attention_backward_time_s: float
    other_compute_time_s: float
    # communication (modeled)
    a2a_bytes: float
    a2a_wire_bytes: float
    p2p_bytes: float
    a2a_gbps: float
    p2p_gbps: float
    comm_time_s: float
    loss: float | None
    """The real run's loss (None in fake mode, where it is garbage)."""
    full: FullModelEstimate

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def extrapolate_layers(
    *,
    n_measured: int,
    n_full: int,
    param_bytes: float,
    grad_bytes: float,
    optimizer_bytes: float,
    layer_param_bytes: float,
    layer_grad_bytes: float,
    layer_optimizer_bytes: float,
    buffer_bytes: float,
    phase_peak_bytes: dict[str, float],
    retained_bytes_per_layer: float,
    host_offload_bytes: float,
    device_peak_allocated_bytes: float | None = None,
    device_peak_reserved_bytes: float | None = None,
    a2a_bytes: float = 0.0,
    a2a_wire_bytes: float = 0.0,
    p2p_bytes: float = 0.0,
    comm_time_s: float = 0.0,
    attention_time_s: float = 0.0,
    other_compute_time_s: float = 0.0,
) -> FullModelEstimate:
    """Scale a measurement of ``n_measured`` blocks to ``n_full`` blocks (pure arithmetic).

    * State (params, grads, optimizer): the blocks' part scales by ``n_full / n_measured``,
      the rest (embedding, final norm, head) and the buffers stay.
    * Forward peak: + ``retained_bytes_per_layer`` per extra block (their saved activations
      are all live at the end of forward). Backward peak: + per extra block the larger of
      its retained activations and its gradients (live bytes in backward are the blocks
      not yet backpropagated plus the gradients of those done, maximal at an end).
    * Optimizer peak: the gradients scaled as state, the optimizer's temporaries (foreach
      over all parameters) scaled with the parameter bytes.
    * Offloaded host bytes, communication, attention and other compute time: proportional.
    * CUDA allocated/reserved: measured + the change of the tracked total peak.
    """
    if n_measured < 1 or n_full < 1:
        raise ValueError(f"layer counts must be positive, got {n_measured} measured, {n_full} full")
    r = n_full / n_measured
    extra = n_full - n_measured

    def scaled(total: float, layer_part: float) -> float:
        return total - layer_part + layer_part * r

    params = scaled(param_bytes, layer_param_bytes)
    grads = scaled(grad_bytes, layer_grad_bytes)
    optim = scaled(optimizer_bytes, layer_optimizer_bytes)
    grad_per_layer = layer_grad_bytes / n_measured
    peaks: dict[str, float] = {}
    if "forward" in phase_peak_bytes:
        peaks["forward"] = phase_peak_bytes["forward"] + extra * retained_bytes_per_layer
    if "backward" in phase_peak_bytes:
        peaks["backward"] = phase_peak_bytes["backward"] + extra * max(retained_bytes_per_layer, grad_per_layer)
    if "optimizer" in phase_peak_bytes:
        temporaries = max(phase_peak_bytes["optimizer"] - grad_bytes, 0.0)
        param_ratio = params / param_bytes if param_bytes else r
        peaks["optimizer"] = grads + temporaries * param_ratio
    peak = max(peaks.values(), default=0.0)
    baseline = params + optim + buffer_bytes
    measured_total = param_bytes + optimizer_bytes + buffer_bytes + max(phase_peak_bytes.values(), default=0.0)
    delta = baseline + peak - measured_total
    attention, other = attention_time_s * r, other_compute_time_s * r
    comm = comm_time_s * r
    return FullModelEstimate(
        n_layers=n_full,
        param_bytes=params,
        grad_bytes=grads,
        optimizer_bytes=optim,
        state_bytes=params + grads + optim,
        baseline_bytes=baseline,
        phase_peak_bytes=peaks,
        peak_bytes=peak,
        total_peak_bytes=baseline + peak,
        host_offload_bytes=host_offload_bytes * r,
        device_peak_allocated_bytes=None if device_peak_allocated_bytes is None else device_peak_allocated_bytes + delta,
        device_peak_reserved_bytes=None if device_peak_reserved_bytes is None else device_peak_reserved_bytes + delta,
        a2a_bytes=a2a_bytes * r,
        a2a_wire_bytes=a2a_wire_bytes * r,
        p2p_bytes=p2p_bytes * r,
        comm_time_s=comm,
        attention_time_s=attention,
        other_compute_time_s=other,
        step_time_s=attention + other,
        modeled_step_time_s=attention + other + comm,
    )


# --------------------------------------------------------------------------- the step


@dataclass
class _Timers:
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
class _BlockMemory:
    """Tracked bytes before and after each block's forward (outside recomputation)."""

    tracker: StepTracker | None = None
    active: bool = False
    deltas: list[int] = field(default_factory=list)
    _before: dict[int, int] = field(default_factory=dict)

    def pre(self, module, args, kwargs):
        if self.active and self.tracker is not None:
            self.tracker.refresh()
            self._before[id(module)] = self.tracker.device_bytes()

    def post(self, module, args, kwargs, output):
        if self.active and self.tracker is not None and id(module) in self._before:
            self.tracker.refresh()
            self.deltas.append(self.tracker.device_bytes() - self._before.pop(id(module)))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextmanager
def _process_group(world_size: int, fake: bool, rank: int, device: torch.device) -> Iterator[None]:
    """The default process group for the measurement; a fake one is started (and ended) here."""
    if not fake:
        if not dist.is_initialized():
            raise RuntimeError("measure_step(fake=False) runs inside a multi-process job: initialise the default "
                               "process group first (or use fake=True)")
        if dist.get_world_size() != world_size:
            raise RuntimeError(f"the default process group has {dist.get_world_size()} ranks, not {world_size}")
        yield
        return
    if dist.is_initialized():
        if dist.get_backend() != "fake" or dist.get_world_size() != world_size:
            raise RuntimeError("measure_step(fake=True) needs its own process: a non-fake default process group "
                               f"(backend {dist.get_backend()!r}, {dist.get_world_size()} ranks) is already running")
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    flush = torch.set_flush_denormal(True) if device.type == "cpu" else False
    try:
        yield
    finally:
        if flush:
            torch.set_flush_denormal(False)
        dist.destroy_process_group()


def _device() -> torch.device:
    import os

    from torchtitan.tools.utils import device_type

    if device_type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _dp_shard(parallelism, world_size: int) -> int:
    shard = parallelism.data_parallel_shard_degree
    if shard == -1:
        shard = world_size // (parallelism.context_parallel_degree * parallelism.data_parallel_replicate_degree)
    return shard


def _is_layer(name: str) -> bool:
    return name.startswith("layers.") or ".layers." in name


def measure_step(
    job_config,
    world_size: int,
    *,
    fake: bool,
    n_layers: int | None = None,
    steps: int = 1,
    rank: int = 0,
    a2a_gbps: float = DEFAULT_A2A_GBPS,
    p2p_gbps: float | None = None,
    time_attention: bool = True,
    full_layers: int | None = None,
) -> StepMeasurement:
    """Build the configured model for one rank of a ``world_size``-rank job and measure
    ``steps`` training steps (the last one is reported). See the module docstring for what
    is measured.

    ``fake``: False inside a real job (the default process group has ``world_size`` ranks);
    True to emulate rank ``rank`` in this process on the fake backend (started and ended
    here; the process must not have another default process group).
    ``n_layers``: build this many blocks instead of the flavor's (``full`` extrapolates).
    ``a2a_gbps``/``p2p_gbps``: bandwidths (GB/s per direction) of the modeled communication.
    ``time_attention``: hook the attention modules for the time split (synchronises CUDA
    at every attention boundary; off leaves ``attention_*`` at 0).
    ``full_layers``: the depth ``full`` extrapolates to (default: the flavor's ``n_layers``).
    """
    from titan_upipe.validation import check_job

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    check_job(job_config, world_size)
    device = _device()
    if fake and not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of the {world_size} ranks")
    with _process_group(world_size, fake, rank, device):
        return _measure(job_config, world_size, fake=fake, n_layers=n_layers, steps=steps, device=device,
                        a2a_gbps=a2a_gbps, p2p_gbps=p2p_gbps if p2p_gbps is not None else a2a_gbps,
                        time_attention=time_attention, full_layers=full_layers)


@dataclass
class _Rank:
    """The model, optimizer and loss of one rank, built as TorchTitan's trainer builds them."""

    model: torch.nn.Module
    optimizers: Any
    loss_fn: Callable
    amp: Any
    parallel_dims: Any
    n_layers: int
    n_layers_full: int
    vocab_size: int
    names: dict[int, str]

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def layer_ids(self) -> set[int]:
        return {id(p) for p in self.params if _is_layer(self.names[id(p)])}


def _build_rank(job_config, world_size: int, device: torch.device, n_layers: int | None) -> _Rank:
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec

    from titan_upipe.specs import flavor_args

    par = job_config.parallelism
    parallel_dims = ParallelDims(dp_shard=_dp_shard(par, world_size), dp_replicate=par.data_parallel_replicate_degree,
                                 cp=par.context_parallel_degree, tp=1, pp=1, ep=1, etp=1, world_size=world_size)
    parallel_dims.build_mesh()
    spec = get_train_spec(job_config.model.name)
    args = flavor_args(job_config)
    n_full = args.n_layers
    if n_layers is not None:
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        args.n_layers = n_layers
    with torch.device("meta"):
        model = spec.model_cls(args)
    build_model_converters(job_config, parallel_dims).convert(model)
    model = spec.parallelize_fn(model, parallel_dims, job_config)
    model.to_empty(device=device)
    torch.manual_seed(job_config.debug.seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = spec.build_optimizers_fn([model], job_config.optimizer, parallel_dims)
    try:
        loss_fn = spec.build_loss_fn(job_config, parallel_dims=parallel_dims)
    except TypeError:  # a loss builder without the trainer's keyword
        loss_fn = spec.build_loss_fn(job_config)
    amp = dist_utils.maybe_enable_amp(parallel_dims, job_config.training.mixed_precision_param, device.type)
    names = {id(p): name for name, p in model.named_parameters()}
    return _Rank(model, optimizers, loss_fn, amp, parallel_dims, args.n_layers, n_full, args.vocab_size, names)


def _materialize_optimizer_state(rank: _Rank) -> None:
    """Adam's moments exist before a steady-state step: one optimizer step on zero gradients."""
    for p in rank.params:
        p.grad = torch.zeros_like(p)
    rank.optimizers.step()
    rank.optimizers.zero_grad()


def _optimizer_tensors(optimizers, only: set[int] | None = None) -> list[torch.Tensor]:
    """Tensors of the optimizers' state (per-parameter; ``only``: of these parameter ids)."""
    tensors: list[torch.Tensor] = []
    for optimizer in getattr(optimizers, "optimizers", [optimizers]):
        for param, state in optimizer.state.items():
            if only is None or id(param) in only:
                tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


def _train_step(rank: _Rank, job_config, device: torch.device, step: int, fake: bool, timers: _Timers,
                blocks: _BlockMemory) -> dict[str, Any]:
    """One training step under a ``StepTracker``; the trainer's ``train_step`` order."""
    from torchtitan.distributed import utils as dist_utils

    from titan_upipe.attention import sequence_mesh
    from titan_upipe.parallel import shard_sequence
    from titan_upipe.transforms.offload import OFFLOAD_STATS

    is_cuda = device.type == "cuda"
    sync = timers.sync
    params = rank.params
    seq, batch = job_config.training.seq_len, job_config.training.local_batch_size
    global_tokens = float(batch * seq * rank.parallel_dims.dp_shard * rank.parallel_dims.dp_replicate)
    cp_mesh = sequence_mesh(rank.model) if rank.parallel_dims.cp_enabled else None
    offload_start = OFFLOAD_STATS.host_bytes

    def offloaded() -> int:
        return OFFLOAD_STATS.host_bytes - offload_start

    rank.optimizers.zero_grad()
    timers.forward_s = timers.backward_s = 0.0
    blocks.deltas.clear()
    sync()
    if is_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    baseline = (storage_bytes(params) + storage_bytes(_optimizer_tensors(rank.optimizers))
                + storage_bytes(list(rank.model.buffers())))
    # On CPU the offloaded block inputs are tracked (host == device): subtract them.
    tracker = StepTracker(device.type, offloaded if device.type == "cpu" else None)
    blocks.tracker = tracker
    peaks: dict[str, tuple[int, str]] = {}
    with tracker:
        t0 = time.perf_counter()
        # The global batch on the device (the trainer's host-to-device copy), then this rank's
        # shard in the converted attention's layout.
        generator = torch.Generator(device=device).manual_seed(job_config.debug.seed + step)
        inputs = torch.randint(0, rank.vocab_size, (batch, seq), device=device, generator=generator)
        labels = torch.randint(0, rank.vocab_size, (batch, seq), device=device, generator=generator)
        if cp_mesh is not None:
            local_inputs, positions = shard_sequence(inputs, cp_mesh, seq_dim=1)
            local_labels, _ = shard_sequence(labels, cp_mesh, seq_dim=1)
            extra = {"positions": positions}
        else:
            local_inputs, local_labels, extra = inputs, labels, {}
        blocks.active = True
        with rank.amp:
            pred = rank.model(local_inputs, **extra)
            loss = rank.loss_fn(pred, local_labels) / global_tokens
        del pred
        blocks.active = False
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
        grads = [p.grad for p in params if p.grad is not None]
        layer_ids = rank.layer_ids()
        grad_bytes = storage_bytes(grads)
        layer_grad_bytes = storage_bytes(p.grad for p in params if p.grad is not None and id(p) in layer_ids)
        dist_utils.clip_grad_norm_(params, job_config.training.max_norm, foreach=True, pp_mesh=None,
                                   ep_enabled=False)
        rank.optimizers.step()
        sync()
        t3 = time.perf_counter()
        peaks["optimizer"] = (tracker.peak_bytes, tracker.device_peak_op)
        tracker.refresh()
        end_bytes = tracker.device_bytes()
        loss_value = None if fake else float(loss.detach().float().item())
        del loss, inputs, labels, local_inputs, local_labels, extra, grads
    blocks.tracker = None
    # The first block's delta also holds FSDP's all-gather buffer replacing the (smaller)
    # embedding's one (FSDP keeps the last all-gather buffer until the next all-gather).
    deltas = blocks.deltas[1:] if len(blocks.deltas) > 1 else blocks.deltas
    return {
        "baseline": baseline,
        "phase_peaks": {phase: value for phase, (value, _) in peaks.items()},
        "peak_op": max(peaks.values())[1],
        "phase_times": {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2},
        "grad_bytes": grad_bytes,
        "layer_grad_bytes": layer_grad_bytes,
        "end_bytes": end_bytes,
        "host_offload": host_offload,
        "loss": loss_value,
        "retained": sum(deltas) / len(deltas) if deltas else 0.0,
        "attention_forward": timers.forward_s,
        "attention_backward": timers.backward_s,
        "device_alloc": torch.cuda.max_memory_allocated(device) if is_cuda else None,
        "device_reserved": torch.cuda.max_memory_reserved(device) if is_cuda else None,
    }


def _modeled_comm(job_config, model: torch.nn.Module, elem_size: int) -> tuple[dict[str, float], Any]:
    """Step communication bytes of all converted attention modules, and the first module."""
    from titan_upipe.attention import ContextParallelAttention
    from titan_upipe.parallel.mesh import ulysses_part

    modules = [m for m in model.modules() if isinstance(m, ContextParallelAttention)]
    if not modules:
        return {"a2a_bytes": 0.0, "a2a_wire_bytes": 0.0, "p2p_bytes": 0.0}, None
    module = modules[0]
    local_len = job_config.training.seq_len // module.cp_degree
    _, ulysses_rank, _ = ulysses_part(module.cp_mesh)
    per_call = attention_comm_bytes(module.schedule, module.mode, module.ring_degree,
                                    job_config.training.local_batch_size, local_len, module.head_dim, elem_size,
                                    ulysses_rank)
    return per_call.per_step(len(modules), recompute_fraction(job_config.activation_checkpoint)), module


def _measure(job_config, world_size: int, *, fake: bool, n_layers: int | None, steps: int, device: torch.device,
             a2a_gbps: float, p2p_gbps: float, time_attention: bool, full_layers: int | None) -> StepMeasurement:
    from torchtitan.config import TORCH_DTYPE_MAP

    from titan_upipe.attention import ContextParallelAttention
    from titan_upipe.validation import cp_mode

    rank = _build_rank(job_config, world_size, device, n_layers)
    if full_layers is not None:
        rank.n_layers_full = full_layers
    _materialize_optimizer_state(rank)
    timers = _Timers(lambda: torch.cuda.synchronize(device) if device.type == "cuda" else None)
    blocks = _BlockMemory()
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
            result = _train_step(rank, job_config, device, step, fake, timers, blocks)
    finally:
        for handle in handles:
            handle.remove()

    params, optimizers = rank.params, rank.optimizers
    layer_ids = rank.layer_ids()
    param_bytes = storage_bytes(params)
    optimizer_bytes = storage_bytes(_optimizer_tensors(optimizers))
    buffer_bytes = storage_bytes(list(rank.model.buffers()))
    layer_param_bytes = storage_bytes(p for p in params if id(p) in layer_ids)
    layer_optimizer_bytes = storage_bytes(_optimizer_tensors(optimizers, only=layer_ids))
    grad_bytes = result["grad_bytes"]
    phase_peaks = result["phase_peaks"]
    peak = max(phase_peaks.values())

    # Activations (and so the all-to-all buffers) are in the parameter dtype: FSDP's
    # mixed precision, or autocast without FSDP.
    param_dtype = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
    comm, module = _modeled_comm(job_config, rank.model, torch.empty((), dtype=param_dtype).element_size())
    comm_time = comm["a2a_wire_bytes"] / (a2a_gbps * GB) + comm["p2p_bytes"] / (p2p_gbps * GB)
    attention_time = result["attention_forward"] + result["attention_backward"]
    step_time = sum(result["phase_times"].values())
    full = extrapolate_layers(
        n_measured=rank.n_layers, n_full=rank.n_layers_full, param_bytes=param_bytes, grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes, layer_param_bytes=layer_param_bytes,
        layer_grad_bytes=result["layer_grad_bytes"], layer_optimizer_bytes=layer_optimizer_bytes,
        buffer_bytes=buffer_bytes, phase_peak_bytes=phase_peaks, retained_bytes_per_layer=result["retained"],
        host_offload_bytes=result["host_offload"], device_peak_allocated_bytes=result["device_alloc"],
        device_peak_reserved_bytes=result["device_reserved"], a2a_bytes=comm["a2a_bytes"],
        a2a_wire_bytes=comm["a2a_wire_bytes"], p2p_bytes=comm["p2p_bytes"], comm_time_s=comm_time,
        attention_time_s=attention_time, other_compute_time_s=step_time - attention_time,
    )
    par, ac = job_config.parallelism, job_config.activation_checkpoint
    is_cuda = device.type == "cuda"
    return StepMeasurement(
        config=str(job_config.job.config_file), model=job_config.model.name, flavor=job_config.model.flavor,
        cp_mode=cp_mode(job_config.model.converters), world_size=world_size, cp_degree=par.context_parallel_degree,
        dp_shard=rank.parallel_dims.dp_shard, ulysses_degree=module.ulysses_degree if module else 1,
        ring_degree=module.ring_degree if module else 1,
        heads_per_stage=module.heads_per_stage if module is not None and module.mode == "upipe" else None,
        seq_len=job_config.training.seq_len, batch=job_config.training.local_batch_size,
        local_tokens=job_config.training.local_batch_size * job_config.training.seq_len // par.context_parallel_degree,
        n_layers=rank.n_layers, n_layers_full=rank.n_layers_full, fake=fake, rank=dist.get_rank(),
        device=str(device), param_dtype=_dtype_name(param_dtype),
        activation_checkpoint=ac.mode + (" + cpu offload" if getattr(ac, "cpu_offload", False) else ""),
        steps=steps, param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes,
        buffer_bytes=buffer_bytes, state_bytes=param_bytes + grad_bytes + optimizer_bytes,
        layer_param_bytes=layer_param_bytes, layer_grad_bytes=result["layer_grad_bytes"],
        layer_optimizer_bytes=layer_optimizer_bytes, baseline_bytes=result["baseline"], peak_bytes=peak,
        phase_peak_bytes=phase_peaks, peak_op=result["peak_op"], total_peak_bytes=result["baseline"] + peak,
        end_bytes=result["end_bytes"], retained_bytes_per_layer=result["retained"],
        host_offload_bytes=result["host_offload"], device_peak_allocated_bytes=result["device_alloc"],
        device_peak_reserved_bytes=result["device_reserved"],
        device_total_bytes=torch.cuda.get_device_properties(device).total_memory if is_cuda else None,
        step_time_s=step_time, phase_time_s=result["phase_times"], attention_time_s=attention_time,
        attention_forward_time_s=result["attention_forward"], attention_backward_time_s=result["attention_backward"],
        other_compute_time_s=step_time - attention_time, a2a_bytes=comm["a2a_bytes"],
        a2a_wire_bytes=comm["a2a_wire_bytes"], p2p_bytes=comm["p2p_bytes"], a2a_gbps=a2a_gbps, p2p_gbps=p2p_gbps,
        comm_time_s=comm_time, loss=result["loss"], full=full,
    )
