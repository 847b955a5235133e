"""Rank emulator: one rank of an N-rank context-parallel job, measured in a single process.

``measure_step(job_config, world_size, fake=...)`` builds the configured model for one rank
exactly as TorchTitan's trainer does (``torchtitan_0_2.rank_model``, the builder ``titan_upipe.check`` shares:
train spec, flavor args + ``update_from_config``, meta device, ``model.converters``, the
spec's ``parallelize_fn`` — AC then FSDP —, ``to_empty``, ``init_weights``, the spec's
optimizer builder and loss) and runs training steps on a synthetic batch sharded in the
converted attention's layout (``titan_upipe.parallel.prepare_cp_batch`` on the launch's CP mesh,
``torchtitan_0_2.launched_job``).
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
``clip_grad_norm_`` (foreach, as the trainer); ``optimizer.step()``. Before the steps, the
optimizer state is materialised by one optimizer step on all-zero gradients (no
forward/backward), so no step creates Adam's moments: memory is that of any later step.

Steps (``series.py``): ``steps`` in all, the first ``warmup_steps`` (default 1) run but not
timed, then the timed ones; the reported step is the timed step whose total is the median
(the lower middle one of an even count), and every figure (phases, blocks, attention,
optimizer, memory) comes from that one step. A first step is no steady state: it pays
first uses (FlashAttention-4 compiles each kernel at its first call, about 6 s per process on
an H200; cuBLAS/cuDNN set-up, Liger's Triton kernels, allocator growth). With ``steps <=
warmup_steps`` (``steps=1``, enough for memory) nothing is timed: the last step is reported,
``warm`` is False, and no throughput should be read from its time. ``first_step_time_s``,
``step_times_s`` (each timed step) and ``median_step_time_s`` say what ran.

``compile_s``: before step 1, each converted attention's kernel runs forward and backward once
at the step's per-rank shapes (``compile_pass.py``; by default where a step is timed), its
wall time reported apart. ``kernel_compiles`` counts the kernels compiled in that pass, the
warm-up and the timed steps where the compiler keeps a count (``torch.compile`` graphs,
FlashAttention-4's JIT caches: ``titan_upipe.attention.kernel_compiles``);
``kernel_compiles_during_timed_steps`` > 0 means the timed steps include compilation (the
report says so), None that it is not countable or nothing was timed.

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
    :class:`~titan_upipe.toolkit.memory_tracker.StepTracker` (a ``LiveTensorTracker`` that
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
(:func:`extrapolate_layers`, a pure function: state, offloaded host bytes and communication
scale with layers; the transient peak inside one block does not; each extra block adds
``retained_bytes_per_layer`` to the forward/backward peak, or its gradients where those are
larger). Time: only the blocks repeat, ``T' = (T - B - O) + N * B / n + O * P' / P`` for a
step ``T`` with ``B`` inside the ``n`` measured blocks and ``O`` in the optimizer (``P``: the
parameter bytes); the batch, embedding, head and loss count once.

Time (seconds, wall clock; on CUDA with ``synchronize`` at every boundary):
``step_time_s`` and per phase; ``block_forward_time_s`` / ``block_backward_time_s`` inside
the transformer blocks (all measured blocks; backward with recomputation) and ``block_time_s``
one block's mean; ``attention_time_s`` is the time spent inside the converted
attention modules (projections, RoPE, all-to-alls, kernel, output projection; forward,
backward and any recomputation); both are timed with module hooks forward and gradient hooks
on the module's output and input backward; ``other_compute_time_s = step_time_s -
attention_time_s``. Communication is *modeled*, not measured: the all-to-all bytes of every
converted attention call follow from its head schedule
(:func:`~titan_upipe.costs.attention_comm.attention_comm_bytes`), and
``comm_time_s = a2a wire bytes / a2a_gbps + ring p2p bytes / p2p_gbps`` (GB = 1e9 bytes;
the modeled 150 GB/s per direction, ``DEFAULT_A2A_GBPS``, is an NVLink-class all-to-all
bandwidth per GPU, e.g. 8x H100 in one node; the wire bytes of an all-to-all exclude the
chunk a rank keeps). ``second_a2a_gbps`` (the CLI's ``--a2a-gbps``) reports the same at a
second bandwidth, ``second_comm_time_s`` (the paper's Table 5 all-to-all times correspond to
16-82 GB/s: docs/benchmarks/emulator.md). In fake mode the collectives take no time, so
``step_time_s + comm_time_s`` is the modeled step time (no overlap assumed: the all-to-alls
block the compute stream). In a real run the measured times already contain the
communication. FSDP's all-gather/reduce-scatter are not modeled (they overlap compute in
TorchTitan). Under activation checkpointing the forward's all-to-alls run again in backward
(``recompute_fraction``).

API (stable; the memory planner compares against it)::

    m = measure_step(job_config, world_size, fake=True, n_layers=2)   # -> StepMeasurement
    m.total_peak_bytes, m.peak_bytes, m.phase_peak_bytes, m.state_bytes, m.host_offload_bytes
    m.full.total_peak_bytes            # the same, extrapolated to the full depth
    m.to_dict()                        # JSON-ready (what python -m titan_upipe.emulate --json prints)

A fake measurement needs a process without a default process group (it starts and ends a
fake one); run it in a subprocess where other code uses ``torch.distributed``.

Modules: ``step`` (one
tracked training step -> ``StepResult``; the steps of a measurement -> ``StepSeries``),
``timers`` (block and attention wall time), ``compile_pass`` (the kernels' first use before
step 1), ``series`` (warm-up, timed steps, the reported one), ``extrapolate`` (fewer layers ->
the full depth), ``measure`` (``measure_step`` -> ``StepMeasurement``), ``cli``
(``python -m titan_upipe.emulate``: the report, ``--json``, ``--summarize``). One rank's model, optimizers and loss from a job config come from the adapter
(``titan_upipe.torchtitan_0_2.rank_model``); the tracker (``StepTracker``, ``storage_bytes``) is
the tools' own, in ``titan_upipe.toolkit.memory_tracker``; the communication count (``CommBytes``,
``attention_comm_bytes``, ``recompute_fraction``) in ``titan_upipe.costs.attention_comm``.
"""

