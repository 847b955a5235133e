"""What a training step whose loss or gradient norm is NaN or infinite does (``training.on_nonfinite``).

After clipping and before the optimizer step, every rank sums its share of the loss over all ranks
(one scalar all-reduce; the gradient norm is global already):

    loss = Σ_r ℓ_r,   ℓ_r = L_{d,c} / Σ_d N_d   (rank r's loss sum over the global valid tokens)

which is the step's global mean loss (the plugin refuses tensor, pipeline and expert parallelism,
so the ranks are exactly the ``batch x cp`` ranks), and is NaN or infinite as soon as one rank's
share is. Every rank so holds the same two numbers and takes the same decision:

=============  ====================================================================================
``stop``       the step's update is not applied; the job ends with :class:`~titan_upipe.errors.TrainingStopped`:
               one line naming the step, the value, the last complete checkpoint and the likely cause
``skip_step``  no optimizer or LR step for this step, its gradients dropped, a warning; training goes on
``warn``       a warning, and the update applied as TorchTitan applies it (the weights are then
               usually NaN for good)
=============  ====================================================================================

``health/nonfinite_steps`` (TensorBoard) counts the non-finite steps so far; it is written at every
logged step and at each non-finite one, so the dashboard marks the step where it rises.

Both adapters' trainers use it (``torchtitan_0_2.health.build_guard``, ``torchtitan_0_3.trainer``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torchtitan.tools.logging import logger

from titan_upipe.errors import TrainingStopped
from titan_upipe.torchtitan_common.checkpoint_folders import saved_steps

HIGH_LEARNING_RATE = 1e-2
"""Above this, ``optimizer.lr`` itself is named as the cause: LLM training uses 1e-5 to 1e-3."""

NONFINITE_TAG = "health/nonfinite_steps"


@dataclass(frozen=True)
class StepValues:
    """A step's global loss and gradient norm (before clipping), with the learning rate it ran at."""

    step: int
    loss: float
    grad_norm: float
    lr: float

    def nonfinite(self) -> tuple[str, ...]:
        """The names of the values that are NaN or infinite: ``loss``, ``gradient norm``."""
        return tuple(name for name, value in (("loss", self.loss), ("gradient norm", self.grad_norm))
                     if not math.isfinite(value))

    def describe(self) -> str:
        """``the gradient norm is nan (the loss is 6.238)``: the non-finite values, then the finite ones."""
        named = {"loss": self.loss, "gradient norm": self.grad_norm}
        bad = [f"the {name} is {named[name]}" for name in self.nonfinite()]
        good = [f"the {name} is {value:.4g}" for name, value in named.items() if name not in self.nonfinite()]
        return " and ".join(bad) + (f" ({good[0]})" if good else "")


def nonfinite_action(on_nonfinite: str, values: StepValues) -> str | None:
    """None for a step whose loss and gradient norm are finite, else the job's ``training.on_nonfinite``."""
    return on_nonfinite if values.nonfinite() else None


def likely_cause(values: StepValues, optimizer_lr: float, first_step: int) -> str:
    """The likely cause of the non-finite ``values`` and its fix: the learning rate, unless no
    optimizer step has run yet in this job (``first_step``: the step it started at)."""
    if not (math.isfinite(optimizer_lr) and math.isfinite(values.lr)):
        return (f"the learning rate is {values.lr:.3g} (optimizer.lr = {optimizer_lr:.3g}): set optimizer.lr to a finite "
                "value, e.g. 3e-4")
    if values.step == first_step:
        return ("not the learning rate, as no optimizer step has run yet in this job: the weights it started from "
                "(the checkpoint it loaded, checkpoint.initial_load_path) or this step's batch")
    if optimizer_lr > HIGH_LEARNING_RATE:
        return (f"the learning rate, optimizer.lr = {optimizer_lr:.3g} ({values.lr:.3g} at this step), far above the 1e-5 "
                "to 1e-3 that LLM training uses: lower optimizer.lr")
    return (f"a learning rate too high for this model and batch (optimizer.lr = {optimizer_lr:.3g}, {values.lr:.3g} at "
            "this step) or a bad batch: lower optimizer.lr or raise lr_scheduler.warmup_steps, or set "
            'training.on_nonfinite = "skip_step" to skip such steps')


def last_checkpoint_text(enabled: bool, folder: str) -> str:
    """Where the job can resume from: the newest ``step-N`` of ``folder`` with a ``.metadata``
    (TorchTitan writes it last, so a save cut short or still in flight does not count)."""
    if not enabled:
        return "last complete checkpoint: none (checkpoint.enable = false)"
    steps = saved_steps(folder)
    if not steps:
        return f"last complete checkpoint: none yet in {folder}"
    return (f"last complete checkpoint: {os.path.join(folder, f'step-{steps[-1]}')} "
            f"(resume with --checkpoint.load_step {steps[-1]})")


def stop_message(values: StepValues, checkpoint: str, cause: str) -> str:
    return f"training stopped at step {values.step}: {values.describe()}; {checkpoint}; likely cause: {cause}"


def global_step_values(step: int, local_loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> StepValues:
    """The step's :class:`StepValues` from this rank's loss share (summed over every rank here) and
    the global gradient norm; the same on every rank. One host sync (the decision gates the update)."""
    loss = local_loss.detach().float().reshape(()).clone()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(loss)
    total, norm = torch.stack([loss, grad_norm.detach().float().reshape(()).to(loss.device)]).tolist()
    return StepValues(step, total, norm, lr)


class NonFiniteGuard:
    """The job's ``training.on_nonfinite``, step by step; counts the non-finite steps."""

    def __init__(self, on_nonfinite: str, optimizer_lr: float, checkpointer) -> None:
        self.on_nonfinite = on_nonfinite
        self.optimizer_lr = optimizer_lr
        self.checkpointer = checkpointer
        self.nonfinite_steps = 0
        self._first_step: int | None = None

    def action(self, values: StepValues) -> str | None:
        """None (the step is finite), ``stop``, ``skip_step`` or ``warn``; logs the last two."""
        if self._first_step is None:
            self._first_step = values.step
        action = nonfinite_action(self.on_nonfinite, values)
        if action is None:
            return None
        self.nonfinite_steps += 1
        if action == "skip_step":
            logger.warning(f"step {values.step}: {values.describe()}: its update is skipped (training.on_nonfinite = "
                           f'"skip_step"; {self.nonfinite_steps} non-finite step(s) so far)')
        elif action == "warn":
            logger.warning(f"step {values.step}: {values.describe()}: its update is applied (training.on_nonfinite "
                           '= "warn"), which usually leaves the weights NaN; "stop" or "skip_step" would not')
        return action

    @staticmethod
    def update(action: str | None, optimizers, lr_schedulers) -> None:
        """The step's update where ``action`` lets it through (a finite step, ``warn``); else (``skip_step``,
        ``stop``) the gradients dropped: the update would carry NaN or inf into the weights."""
        if action in (None, "warn"):
            optimizers.step()
            lr_schedulers.step()
        else:
            optimizers.zero_grad()

    def stopped(self, values: StepValues) -> TrainingStopped:
        """The one-line error of a ``stop`` at ``values.step``."""
        checkpoint = last_checkpoint_text(bool(self.checkpointer.enable), self.checkpointer.folder)
        first = values.step if self._first_step is None else self._first_step
        return TrainingStopped(stop_message(values, checkpoint, likely_cause(values, self.optimizer_lr, first)))


