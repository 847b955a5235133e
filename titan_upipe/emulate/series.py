"""A run of training steps: the first ones an untimed warm-up, the rest timed; which step is reported.

The first step pays every first use the compile pass did not take out of it (kernels of packed
documents, cuBLAS and cuDNN set-up, Triton kernels such as Liger's, the caching allocator's
growth): the ``warmup_steps`` first steps are run and not timed. Of the timed steps, the
reported one is the step whose total time is the median (the lower middle one for an even
count), and every figure of the measurement (phases, attention, blocks, optimizer, memory)
comes from that one step, so its parts add up to its total (per-phase medians would mix steps).
Without a timed step (``steps <= warmup_steps``, e.g. one step for a memory run) the last step
is reported and the series is not warm: its times include first uses and are no steady state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepSeries:
    """Every step of a measurement, in order (anything with a ``step_time_s``)."""

    steps: Sequence[Any]
    warmup_steps: int
    compile_s: float | None = None
    """Wall time of the kernels' first use before step 1 (``compile_pass``); None: not run."""
    kernel_compiles: dict[str, int | None] = field(default_factory=dict)
    """Kernels compiled in the compile pass, the warm-up and the timed steps (None: not run, or
    not countable; ``attention.kernel_compiles``)."""

    @property
    def timed(self) -> Sequence[Any]:
        return self.steps[self.warmup_steps:]

    @property
    def warm(self) -> bool:
        """At least one untimed step came before the timed ones, and there is a timed one."""
        return self.warmup_steps >= 1 and len(self.timed) >= 1

    @property
    def reported(self) -> Any:
        """The median timed step (module docstring), else the last step."""
        if not self.timed:
            return self.steps[-1]
        ordered = sorted(self.timed, key=lambda step: step.step_time_s)
        return ordered[(len(ordered) - 1) // 2]

    @property
    def first_step_time_s(self) -> float:
        return self.steps[0].step_time_s

    @property
    def step_times_s(self) -> list[float]:
        """Each timed step's total, in order."""
        return [step.step_time_s for step in self.timed]

    @property
    def median_step_time_s(self) -> float | None:
        """The reported step's total; None without a timed step."""
        return self.reported.step_time_s if self.timed else None