import importlib

_HOMES = {
    "titan_upipe.costs.attention_comm": ("CommBytes", "attention_comm_bytes", "recompute_fraction"),
    "titan_upipe.emulate.extrapolate": ("FullModelEstimate", "StateBytes", "StepCosts", "StepPeaks", "StepTimes",
                                        "extrapolate_layers"),
    "titan_upipe.emulate.measure": ("DEFAULT_A2A_GBPS", "GB", "ModeledComm", "StepMeasurement", "measure_step"),
    "titan_upipe.emulate.series": ("StepSeries",),
    "titan_upipe.emulate.step": ("PHASES", "StepResult"),
    "titan_upipe.toolkit.memory_tracker": ("StepTracker", "storage_bytes"),
    "titan_upipe.torchtitan_0_2.rank_model": ("RankModel", "TrainingRank", "build_parallel_dims", "build_rank_model",
                                              "build_training_rank", "rank_device"),
}
"""Where each name of the package lives. Imported at first use (PEP 562), so that importing the package,
as ``python -m titan_upipe.emulate`` does before its ``__main__``, imports no TorchTitan: on a version
whose adapter has no emulator, the command says so in one line (``adapter.run_command``)."""
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str):
    if name not in _HOME_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME_OF[name]), name)


__all__ = [
    "DEFAULT_A2A_GBPS",
    "GB",
    "PHASES",
    "CommBytes",
    "FullModelEstimate",
    "ModeledComm",
    "RankModel",
    "StateBytes",
    "StepCosts",
    "StepMeasurement",
    "StepPeaks",
    "StepResult",
    "StepSeries",
    "StepTimes",
    "StepTracker",
    "TrainingRank",
    "attention_comm_bytes",
    "build_parallel_dims",
    "build_rank_model",
    "build_training_rank",
    "extrapolate_layers",
    "measure_step",
    "rank_device",
    "recompute_fraction",
    "storage_bytes",
]
