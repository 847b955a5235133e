"""``measure_step``: build one rank, run its training steps, report a ``StepMeasurement``.

Memory and time come from the reported step of the series (``step.py``, ``series.py``: the
median timed step after the warm-up), the state from the rank's storages after the steps,
communication from the converted attention's head schedule (``titan_upipe.costs.attention_comm``),
and the full-depth estimate from ``extrapolate_layers``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from titan_upipe.attention import ContextParallelAttention
from titan_upipe.attention.kernel_compiles import uncounted_compilers
from titan_upipe.costs.attention_comm import attention_comm_bytes, recompute_fraction
from titan_upipe.costs.tsp_comm import layer_comm_bytes
from titan_upipe.costs.tsp_comm import step_bytes as tsp_step_bytes
from titan_upipe.emulate.extrapolate import (
    FullModelEstimate,
    KeptBlocks,
    StateBytes,
    StepCosts,
    StepPeaks,
    StepTimes,
    extrapolate_layers,
)
from titan_upipe.emulate.series import StepSeries
from titan_upipe.emulate.step import StepResult, run_steps
from titan_upipe.parallel.mesh import ulysses_part
from titan_upipe.spec.cp_layout import cp_mode
from titan_upipe.spec.keep_attention import NO_KEEP, kept_attention_bytes
from titan_upipe.toolkit.memory_tracker import storage_bytes
from titan_upipe.torchtitan_0_2.checks import check_job
from titan_upipe.torchtitan_0_2.checks.keep_attention import known_keep_attention_plan
from titan_upipe.torchtitan_0_2.config import (
    ActivationCheckpointOffload,
    plugin_fields,
)
from titan_upipe.torchtitan_0_2.job_plan import size_keep_attention_of_job
from titan_upipe.torchtitan_0_2.memory_guard import check_memory_fits, free_machine_memory, local_ranks
from titan_upipe.torchtitan_0_2.rank_model import (
    TrainingRank,
    build_training_rank,
    param_dtype_of,
    rank_device,
)
from titan_upipe.torchtitan_0_2.registry import register_plugin
from titan_upipe.tsp.modules import TSPAttention

GB = 1e9
DEFAULT_A2A_GBPS = 150.0
"""The modeled all-to-all bandwidth per rank and direction: NVLink-class (8 GPUs in one node)."""


@dataclass(frozen=True)
class StepMeasurement:
    """One emulated (or real) rank's training step. Bytes are per rank; see the package docstring."""

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
    documents: bool
    """``block_causal``: the steps ran packed documents under their document mask."""
    fake: bool
    rank: int
    device: str
    param_dtype: str
    activation_checkpoint: str
    steps: int
    """Steps run, warm-up included."""
    warmup_steps: int
    warm: bool
    """At least one untimed warm-up step ran before the reported (timed) step: its times are a
    steady state. False with ``steps <= warmup_steps``: the reported step is the last, first
    uses (kernel compilation, library set-up) included; no throughput should be read from it."""
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
    # time (the reported step)
    step_time_s: float
    phase_time_s: dict[str, float]
    attention_time_s: float
    attention_forward_time_s: float
    attention_backward_time_s: float
    other_compute_time_s: float
    block_forward_time_s: float
    block_backward_time_s: float
    block_time_s: float
    """One block's forward + backward: the mean of the measured blocks."""
    first_step_time_s: float
    step_times_s: list[float]
    """Each timed step's total, in order (empty without a timed step)."""
    median_step_time_s: float | None
    """The reported step's total (the median timed step); None without a timed step."""
    compile_s: float | None
    """Wall time of the attention kernels' first use before step 1 (``compile_pass.py``); None: not run."""
    kernel_compiles: dict[str, int | None]
    """Kernels compiled in the compile pass, the warm-up and the timed steps (``attention.kernel_compiles``)."""
    kernel_compiles_during_timed_steps: int | None
    """Kernels compiled while the steps were timed: 0 in an honest measurement; None where not
    countable or no step was timed."""
    kernel_compiles_uncounted: list[str]
    """Loaded compilers whose kernels are not counted."""
    # communication (modeled)
    a2a_bytes: float
    a2a_wire_bytes: float
    p2p_bytes: float
    a2a_gbps: float
    p2p_gbps: float
    comm_time_s: float
    second_a2a_gbps: float | None
    """A second all-to-all bandwidth (``--a2a-gbps``), None where none was given."""
    second_comm_time_s: float | None
    loss: float | None
    """The real run's loss (None in fake mode, where it is garbage)."""
    full: FullModelEstimate
    kept_attention: dict[str, float] | None = None
    """``keep_attention``: the full model's plan (``device_blocks``, ``host_blocks``), the measured
    blocks keeping (``measured_device``, ``measured_host``) and ``bytes_per_block``; None without."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ModeledComm:
    """The step's modeled communication: bytes of every converted attention call and their time."""

    a2a_bytes: float
    a2a_wire_bytes: float
    p2p_bytes: float
    a2a_gbps: float
    p2p_gbps: float
    attention: ContextParallelAttention | None
    """The first converted attention module (its layout describes the run); None without CP."""
    second_a2a_gbps: float | None = None

    def time_at(self, a2a_gbps: float) -> float:
        """``a2a wire bytes / a2a_gbps + ring p2p bytes / p2p_gbps`` (GB = 1e9 bytes). For ``tsp``
        the p2p bytes are every byte a rank receives (``tsp.comm.layer_comm_bytes``)."""
        return self.a2a_wire_bytes / (a2a_gbps * GB) + self.p2p_bytes / (self.p2p_gbps * GB)

    @property
    def comm_time_s(self) -> float:
        return self.time_at(self.a2a_gbps)

    @property
    def second_comm_time_s(self) -> float | None:
        return None if self.second_a2a_gbps is None else self.time_at(self.second_a2a_gbps)


