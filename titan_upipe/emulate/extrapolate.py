"""A measurement of fewer transformer blocks, scaled to the full depth (pure arithmetic).

With ``n`` blocks measured and ``N`` wanted, ``r = N / n`` and ``N - n`` extra blocks:

* state (params, grads, optimizer): ``total - layer_part + r * layer_part``; the embedding,
  final norm, head and the buffers do not scale;
* forward peak: ``+ (N - n) * retained`` (every block's saved activations are live at the
  end of forward); backward peak: ``+ (N - n) * max(retained, layer grads / n)`` (live bytes
  in backward are the blocks not yet backpropagated plus the gradients of those done,
  maximal at an end); optimizer peak: the scaled gradients plus the optimizer's temporaries
  (foreach over all parameters) times the parameter-bytes ratio;
* offloaded host bytes, communication bytes and time: ``* r``;
* CUDA allocated/reserved: measured ``+`` the change of the tracked total peak.

Time (:class:`StepTimes`, one step's wall seconds): only the blocks repeat with the depth.
With ``T`` the step, ``B`` the time inside the ``n`` measured blocks (forward and backward),
``O`` the optimizer (clip + step) and ``P`` the parameter bytes::

    block = B / n                       (the mean measured block)
    once  = T - B - O                   (batch, embedding, final norm, head, loss: once per step)
    T'    = once + N * block + O * P_full / P_measured

attention ``* r`` (it is all inside the blocks), other compute ``= T' - attention'``.

Kept attention (``keep_attention``, :class:`KeptBlocks`): the measured blocks are the model's top
ones, placed as the full model's plan places its top blocks; the extra blocks below them keep as
that plan says. With ``k`` bytes kept per block, ``f`` the share of ``retained``'s blocks keeping on
the device, ``D``/``H`` the full model's blocks keeping on the device/host and ``d``/``h`` the
measured ones: forward peak ``+ (N - n) (retained - f k) + (D - d) k``; backward peak likewise with
the gradients' term (the extra kept bytes added whole: an upper bound, they leave as the backward
passes their blocks); host ``(host - h k) r + H k``. Time: a block that keeps saves one attention
forward (``a``, the attention forward time of a block's first forward, measured); with ``K = D + H``
of the ``N`` blocks keeping and a share ``m`` of the measured ones, the mean block becomes
``block + (m - K/N) a``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StateBytes:
    """Parameters, gradients and optimizer state of one rank (bytes), and the blocks' part of each."""

    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    layer_param_bytes: float
    """Of ``param_bytes``, those of the transformer blocks (what scales with the depth)."""
    layer_grad_bytes: float
    layer_optimizer_bytes: float
    buffer_bytes: float
    """Model buffers (the RoPE table): not sharded, not scaled with the depth."""

    @classmethod
    def of(cls, record) -> StateBytes:
        """The fields of the same names of ``record`` (a ``StepMeasurement``)."""
        return cls(record.param_bytes, record.grad_bytes, record.optimizer_bytes, record.layer_param_bytes,
                   record.layer_grad_bytes, record.layer_optimizer_bytes, record.buffer_bytes)


@dataclass(frozen=True)
class StepPeaks:
    """The transient memory of one measured step (bytes above the baseline, per phase)."""

    phase_peak_bytes: dict[str, float]
    """Peak per phase (``forward``, ``backward``, ``optimizer``; any subset)."""
    retained_bytes_per_layer: float
    """Bytes one block leaves alive after its forward."""
    host_offload_bytes: float = 0.0
    device_peak_allocated_bytes: float | None = None
    device_peak_reserved_bytes: float | None = None

    @classmethod
    def of(cls, record) -> StepPeaks:
        """The fields of the same names of ``record`` (a ``StepMeasurement``)."""
        return cls(record.phase_peak_bytes, record.retained_bytes_per_layer, record.host_offload_bytes,
                   record.device_peak_allocated_bytes, record.device_peak_reserved_bytes)


@dataclass(frozen=True)
class StepCosts:
    """What one step's communication costs, all in proportion to its depth: bytes (per rank) and
    their modeled time at the modeled bandwidth and, where given, at a second one."""

    a2a_bytes: float = 0.0
    a2a_wire_bytes: float = 0.0
    p2p_bytes: float = 0.0
    comm_time_s: float = 0.0
    second_comm_time_s: float | None = None


@dataclass(frozen=True)
class KeptBlocks:
    """Kept attention in the measured model and in the full one (module docstring)."""

    bytes_per_block: float = 0.0
    """``k``: ``spec.keep_attention.kept_attention_bytes`` of the job (equal to the measured bytes)."""
    measured_device: int = 0
    measured_host: int = 0
    full_device: int = 0
    full_host: int = 0
    retained_keeping_fraction: float = 0.0
    """``f``: of the blocks ``retained_bytes_per_layer`` averages, the share keeping on the device."""
    attention_forward_s: float = 0.0
    """``a``: one block's attention forward (its first forward), what a kept block does not run again:
    the measured blocks' attention forward time over their first forwards and full recomputations
    (a kept block's recomputation, its projections and ``wo``, counted in with it: an upper bound)."""

    def measured_share(self, n_measured: int) -> float:
        return (self.measured_device + self.measured_host) / n_measured


