"""The context-parallel layout of a job: mode, degrees, U and the sequence divisor, in one place.

Modelled on TorchTitan's ``ParallelDims``: a frozen dataclass built from the settings and
validated once, in ``__post_init__``; everything else (the job checks, the converters' mesh,
the planner, the emulator, ``titan_upipe.validate``) reads its fields instead of re-deriving
them. Pure arithmetic: no torch, no TorchTitan.

============  ==========================  =================  =========================
mode          ``[upipe] ulysses_degree``  (ring, ulysses)    sequence divisor
============  ==========================  =================  =========================
ulysses       0 or C                      (1, C)             C (contiguous shards)
upipe         0 or C                      (1, C)             C
upipe         d, 1 <= d < C, d | C        (C/d, d)           2 (C/d) d (zigzag x contiguous)
ring          0 or 1                      (C, 1)             2 C (zigzag)
usp           d, 1 < d < C, d | C         (C/d, d)           2 (C/d) d
tsp           0 or 1                      (C, 1)             2 C (zigzag; weights sharded too)
none          (CP degree 1)               (1, 1)             1
============  ==========================  =================  =========================

U (UPipe's query heads per stage) is a multiple of the Ulysses degree dividing H; 0 means
U = the Ulysses degree. The Ulysses degree must split the heads exactly: it divides H, and
either it divides the KV heads or the KV heads divide it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from titan_upipe.errors import ConfigError

CP_DEGREE_KEY = "parallelism.context_parallel_degree"
ULYSSES_KEY = "upipe.ulysses_degree"
HEADS_PER_STAGE_KEY = "upipe.heads_per_stage"
"""The settings whose valid values a :class:`LayoutError` lists."""


def values_text(values: Sequence[int]) -> str:
    """``[2, 4]``, or ``none``: a list of valid values as the layout's messages name them."""
    return str(list(values)) if values else "none"


class LayoutError(ConfigError):
    """A layout setting the rules refuse, with the values they allow: the message is ``problem: fix``,
    ``fix`` naming the ``values`` of ``setting`` (a template with ``{values}``). The rules here see the
    layout alone; a caller that can try each value against the whole job (the job checks,
    ``torchtitan_0_2.checks.layout_fixes``) shows only the values that pass there."""

    def __init__(self, problem: str, setting: str, values: Sequence[int], fix: str) -> None:
        self.problem, self.setting, self.values, self.fix = problem, setting, tuple(values), fix
        super().__init__(self.with_values(self.values))

    def with_values(self, values: Sequence[int]) -> str:
        """The message naming ``values`` instead of every value the layout's rules allow."""
        return f"{self.problem}: {self.fix.format(values=values_text(values))}"


class CPMode(StrEnum):
    """The context-parallel attentions, by their model-converter names."""

    ULYSSES = "ulysses"
    UPIPE = "upipe"
    RING = "ring"
    USP = "usp"
    TSP = "tsp"
    """Folded tensor and sequence parallelism (``titan_upipe.tsp``): zigzag shards like the ring,
    heads never move; the blocks' weights are sharded over the same ranks."""


CP_MODES: tuple[str, ...] = tuple(mode.value for mode in CPMode)
"""Converter names that provide context-parallel attention (the one list of modes)."""


def check_mode(mode: str) -> CPMode:
    if mode not in CP_MODES:
        raise ConfigError(f"unknown context-parallel mode {mode!r}: valid modes are {', '.join(CP_MODES)}")
    return CPMode(mode)


def cp_mode(converters: list[str]) -> CPMode | None:
    """The context-parallel attention named in ``model.converters``, if any."""
    modes = [name for name in converters if name in CP_MODES]
    if len(modes) > 1:
        raise ConfigError(
            f"model.converters names several context-parallel attentions {modes}: keep one of {', '.join(CP_MODES)}"
        )
    return CPMode(modes[0]) if modes else None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_ulysses_degrees(mode: str, cp_degree: int) -> list[int]:
    """``[upipe] ulysses_degree`` values each mode accepts at CP degree ``cp_degree`` (before head checks)."""
    if mode == CPMode.ULYSSES:
        return [0, cp_degree]
    if mode in (CPMode.RING, CPMode.TSP):
        return [0, 1]
    if mode == CPMode.USP:
        return [d for d in divisors(cp_degree) if 1 < d < cp_degree]
    return [0, *divisors(cp_degree)]  # upipe: 0/C = 1-D UPipe; d < C = UPipe inside USP with d Ulysses ranks