def modeled_comm(job_config, model: torch.nn.Module, elem_size: int, a2a_gbps: float,
                 p2p_gbps: float) -> ModeledComm:
    """Step communication of all converted attention modules (``attention_comm_bytes`` of the
    first, times the module count, with the forward's recomputation under AC, less what the
    recomputation of blocks keeping their attention does not send)."""
    modules = [m for m in model.modules() if isinstance(m, ContextParallelAttention)]
    if not modules:
        return ModeledComm(0.0, 0.0, 0.0, a2a_gbps, p2p_gbps, None)
    module = modules[0]
    recompute = recompute_fraction(job_config.activation_checkpoint)
    kept = sum(getattr(block, "keep", None) is not None for block in model.layers.values())
    if isinstance(module, TSPAttention):  # broadcasts, all-gathers, reduces and the MLP ring: the exact count
        volumes = layer_comm_bytes(module.shards, module.projections()["wq"].weight.shape[1], job_config.training.local_batch_size,
                                   job_config.training.seq_len, elem_size)
        return ModeledComm(0.0, 0.0, tsp_step_bytes(volumes, len(modules), recompute, kept), a2a_gbps, p2p_gbps,
                           module)
    local_len = job_config.training.seq_len // module.cp_degree
    _, ulysses_rank, _ = ulysses_part(module.cp_mesh)
    per_call = attention_comm_bytes(module.schedule, module.mode, module.ring_degree,
                                    job_config.training.local_batch_size, local_len, module.head_dim, elem_size,
                                    ulysses_rank)
    step = per_call.per_step(len(modules), recompute, kept, module.mode == "upipe")
    return ModeledComm(step["a2a_bytes"], step["a2a_wire_bytes"], step["p2p_bytes"], a2a_gbps, p2p_gbps, module)