@dataclass(frozen=True)
class StepTimes:
    """One measured step's wall seconds, split as the depth extrapolation needs them."""

    step_time_s: float = 0.0
    blocks_time_s: float = 0.0
    """Inside the measured transformer blocks, forward and backward, all of them together."""
    optimizer_time_s: float = 0.0
    """Gradient clipping and the optimizer step."""
    attention_time_s: float = 0.0
    """Inside the converted attention modules (a part of ``blocks_time_s``)."""


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
    block_time_s: float
    """One block's forward + backward: the mean of the measured blocks."""
    once_time_s: float
    """What runs once per step whatever the depth: batch, embedding, final norm, head, loss."""
    optimizer_time_s: float
    """Clip + optimizer step, scaled by the parameter bytes."""
    step_time_s: float
    """``once_time_s + n_layers * block_time_s + optimizer_time_s`` (module docstring)."""
    modeled_step_time_s: float
    """``step_time_s + comm_time_s``."""
    second_comm_time_s: float | None = None
    """The communication at the second bandwidth, where one was given."""
    second_modeled_step_time_s: float | None = None
    """``step_time_s + second_comm_time_s``."""


def _phase_peaks(state: StateBytes, peaks: StepPeaks, n_measured: int, n_full: int,
                 grads: float, params: float, kept: KeptBlocks) -> dict[str, float]:
    """The per-phase peaks at ``n_full`` blocks (module docstring); ``grads``/``params`` already scaled."""
    extra = n_full - n_measured
    measured = peaks.phase_peak_bytes
    retained = peaks.retained_bytes_per_layer - kept.retained_keeping_fraction * kept.bytes_per_block
    kept_below = max(kept.full_device - kept.measured_device, 0) * kept.bytes_per_block
    scaled: dict[str, float] = {}
    if "forward" in measured:
        scaled["forward"] = measured["forward"] + extra * retained + kept_below
    if "backward" in measured:
        scaled["backward"] = (measured["backward"] + extra * max(retained, state.layer_grad_bytes / n_measured)
                              + kept_below)
    if "optimizer" in measured:
        temporaries = max(measured["optimizer"] - state.grad_bytes, 0.0)
        param_ratio = params / state.param_bytes if state.param_bytes else n_full / n_measured
        scaled["optimizer"] = grads + temporaries * param_ratio
    return scaled


def _step_time(times: StepTimes, n_measured: int, n_full: int, param_ratio: float,
               kept: KeptBlocks) -> tuple[float, float, float]:
    """(block, once, optimizer) seconds at ``n_full`` blocks (module docstring)."""
    full_share = (kept.full_device + kept.full_host) / n_full
    block = times.blocks_time_s / n_measured + (kept.measured_share(n_measured) - full_share) * kept.attention_forward_s
    once = times.step_time_s - times.blocks_time_s - times.optimizer_time_s
    return block, once, times.optimizer_time_s * param_ratio


def extrapolate_layers(*, n_measured: int, n_full: int, state: StateBytes, peaks: StepPeaks,
                       costs: StepCosts = StepCosts(), times: StepTimes = StepTimes(),
                       kept: KeptBlocks = KeptBlocks()) -> FullModelEstimate:
    """Scale a measurement of ``n_measured`` blocks to ``n_full`` blocks (the module docstring's rules)."""
    if n_measured < 1 or n_full < 1:
        raise ValueError(f"layer counts must be positive, got {n_measured} measured, {n_full} full")
    r = n_full / n_measured

    def scaled(total: float, layer_part: float) -> float:
        return total - layer_part + layer_part * r

    params = scaled(state.param_bytes, state.layer_param_bytes)
    grads = scaled(state.grad_bytes, state.layer_grad_bytes)
    optim = scaled(state.optimizer_bytes, state.layer_optimizer_bytes)
    phase_peaks = _phase_peaks(state, peaks, n_measured, n_full, grads, params, kept)
    peak = max(phase_peaks.values(), default=0.0)
    baseline = params + optim + state.buffer_bytes
    measured_total = (state.param_bytes + state.optimizer_bytes + state.buffer_bytes
                      + max(peaks.phase_peak_bytes.values(), default=0.0))
    delta = baseline + peak - measured_total
    allocated, reserved = peaks.device_peak_allocated_bytes, peaks.device_peak_reserved_bytes
    block, once, optimizer = _step_time(times, n_measured, n_full, params / state.param_bytes if state.param_bytes else r,
                                        kept)
    step = once + n_full * block + optimizer
    attention, comm = times.attention_time_s * r, costs.comm_time_s * r
    second = None if costs.second_comm_time_s is None else costs.second_comm_time_s * r
    return FullModelEstimate(
        n_layers=n_full,
        param_bytes=params,
        grad_bytes=grads,
        optimizer_bytes=optim,
        state_bytes=params + grads + optim,
        baseline_bytes=baseline,
        phase_peak_bytes=phase_peaks,
        peak_bytes=peak,
        total_peak_bytes=baseline + peak,
        host_offload_bytes=((peaks.host_offload_bytes - kept.measured_host * kept.bytes_per_block) * r
                            + kept.full_host * kept.bytes_per_block),
        device_peak_allocated_bytes=None if allocated is None else allocated + delta,
        device_peak_reserved_bytes=None if reserved is None else reserved + delta,
        a2a_bytes=costs.a2a_bytes * r,
        a2a_wire_bytes=costs.a2a_wire_bytes * r,
        p2p_bytes=costs.p2p_bytes * r,
        comm_time_s=comm,
        attention_time_s=attention,
        other_compute_time_s=step - attention,
        block_time_s=block,
        once_time_s=once,
        optimizer_time_s=optimizer,
        step_time_s=step,
        modeled_step_time_s=step + comm,
        second_comm_time_s=second,
        second_modeled_step_time_s=None if second is None else step + second,
    )