def resolve_mesh_shape(mode: str, cp_degree: int, ulysses_degree: int) -> tuple[int, int, bool]:
    """``(ring degree, ulysses degree, 2-D mesh?)`` for a job's mode and ``[upipe] ulysses_degree``.

    ulysses: 0 or C (all of CP is Ulysses). upipe: 0 or C is plain UPipe; ``1 <= d < C``
    dividing C is UPipe inside USP (each stage's attention is a ring over ``C/d`` ranks).
    ring: 0 or 1 (no Ulysses). usp: ``1 < d < C`` dividing C (otherwise it is ulysses or ring).
    """
    mode = check_mode(mode).value
    valid = valid_ulysses_degrees(mode, cp_degree)
    if ulysses_degree not in valid:
        hint = {"usp": " (ulysses_degree = CP is mode 'ulysses', 1 is mode 'ring')",
                "ulysses": " (for Ulysses x ring use mode 'usp')",
                "ring": " (for Ulysses x ring use mode 'usp')"}.get(mode, "")
        raise LayoutError(f"upipe.ulysses_degree = {ulysses_degree} is invalid for mode {mode!r} at "
                          f"parallelism.context_parallel_degree = {cp_degree}", ULYSSES_KEY, valid,
                          "valid values are {values}" + hint)
    if mode in (CPMode.RING, CPMode.TSP):
        return cp_degree, 1, False
    if mode in (CPMode.ULYSSES, CPMode.UPIPE) and ulysses_degree in (0, cp_degree):
        return 1, cp_degree, False
    return cp_degree // ulysses_degree, ulysses_degree, True


def _kv_split_ok(n_kv_heads: int, cp_degree: int) -> bool:
    # Either every rank owns whole KV heads (C divides KV), or every KV head is shared
    # by a whole number of ranks whose query heads all belong to it (KV divides C).
    return n_kv_heads % cp_degree == 0 or cp_degree % n_kv_heads == 0


def valid_cp_degrees(n_heads: int, n_kv_heads: int) -> list[int]:
    """CP (Ulysses) degrees that split these heads exactly."""
    return [c for c in range(1, n_heads + 1) if n_heads % c == 0 and _kv_split_ok(n_kv_heads, c)]


def valid_heads_per_stage(n_heads: int, cp_degree: int) -> list[int]:
    """Values of U (query heads per UPipe stage): multiples of C that divide H."""
    return [u for u in range(cp_degree, n_heads + 1, cp_degree) if n_heads % u == 0]


def check_cp_degree(n_heads: int, n_kv_heads: int, cp_degree: int, what: str = "context-parallel degree") -> None:
    """``cp_degree`` is the Ulysses degree (all of CP for ulysses/upipe on a 1-D mesh)."""
    if n_heads % n_kv_heads != 0:
        raise ConfigError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    if cp_degree < 1 or n_heads % cp_degree != 0 or not _kv_split_ok(n_kv_heads, cp_degree):
        raise LayoutError(f"{what} {cp_degree} cannot split n_heads={n_heads}, n_kv_heads={n_kv_heads} exactly",
                          CP_DEGREE_KEY, [c for c in valid_cp_degrees(n_heads, n_kv_heads) if c > 1],
                          "valid CP degrees are {values}")


def resolve_heads_per_stage(n_heads: int, n_kv_heads: int, cp_degree: int, heads_per_stage: int | None) -> int:
    """U for UPipe; None or 0 means U = C (the paper's most memory-frugal choice)."""
    check_cp_degree(n_heads, n_kv_heads, cp_degree)
    if heads_per_stage is None or heads_per_stage == 0:
        return cp_degree
    valid = valid_heads_per_stage(n_heads, cp_degree)
    if not isinstance(heads_per_stage, int) or heads_per_stage not in valid:
        why = (
            f"not a multiple of the CP degree {cp_degree}"
            if not isinstance(heads_per_stage, int) or heads_per_stage % cp_degree
            else f"n_heads={n_heads} is not divisible by it"
        )
        raise LayoutError(f"upipe.heads_per_stage={heads_per_stage!r} is invalid ({why})", HEADS_PER_STAGE_KEY, valid,
                          f"valid values for n_heads={n_heads} at CP degree {cp_degree} are 0 (= {cp_degree}) or "
                          "{values}")
    return heads_per_stage