def _state_bytes(rank: TrainingRank, step: StepResult) -> StateBytes:
    """The rank's state after the step (FSDP: local shards); gradients as measured after backward."""
    params, layer_ids = rank.params, rank.layer_ids()
    return StateBytes(
        param_bytes=storage_bytes(params), grad_bytes=step.grad_bytes,
        optimizer_bytes=storage_bytes(rank.optimizer_tensors()),
        layer_param_bytes=storage_bytes(p for p in params if id(p) in layer_ids),
        layer_grad_bytes=step.layer_grad_bytes,
        layer_optimizer_bytes=storage_bytes(rank.optimizer_tensors(only=layer_ids)),
        buffer_bytes=storage_bytes(list(rank.model.buffers())),
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _series_fields(series: StepSeries, n_layers: int) -> dict[str, Any]:
    """The measurement's fields about the steps: which one is reported, first uses and compilation."""
    step = series.reported
    return dict(
        steps=len(series.steps), warmup_steps=series.warmup_steps, warm=series.warm,
        step_time_s=step.step_time_s, phase_time_s=step.phase_time_s, attention_time_s=step.attention_time_s,
        attention_forward_time_s=step.attention_forward_time_s,
        attention_backward_time_s=step.attention_backward_time_s,
        other_compute_time_s=step.step_time_s - step.attention_time_s,
        block_forward_time_s=step.block_forward_time_s, block_backward_time_s=step.block_backward_time_s,
        block_time_s=step.blocks_time_s / n_layers, first_step_time_s=series.first_step_time_s,
        step_times_s=series.step_times_s, median_step_time_s=series.median_step_time_s, compile_s=series.compile_s,
        kernel_compiles=dict(series.kernel_compiles),
        kernel_compiles_during_timed_steps=series.kernel_compiles.get("timed_steps"),
        kernel_compiles_uncounted=uncounted_compilers(),
    )


def _step_measurement(job_config, world_size: int, rank: TrainingRank, device: torch.device, *, fake: bool,
                      series: StepSeries, state: StateBytes, comm: ModeledComm, param_dtype: torch.dtype,
                      full: FullModelEstimate, kept: KeptBlocks) -> StepMeasurement:
    par, ac, training = job_config.parallelism, job_config.activation_checkpoint, job_config.training
    module = comm.attention
    is_cuda = device.type == "cuda"
    step = series.reported
    return StepMeasurement(
        config=str(job_config.job.config_file), model=job_config.model.name, flavor=job_config.model.flavor,
        cp_mode=cp_mode(job_config.model.converters), world_size=world_size, cp_degree=par.context_parallel_degree,
        dp_shard=rank.parallel_dims.dp_shard, ulysses_degree=module.ulysses_degree if module else 1,
        ring_degree=module.ring_degree if module else 1,
        heads_per_stage=module.heads_per_stage if module is not None and module.mode == "upipe" else None,
        seq_len=training.seq_len, batch=training.local_batch_size,
        local_tokens=training.local_batch_size * training.seq_len // par.context_parallel_degree,
        n_layers=rank.n_layers, n_layers_full=rank.n_layers_full, documents=rank.documents, fake=fake,
        rank=dist.get_rank(),
        device=str(device), param_dtype=_dtype_name(param_dtype),
        activation_checkpoint=ac.mode + (" + cpu offload" if plugin_fields(ac, ActivationCheckpointOffload).cpu_offload
                                         else ""),
        param_bytes=state.param_bytes, grad_bytes=state.grad_bytes,
        optimizer_bytes=state.optimizer_bytes, buffer_bytes=state.buffer_bytes,
        state_bytes=state.param_bytes + state.grad_bytes + state.optimizer_bytes,
        layer_param_bytes=state.layer_param_bytes, layer_grad_bytes=state.layer_grad_bytes,
        layer_optimizer_bytes=state.layer_optimizer_bytes, baseline_bytes=step.baseline_bytes,
        peak_bytes=step.peak_bytes, phase_peak_bytes=step.phase_peak_bytes, peak_op=step.peak_op,
        total_peak_bytes=step.baseline_bytes + step.peak_bytes, end_bytes=step.end_bytes,
        retained_bytes_per_layer=step.retained_bytes_per_layer, host_offload_bytes=step.host_offload_bytes,
        device_peak_allocated_bytes=step.device_peak_allocated_bytes,
        device_peak_reserved_bytes=step.device_peak_reserved_bytes,
        device_total_bytes=torch.cuda.get_device_properties(device).total_memory if is_cuda else None,
        **_series_fields(series, rank.n_layers),
        a2a_bytes=comm.a2a_bytes, a2a_wire_bytes=comm.a2a_wire_bytes, p2p_bytes=comm.p2p_bytes,
        a2a_gbps=comm.a2a_gbps, p2p_gbps=comm.p2p_gbps, comm_time_s=comm.comm_time_s,
        second_a2a_gbps=comm.second_a2a_gbps, second_comm_time_s=comm.second_comm_time_s, loss=step.loss, full=full,
        kept_attention=None if not kept.bytes_per_block else {
            "device_blocks": kept.full_device, "host_blocks": kept.full_host, "measured_device": kept.measured_device,
            "measured_host": kept.measured_host, "bytes_per_block": kept.bytes_per_block},
    )


def _kept_blocks(job_config, rank: TrainingRank, step: StepResult, comm: ModeledComm, elem_size: int) -> KeptBlocks:
    """Kept attention in the measured blocks (their wrappers' placement) and in the full model (the
    job's plan, ``auto`` as sized for this machine), for the extrapolation."""
    plan = known_keep_attention_plan(job_config) or NO_KEEP
    placements = [getattr(block, "keep", None) for block in rank.model.layers.values()]
    module = comm.attention
    if not plan.blocks or module is None:
        return KeptBlocks()
    tokens = job_config.training.local_batch_size * job_config.training.seq_len // module.cp_degree
    recomputed = placements.count(None)
    return KeptBlocks(
        bytes_per_block=kept_attention_bytes(tokens, module.n_heads, module.head_dim, elem_size),
        measured_device=placements.count("device"), measured_host=placements.count("host"),
        full_device=min(plan.device_blocks, rank.n_layers_full),
        full_host=min(plan.host_blocks, max(rank.n_layers_full - plan.device_blocks, 0)),
        retained_keeping_fraction=step.retained_keeping_fraction,
        attention_forward_s=step.attention_forward_time_s / (rank.n_layers + recomputed))


@dataclass(frozen=True)
class _Options:
    """``measure_step``'s keyword arguments that shape the run and its report."""

    n_layers: int | None
    full_layers: int | None
    steps: int
    warmup_steps: int
    compile_pass: bool | None
    time_attention: bool
    a2a_gbps: float
    second_a2a_gbps: float | None
    p2p_gbps: float


def _measure(job_config, world_size: int, *, fake: bool, device: torch.device, options: _Options) -> StepMeasurement:
    rank = build_training_rank(job_config, world_size, device, options.n_layers)
    if options.full_layers is not None:
        rank.n_layers_full = options.full_layers
    rank.materialize_optimizer_state()
    # Activations (and so the all-to-all buffers and the kernels' inputs) are in the parameter
    # dtype: FSDP's mixed precision, or autocast without FSDP.
    param_dtype = param_dtype_of(job_config)
    compile_pass = options.steps > options.warmup_steps if options.compile_pass is None else options.compile_pass
    series = run_steps(rank, job_config, device, steps=options.steps, warmup_steps=options.warmup_steps, fake=fake,
                       time_attention=options.time_attention, compile_pass=compile_pass, compute_dtype=param_dtype)
    step = series.reported
    state = _state_bytes(rank, step)
    elem_size = torch.empty((), dtype=param_dtype).element_size()
    comm = dataclasses.replace(modeled_comm(job_config, rank.model, elem_size, options.a2a_gbps, options.p2p_gbps),
                               second_a2a_gbps=options.second_a2a_gbps)
    peaks = StepPeaks(step.phase_peak_bytes, step.retained_bytes_per_layer, step.host_offload_bytes,
                      step.device_peak_allocated_bytes, step.device_peak_reserved_bytes)
    costs = StepCosts(a2a_bytes=comm.a2a_bytes, a2a_wire_bytes=comm.a2a_wire_bytes, p2p_bytes=comm.p2p_bytes,
                      comm_time_s=comm.comm_time_s, second_comm_time_s=comm.second_comm_time_s)
    times = StepTimes(step_time_s=step.step_time_s, blocks_time_s=step.blocks_time_s,
                      optimizer_time_s=step.optimizer_time_s, attention_time_s=step.attention_time_s)
    kept = _kept_blocks(job_config, rank, step, comm, elem_size)
    full = extrapolate_layers(n_measured=rank.n_layers, n_full=rank.n_layers_full, state=state, peaks=peaks,
                              costs=costs, times=times, kept=kept)
    return _step_measurement(job_config, world_size, rank, device, fake=fake, series=series, state=state,
                             comm=comm, param_dtype=param_dtype, full=full, kept=kept)


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
    # Imported here, not at the top: importing it registers torch.distributed's "fake" backend,
    # a process-wide side effect only a fake measurement should have.
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


def measure_step(
    job_config,
    world_size: int,
    *,
    fake: bool,
    n_layers: int | None = None,
    steps: int = 1,
    warmup_steps: int = 1,
    compile_pass: bool | None = None,
    rank: int = 0,
    a2a_gbps: float = DEFAULT_A2A_GBPS,
    second_a2a_gbps: float | None = None,
    p2p_gbps: float | None = None,
    time_attention: bool = True,
    full_layers: int | None = None,
) -> StepMeasurement:
    """Build the configured model for one rank of a ``world_size``-rank job and measure
    ``steps`` training steps, the first ``warmup_steps`` untimed; the median timed step is
    reported (``series.py``; without a timed step the last one, ``warm`` False). See the package
    docstring for what is measured.

    ``fake``: False inside a real job (the default process group has ``world_size`` ranks);
    True to emulate rank ``rank`` in this process on the fake backend (started and ended
    here; the process must not have another default process group).
    ``n_layers``: build this many blocks instead of the flavor's (``full`` extrapolates).
    ``compile_pass``: run the attention kernels once before step 1 and time it apart
    (``compile_s``); None: where a step is timed (``steps > warmup_steps``).
    ``a2a_gbps``/``p2p_gbps``: bandwidths (GB/s per direction) of the modeled communication;
    ``second_a2a_gbps``: the all-to-all's time at this bandwidth too (``second_comm_time_s``).
    ``time_attention``: hook the attention modules for the time split (synchronises CUDA
    at every attention boundary; off leaves ``attention_*`` at 0).
    ``full_layers``: the depth ``full`` extrapolates to (default: the flavor's ``n_layers``).
    A rank the memory planner predicts will not fit this machine (with ``n_layers`` blocks) is
    refused before anything is allocated (``torchtitan_0_2.memory_guard.MemoryDoesNotFit``, a ConfigError).
    """
    register_plugin()
    if steps < 1 or warmup_steps < 0:
        raise ValueError(f"steps must be >= 1 and warmup_steps >= 0, got {steps} and {warmup_steps}")
    check_job(job_config, world_size)
    device = rank_device()
    # what this process allocates: one rank (fake) or this node's share of the job, n_layers blocks
    machine = free_machine_memory(1 if fake else local_ranks(world_size), device.type)
    check_memory_fits(job_config, world_size, machine, n_layers=n_layers)
    size_keep_attention_of_job(job_config, world_size)  # keep_attention = "auto": sized for this machine
    if fake and not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of the {world_size} ranks")
    options = _Options(n_layers, full_layers, steps, warmup_steps, compile_pass, time_attention, a2a_gbps,
                       second_a2a_gbps, p2p_gbps if p2p_gbps is not None else a2a_gbps)
    with _process_group(world_size, fake, rank, device):
        return _measure(job_config, world_size, fake=fake, device=device, options=options)
