"""A measurement of fewer transformer blocks, scaled to the full depth (pure arithmetic).

With ``n`` blocks measured and ``N`` wanted, ``r = N / n`` and ``N - n`` extra blocks:

* state (params, grads, optimizer): ``total - layer_part + r * layer_part``; the embedding,
  final norm, head and the buffers do not scale;
* forward peak: ``+ (N - n) * retained`` (every block's saved activations are live at the
  end of forward); backward peak: ``+ (N - n) * max(retained, layer grads / n)`` (live bytes
  in backward are the blocks not yet backpropagated plus the gradients of those done,
  maximal at an end); optimizer peak: the scaled gradients plus the optimizer's temporaries
  (foreach over all parameters) times the parameter-bytes ratio;
* offloaded host bytes, communication bytes and time, attention and other compute time: ``* r``;
* CUDA allocated/reserved: measured ``+`` the change of the tracked total peak.
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
    """What one step spends in proportion to its depth: communication bytes (per rank) and time."""

    a2a_bytes: float = 0.0
    a2a_wire_bytes: float = 0.0
    p2p_bytes: float = 0.0
    comm_time_s: float = 0.0
    attention_time_s: float = 0.0
    other_compute_time_s: float = 0.0


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


def _phase_peaks(state: StateBytes, peaks: StepPeaks, n_measured: int, n_full: int,
                 grads: float, params: float) -> dict[str, float]:
    """The per-phase peaks at ``n_full`` blocks (module docstring); ``grads``/``params`` already scaled."""
    extra = n_full - n_measured
    measured = peaks.phase_peak_bytes
    retained = peaks.retained_bytes_per_layer
    scaled: dict[str, float] = {}
    if "forward" in measured:
        scaled["forward"] = measured["forward"] + extra * retained
    if "backward" in measured:
        scaled["backward"] = measured["backward"] + extra * max(retained, state.layer_grad_bytes / n_measured)
    if "optimizer" in measured:
        temporaries = max(measured["optimizer"] - state.grad_bytes, 0.0)
        param_ratio = params / state.param_bytes if state.param_bytes else n_full / n_measured
        scaled["optimizer"] = grads + temporaries * param_ratio
    return scaled


def extrapolate_layers(*, n_measured: int, n_full: int, state: StateBytes, peaks: StepPeaks,
                       costs: StepCosts = StepCosts()) -> FullModelEstimate:
    """Scale a measurement of ``n_measured`` blocks to ``n_full`` blocks (the module docstring's rules)."""
    if n_measured < 1 or n_full < 1:
        raise ValueError(f"layer counts must be positive, got {n_measured} measured, {n_full} full")
    r = n_full / n_measured

    def scaled(total: float, layer_part: float) -> float:
        return total - layer_part + layer_part * r

    params = scaled(state.param_bytes, state.layer_param_bytes)
    grads = scaled(state.grad_bytes, state.layer_grad_bytes)
    optim = scaled(state.optimizer_bytes, state.layer_optimizer_bytes)
    phase_peaks = _phase_peaks(state, peaks, n_measured, n_full, grads, params)
    peak = max(phase_peaks.values(), default=0.0)
    baseline = params + optim + state.buffer_bytes
    measured_total = (state.param_bytes + state.optimizer_bytes + state.buffer_bytes
                      + max(peaks.phase_peak_bytes.values(), default=0.0))
    delta = baseline + peak - measured_total
    allocated, reserved = peaks.device_peak_allocated_bytes, peaks.device_peak_reserved_bytes
    attention, other = costs.attention_time_s * r, costs.other_compute_time_s * r
    comm = costs.comm_time_s * r
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
        host_offload_bytes=peaks.host_offload_bytes * r,
        device_peak_allocated_bytes=None if allocated is None else allocated + delta,
        device_peak_reserved_bytes=None if reserved is None else reserved + delta,
        a2a_bytes=costs.a2a_bytes * r,
        a2a_wire_bytes=costs.a2a_wire_bytes * r,
        p2p_bytes=costs.p2p_bytes * r,
        comm_time_s=comm,
        attention_time_s=attention,
        other_compute_time_s=other,
        step_time_s=attention + other,
        modeled_step_time_s=attention + other + comm,
    )