def check_ulysses_heads(mode: str, n_heads: int, n_kv_heads: int, cp: int, ulysses: int) -> None:
    """With a ring, only the Ulysses degree splits heads (K/V replicated when it exceeds KV)."""
    try:
        check_cp_degree(n_heads, n_kv_heads, ulysses, what="upipe.ulysses_degree")
    except LayoutError as exc:
        valid = [d for d in valid_ulysses_degrees(mode, cp) if d > 0 and n_heads % d == 0
                 and (n_kv_heads % d == 0 or d % n_kv_heads == 0)]
        raise LayoutError(exc.problem, ULYSSES_KEY, valid,
                          f"for mode {mode!r} at CP {cp} use upipe.ulysses_degree in " + "{values}") from None


def sequence_divisor(cp_degree: int, ring_degree: int, ulysses_degree: int) -> int:
    """``seq_len`` must be a multiple of this: C (contiguous), or ``2 x ring x ulysses`` (zigzag)."""
    return cp_degree if ring_degree == 1 else 2 * ring_degree * ulysses_degree


def check_sequence_length(seq_len: int, ring_degree: int, ulysses_degree: int, key: str = "sequence length") -> None:
    """A sequence of ``seq_len`` tokens (``key`` names the setting) splits over ``ring x ulysses``
    ranks: the one rule and message of ``sequence_divisor``, for the job checks, the sequence
    layouts and the attention's per-call check alike."""
    cp = ring_degree * ulysses_degree
    unit = sequence_divisor(cp, ring_degree, ulysses_degree)
    if seq_len > 0 and seq_len % unit == 0:
        return
    what = (f"the context-parallel degree {cp} (parallelism.context_parallel_degree)" if ring_degree == 1 else
            f"2 x ring x ulysses = 2 x {ring_degree} x {ulysses_degree} = {unit} (zigzag chunks over the Ulysses ranks)")
    raise ConfigError(f"{key} = {seq_len} is not divisible by {what}: "
                      f"use a multiple of {unit} (e.g. {seq_len - seq_len % unit or unit})")


def layout_degrees(mode: CPMode | None, cp: int, ulysses_setting: int = 0, n_heads: int = 0,
                   n_kv_heads: int = 0) -> tuple[int, int, bool]:
    """``(ring degree, ulysses degree, 2-D mesh?)`` of a mode on ``cp`` ranks with ``[upipe]
    ulysses_degree``, or LayoutError (the heads only name the CP degrees to suggest): the degrees
    part of :class:`CPLayout`, for a caller that needs no heads checked."""
    if mode is None:
        if cp > 1:
            raise ConfigError(
                f"parallelism.context_parallel_degree = {cp} needs a context-parallel attention converter: "
                f"add one of {', '.join(CP_MODES)} to model.converters"
            )
        return 1, 1, False
    if cp < 2:
        degrees = [c for c in valid_cp_degrees(n_heads, n_kv_heads or n_heads) if c > 1]
        raise LayoutError(f"model.converters has {mode.value!r} but parallelism.context_parallel_degree = {cp}",
                          CP_DEGREE_KEY, degrees, "valid values are {values}" if degrees else "set it to 2 or more")
    if cp % max(ulysses_setting, 1):
        raise LayoutError(f"upipe.ulysses_degree = {ulysses_setting} does not divide "
                          f"parallelism.context_parallel_degree = {cp}", ULYSSES_KEY,
                          valid_ulysses_degrees(mode, cp), f"valid values for mode {mode.value!r} are " + "{values}")
    return resolve_mesh_shape(mode, cp, ulysses_setting)


