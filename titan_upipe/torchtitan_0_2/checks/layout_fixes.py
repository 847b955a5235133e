"""Fixes for a parallel layout that does not fit, each tried on a copy of the job before it is shown.

A check that finds degrees, a Ulysses degree or U that cannot run raises :class:`UnfitLayout`
with the problem alone. The runner of the job checks (``checks.check_job``, ``checks.job_problems``)
completes it here with :func:`with_fix`: every candidate is applied to a copy of the job config
and run through the same job checks, on the rank count it names; a candidate that meets a problem
the job does not already have for reasons of its own is never shown.

=====================================  =============================================================
candidates, in the order tried         shown as
=====================================  =============================================================
the values the layout's rules list     ``valid CP degrees are [2, 4]``, ``use upipe.ulysses_degree
(``cp_layout.LayoutError``)            in [2]``, ``… are 0 (= 2) or [2, 4, 8]``: the passing ones
the configured degrees on the rank     ``launch 2 or 4 ranks``
counts around the launched one
other layouts on the launched ranks:   ``set context_parallel_degree to 8 and upipe.ulysses_degree
CP, Ulysses and FSDP degrees, U        to 4``: those with the fewest changed settings
other layouts on the nearest rank      ``launch 2 ranks with context_parallel_degree 2, or 4 ranks
counts below and above                 with context_parallel_degree 4``
=====================================  =============================================================
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from titan_upipe.errors import ConfigError
from titan_upipe.spec.cp_layout import (
    CP_DEGREE_KEY,
    HEADS_PER_STAGE_KEY,
    ULYSSES_KEY,
    CPMode,
    LayoutError,
    cp_mode,
    divisors,
    layout_problem,
    valid_ulysses_degrees,
)
from titan_upipe.torchtitan_0_2.flavors import flavor_args

SHARD_KEY = "parallelism.data_parallel_shard_degree"
LAYOUT_KEYS = (CP_DEGREE_KEY, ULYSSES_KEY, SHARD_KEY, HEADS_PER_STAGE_KEY)
"""The settings a layout fix may change."""
NAMES = {CP_DEGREE_KEY: "context_parallel_degree", ULYSSES_KEY: "upipe.ulysses_degree",
         SHARD_KEY: "data_parallel_shard_degree", HEADS_PER_STAGE_KEY: "upipe.heads_per_stage"}
"""How the messages name them (the ``[parallelism]`` degrees by their key alone, as elsewhere)."""
MOST_SHOWN = 3
"""Layouts on the launched ranks named in one fix: the first ones in :func:`_ranked` order."""

Changes = tuple[tuple[str, int], ...]
"""``((setting, value), ...)``: a candidate, as the settings it changes."""
RawProblems = Callable[[Any, int], list[ConfigError]]
"""``raw_problems(job_config, world_size)``: what every job check refuses, an UnfitLayout without its fix."""


class UnfitLayout(ConfigError):
    """A layout that cannot run on the launched ranks, raised without its fix: ``str()`` is the
    problem alone, and the runner of the job checks adds the fixes that pass them (:func:`with_fix`).
    ``listed``: the ``LayoutError`` whose values are the first candidates, if the layout's rules
    list some."""

    def __init__(self, problem: str, listed: LayoutError | None = None) -> None:
        super().__init__(problem)
        self.problem, self.listed = problem, listed

    @classmethod
    def of(cls, err: LayoutError) -> UnfitLayout:
        return cls(err.problem, err)


def _setting(job_config, key: str) -> int:
    section, name = key.split(".")
    return getattr(getattr(job_config, section), name)


def applied(job_config, changes: Changes):
    """A copy of ``job_config`` with ``changes`` made (the job's own config untouched)."""
    changed = copy.deepcopy(job_config)
    for key, value in changes:
        section, name = key.split(".")
        setattr(getattr(changed, section), name, value)
    return changed


class Trial:
    """Candidates run through the job checks: one passes when every problem it meets is one the
    job has anyway, apart from its layout (``allowed``: a broken flavor or a typo elsewhere is
    not the layout's to fix)."""

    def __init__(self, job_config, world_size: int, raw_problems: RawProblems) -> None:
        self.job_config, self.world_size, self.raw_problems = job_config, world_size, raw_problems
        self.allowed = {str(err) for err in raw_problems(job_config, world_size) if not isinstance(err, UnfitLayout)}

    def passes(self, changes: Changes, world_size: int | None = None) -> bool:
        try:
            found = self.raw_problems(applied(self.job_config, changes), world_size or self.world_size)
        except Exception:  # a check that cannot even run on the candidate: not a fix
            return False
        return all(str(err) in self.allowed for err in found)


def _current(job_config) -> dict[str, int]:
    return {key: _setting(job_config, key) for key in LAYOUT_KEYS}


def _ranked(job_config, candidates: Sequence[Changes]) -> list[Changes]:
    """Fewest changed settings first, then the CP degree and the Ulysses degree nearest the
    configured ones (larger first): losing a node keeps as much of the layout as fits."""
    current = _current(job_config)

    def key(changes: Changes) -> tuple[int, ...]:
        values = {**current, **dict(changes)}
        cp, ulysses = values[CP_DEGREE_KEY], values[ULYSSES_KEY]
        return (len(changes), abs(cp - current[CP_DEGREE_KEY]), -cp, abs(ulysses - current[ULYSSES_KEY]), -ulysses)

    return sorted(set(candidates), key=key)


def _layout_candidates(job_config, world_size: int) -> list[Changes]:
    """Layouts of the job's converter on ``world_size`` ranks that the layout's own rules accept
    (``cp_layout.layout_problem``: a cheap first filter), as changes to the config."""
    par, upipe = job_config.parallelism, job_config.upipe
    others = par.tensor_parallel_degree * par.pipeline_parallel_degree * par.data_parallel_replicate_degree
    try:
        mode = cp_mode(list(job_config.model.converters))
        args = flavor_args(job_config, update=False) if mode is not None else None
    except ConfigError:
        return []
    if others < 1 or world_size % others:
        return []
    heads = (args.n_heads, args.n_kv_heads or args.n_heads) if args is not None else (0, 0)
    current = _current(job_config)
    found = []
    for cp in divisors(world_size // others):
        if (cp > 1) != (mode is not None):
            continue
        shard = -1 if par.data_parallel_shard_degree == -1 else world_size // others // cp
        ulysses_options = valid_ulysses_degrees(mode, cp) if mode is not None else [upipe.ulysses_degree]
        u_options = {upipe.heads_per_stage, 0} if mode is CPMode.UPIPE else {upipe.heads_per_stage}
        for ulysses in ulysses_options:
            for u in u_options:
                if mode is not None and layout_problem(mode, cp, ulysses, *heads, u, max(job_config.training.seq_len, 0)):
                    continue
                values = {CP_DEGREE_KEY: cp, ULYSSES_KEY: ulysses, SHARD_KEY: shard, HEADS_PER_STAGE_KEY: u}
                if changes := tuple((key, value) for key, value in values.items() if value != current[key]):
                    found.append(changes)
    return found


def fitting_layouts(trial: Trial, world_size: int) -> list[Changes]:
    """The layouts on ``world_size`` ranks that pass the job checks, with the fewest changes, best first."""
    passing = [changes for changes in _ranked(trial.job_config, _layout_candidates(trial.job_config, world_size))
               if trial.passes(changes, world_size)]
    return [changes for changes in passing if len(changes) == len(passing[0])]


def launch_candidates(job_config, world_size: int) -> list[int]:
    """Rank counts the configured degrees fill: with ``data_parallel_shard_degree = -1`` the multiples of
    the other degrees just below and above ``world_size``, else their product."""
    par = job_config.parallelism
    unit = (par.context_parallel_degree * par.tensor_parallel_degree * par.pipeline_parallel_degree
            * par.data_parallel_replicate_degree)
    if unit < 1:
        return []
    if par.data_parallel_shard_degree != -1:
        return [unit * par.data_parallel_shard_degree] if unit * par.data_parallel_shard_degree != world_size else []
    below = (world_size - 1) // unit * unit
    return [n for n in (below, world_size // unit * unit + unit) if n > 0]


def _nearest_elsewhere(trial: Trial) -> tuple[tuple[int, Changes], ...]:
    """The best layout on the nearest rank count below and above the launched one that has one."""
    world = trial.world_size
    found = []
    for counts in (range(world - 1, 0, -1), range(world + 1, max(2 * world, world + 8) + 1)):
        for count in counts:
            if layouts := fitting_layouts(trial, count):
                found.append((count, layouts[0]))
                break
    return tuple(found)


@dataclass(frozen=True)
class LayoutFix:
    """What a message proposes for a layout that does not fit, each part already tried: values of
    the setting its rules list (``listed``), the configured degrees on other rank counts
    (``launches``), other layouts on the launched ranks (``here``), or, without any of these,
    layouts on the nearest other rank counts (``elsewhere``)."""

    world_size: int
    listed: tuple[tuple[str, int], ...] = ()
    launches: tuple[int, ...] = ()
    here: tuple[Changes, ...] = ()
    elsewhere: tuple[tuple[int, Changes], ...] = ()

    def proposals(self) -> list[tuple[int, Changes]]:
        """Every (ranks, changes) the message names."""
        return [*((self.world_size, (value,)) for value in self.listed), *((n, ()) for n in self.launches),
                *((self.world_size, changes) for changes in self.here), *self.elsewhere]


def find_fix(unfit: UnfitLayout, job_config, world_size: int, raw_problems: RawProblems) -> LayoutFix:
    """The fixes of ``unfit`` that pass the job checks (the module's table, in its order)."""
    trial = Trial(job_config, world_size, raw_problems)
    if unfit.listed is not None:
        values = tuple((unfit.listed.setting, v) for v in unfit.listed.values)
        if listed := tuple(value for value in values if trial.passes((value,))):
            return LayoutFix(world_size, listed=listed)
    launches = tuple(n for n in launch_candidates(job_config, world_size) if trial.passes((), n))
    here = tuple(fitting_layouts(trial, world_size)[:MOST_SHOWN])
    elsewhere = () if launches or here else _nearest_elsewhere(trial)
    return LayoutFix(world_size, launches=launches, here=here, elsewhere=elsewhere)


def _shard_note(changes: Changes) -> str:
    shard = dict(changes).get(SHARD_KEY, -1)
    return "" if shard == -1 else " (or -1: the ranks the other degrees leave)"


def _set_text(layouts: list[Changes]) -> str:
    """``set context_parallel_degree to one of 2, 4`` or ``set context_parallel_degree and
    upipe.ulysses_degree to 8 and 4 (or 8 and 2)``: layouts that change the same settings."""
    keys = [key for key, _ in layouts[0]]
    if len(keys) == 1:
        values = sorted(value for (_, value), in layouts)
        listed = f"one of {', '.join(map(str, values))}" if len(values) > 1 else str(values[0])
        return f"set {NAMES[keys[0]]} to {listed}{_shard_note(layouts[0])}"
    tuples = [" and ".join(str(value) for _, value in changes) for changes in layouts]
    others = f" (or {', or '.join(tuples[1:])})" if len(tuples) > 1 else ""
    return f"set {' and '.join(NAMES[key] for key in keys)} to {tuples[0]}{others}{_shard_note(layouts[0])}"


def _layouts_text(layouts: tuple[Changes, ...]) -> str:
    groups: dict[tuple[str, ...], list[Changes]] = {}
    for changes in layouts:
        groups.setdefault(tuple(key for key, _ in changes), []).append(changes)
    return ", or ".join(_set_text(group) for group in groups.values())


def _with_text(world_size: int, changes: Changes) -> str:
    return f"{world_size} ranks with " + " and ".join(f"{NAMES[key]} {value}" for key, value in changes)


def fix_text(unfit: UnfitLayout, fix: LayoutFix) -> str:
    """The message: ``unfit``'s problem and ``fix`` in words."""
    if fix.listed:
        return unfit.listed.with_values([value for _, value in fix.listed])
    parts = [f"launch {' or '.join(map(str, fix.launches))} ranks"] if fix.launches else []
    if fix.here:
        parts.append(_layouts_text(fix.here))
    elif fix.launches:
        parts[0] += (f" (no context_parallel_degree fits both {fix.world_size} ranks and this job's heads, [upipe] "
                     "settings and seq_len)")
    if fix.elsewhere:
        parts.append("launch " + ", or ".join(_with_text(count, changes) for count, changes in fix.elsewhere))
    if not parts:
        parts.append(f"no parallel layout fits this job's heads, [upipe] settings and seq_len on {fix.world_size} "
                     "ranks or on the rank counts near it")
    return f"{unfit.problem}: {', or '.join(parts)}"


def with_fix(unfit: UnfitLayout, job_config, world_size: int, raw_problems: RawProblems) -> str:
    """``unfit``'s problem and the fixes that pass the job checks (:func:`find_fix`)."""
    return fix_text(unfit, find_fix(unfit, job_config, world_size, raw_problems))


def unfit(err: ConfigError) -> ConfigError:
    """``err`` as the runner of the job checks treats it: a layout the rules refuse
    (``cp_layout.LayoutError``, raised by whichever check builds the layout) is an UnfitLayout."""
    return UnfitLayout.of(err) if isinstance(err, LayoutError) else err