@dataclass(frozen=True)
class CPLayout:
    """A job's context-parallel layout, validated once (see the module table).

    Settings: ``mode`` (None: no CP attention), ``cp_degree`` (``parallelism.context_parallel_degree``),
    ``ulysses_setting`` (``[upipe] ulysses_degree``), the model's ``n_heads``/``n_kv_heads`` (0: not
    known, head checks skipped), ``heads_per_stage_setting`` (``[upipe] heads_per_stage``, UPipe
    only) and ``seq_len`` (0: not checked). Derived: ``ring_degree``, ``ulysses_degree``,
    ``two_d`` (a ``("ring", "ulysses")`` mesh), ``heads_per_stage`` (U; the head count for other
    modes, 0 without heads) and ``seq_divisor``. Every problem raises ConfigError naming the
    setting, the valid values and the fix.
    """

    mode: CPMode | None
    cp_degree: int = 1
    ulysses_setting: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    heads_per_stage_setting: int = 0
    seq_len: int = 0
    ring_degree: int = field(init=False)
    ulysses_degree: int = field(init=False)
    two_d: bool = field(init=False)
    heads_per_stage: int = field(init=False)
    seq_divisor: int = field(init=False)

    def __post_init__(self) -> None:
        mode = None if self.mode is None else check_mode(self.mode)
        object.__setattr__(self, "mode", mode)
        ring, ulysses, two_d = self._degrees(mode)
        heads = self._heads_per_stage(mode, ring, ulysses)
        for name, value in (("ring_degree", ring), ("ulysses_degree", ulysses), ("two_d", two_d),
                            ("heads_per_stage", heads),
                            ("seq_divisor", sequence_divisor(max(self.cp_degree, 1), ring, ulysses))):
            object.__setattr__(self, name, value)
        self._check_seq_len()

    def _degrees(self, mode: CPMode | None) -> tuple[int, int, bool]:
        return layout_degrees(mode, self.cp_degree, self.ulysses_setting, self.n_heads, self.n_kv_heads)

    def _heads_per_stage(self, mode: CPMode | None, ring: int, ulysses: int) -> int:
        if mode is None or not self.n_heads:
            return self.n_heads
        n_kv_heads = self.n_kv_heads or self.n_heads
        if ring == 1:
            check_cp_degree(self.n_heads, n_kv_heads, self.cp_degree)
        else:
            check_ulysses_heads(mode.value, self.n_heads, n_kv_heads, self.cp_degree, ulysses)
        if mode is CPMode.UPIPE:
            return resolve_heads_per_stage(self.n_heads, n_kv_heads, ulysses, self.heads_per_stage_setting)
        return self.n_heads

    def _check_seq_len(self) -> None:
        if self.seq_len:
            self.check_length(self.seq_len, "training.seq_len")

    def check_length(self, seq_len: int, key: str) -> None:
        """A sequence of ``seq_len`` tokens (the setting ``key``) can be sharded in this layout."""
        if self.mode is not None:
            check_sequence_length(seq_len, self.ring_degree, self.ulysses_degree, key)

    @property
    def has_ring(self) -> bool:
        """Ring (zigzag) attention over ``ring_degree > 1`` ranks: ring, USP, UPipe inside USP."""
        return self.ring_degree > 1

    @property
    def local_len(self) -> int:
        """Tokens of one sequence on one CP rank (needs ``seq_len``)."""
        return self.seq_len // self.cp_degree

    @property
    def name(self) -> str:
        """The layout as reports name it: ``none``, ``ulysses``, ``upipe``, ``ring``, ``usp`` or
        ``upipe-in-usp`` (UPipe whose stages attend over a ring)."""
        if self.mode is None:
            return "none"
        if self.mode is CPMode.UPIPE and self.has_ring:
            return "upipe-in-usp"
        return self.mode.value


def layout_problem(mode: CPMode | str | None, cp_degree: int, ulysses_setting: int = 0, n_heads: int = 0,
                   n_kv_heads: int = 0, heads_per_stage_setting: int = 0, seq_len: int = 0) -> str | None:
    """What :class:`CPLayout` refuses in these settings (its message), or None when they build a
    layout: the one test of a candidate (a CP degree to suggest, say) against every rule at once."""
    try:
        CPLayout(mode, cp_degree, ulysses_setting, n_heads, n_kv_heads, heads_per_stage_setting, seq_len)
    except ConfigError as err:
        return str(err)
    return None
