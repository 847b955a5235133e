"""The plugin's job settings by section, as plain dataclasses that validate themselves (pure values).

Every TorchTitan adapter hosts these sections in its own config: TorchTitan 0.2 merges them into its
``JobConfig`` (``torchtitan_0_2.config.JobConfig``), field by field where a section shares a stock
section's name (``[activation_checkpoint]``, ``[optimizer]``, ``[training]``, ``[metrics]``). Each
section checks its own values in ``__post_init__`` and names the key and the valid choices, so a
bad value fails before any process group starts, with the same message on every TorchTitan version.

========================= ===================== ===============================================
section (TOML)            class                 what
========================= ===================== ===============================================
``[upipe]`` (alias        ``UPipe``             every CP mode's kernel, Ulysses degree, U, the
``[context_parallel]``)                         document balance
``[tsp]``                 ``TSP``               the ``tsp`` converter's buckets and overlap
``[transforms]``          ``Transforms``        tile and chunk sizes, the CE kernel
``[activation_checkpoint]`` ``ActivationCheckpointOffload`` offload, resident blocks, keep-attention
``[optimizer]``           ``OptimizerHostState`` AdamW moments on the host
``[training]``            ``TrainingHealth``     what a NaN step does
``[metrics]``             ``MetricsConsole``     progress lines, every rank's log
``[local_data]``          ``LocalData``          ``local_text`` files
========================= ===================== ===============================================

The valid names come from ``spec.settings`` (torch-free mirrors of the runtime's tables, checked equal
by ``tests/test_job_spec.py``).
"""

# No `from __future__ import annotations`: TorchTitan 0.2 merges these fields by their runtime types,
# which must be classes, not strings.

from dataclasses import MISSING, dataclass, field, fields
from typing import TypeVar

from titan_upipe.errors import ConfigError, with_suggestion
from titan_upipe.spec.settings import (
    ATTENTION_BACKEND_NAMES,
    CE_BACKEND_NAMES,
    DEFAULT_MIN_SPLIT,
    DOCUMENT_BALANCES,
)

ATTENTION_BACKENDS = ("auto", *ATTENTION_BACKEND_NAMES)
"""``[upipe] attention_backend``: ``auto`` and every local kernel (``attention.backends.BACKEND_SETTINGS``)."""
KERNEL_BACKENDS = CE_BACKEND_NAMES
"""``[transforms] ce_backend`` (``transforms.fused_ce.CE_BACKENDS``)."""


def check_document_balance(balance: str, min_split: int, section: str = "") -> None:
    """``balance`` is one of ``DOCUMENT_BALANCES`` and ``min_split`` a positive token count; the message
    names the keys under ``section`` (``"upipe."`` for the TOML's ``[upipe]``)."""
    if balance not in DOCUMENT_BALANCES:
        raise ConfigError(with_suggestion(f"invalid {section}document_balance = {balance!r}: valid values are "
                                          f"{', '.join(DOCUMENT_BALANCES)}", balance, DOCUMENT_BALANCES))
    if isinstance(min_split, bool) or not isinstance(min_split, int) or min_split < 1:
        raise ConfigError(f"invalid {section}document_min_split = {min_split!r}: valid values are a positive number "
                          f"of tokens (default {DEFAULT_MIN_SPLIT})")


def _require(ok: bool, key: str, value: object, valid: str) -> None:
    if not ok:
        raise ConfigError(f"invalid {key} = {value!r}: valid values are {valid}")


def _require_choice(value: object, key: str, choices: tuple[str, ...]) -> None:
    """``value`` is one of ``choices``; otherwise a ConfigError listing them, with the closest
    one for a typo (``sdpaa`` -> ``sdpa``)."""
    if value not in choices:
        raise ConfigError(with_suggestion(f"invalid {key} = {value!r}: valid values are {', '.join(choices)}",
                                          value, choices))


@dataclass
class UPipe:
    """The context-parallel settings of every CP mode (``ulysses``, ``upipe``, ``ring``, ``usp``,
    ``tsp``): the local kernel and the Ulysses degree for all of them, U for ``upipe`` alone. TOML
    ``[context_parallel]`` or ``[upipe]``, flags ``--context_parallel.X`` or ``--upipe.X``; the field,
    ``--help`` and the messages keep the plugin's name, ``upipe`` (``spec.recipe_file.SECTION_ALIASES``,
    ``docs/config.md``)."""

    heads_per_stage: int = 0
    """U, the query heads processed per UPipe stage: a multiple of the Ulysses degree that
    divides the head count. 0 means U = the Ulysses degree (the paper's most memory-frugal choice).
    Read by ``upipe`` alone: set under another mode it has no effect, and the job checks warn
    (``checks.ignored``)."""

    attention_backend: str = "auto"
    """Local attention kernel: auto (at conversion, the fastest installed one that runs the
    training dtype and head_dim, in the order measured on GPUs of that architecture
    (titan_upipe/resources/kernel_speed.csv), unmeasured kernels placed by the architecture's default
    order: sm90+ flash_attn4 > flash_attn3 > cudnn > flash_attn > sdpa, else flash_attn4 >
    flash_attn3 > flash_attn > sdpa > cudnn; logged and written to TensorBoard), sdpa
    (torch's fused kernels, CPU and GPU), math (explicit fp32
    reference, any device), cudnn (cuDNN attention through torch's own ops: GPU sm80+, cuDNN >=
    9.15.1, fp16/bf16, head_dim a multiple of 8 up to 128), flash_attn, flash_attn3, flash_attn4
    (GPU, fp16/bf16, when installed)."""

    ulysses_degree: int = 0
    """Ulysses (all-to-all) degree inside the CP mesh; the rest is ring. 0 means all of CP is Ulysses."""

    document_balance: str = "documents"
    """How packed documents (``attn_mask_type = "block_causal"``) are laid out over a ring (ring, usp,
    upipe inside usp): documents (each batch's own layout, ``parallel.DocumentZigzagLayout``: long
    documents zigzagged inside themselves, short ones dealt whole to the least-loaded ring rank;
    the busiest ring rank within a few % of the mean) or zigzag (the fixed layout of causal
    training: the busiest rank 1.4-3x the mean on packed data, docs/benchmarks/document_balance.md).
    Both are exact; no effect without a ring or without packed documents."""

    document_min_split: int = DEFAULT_MIN_SPLIT
    """With document_balance = "documents": documents of at least this many tokens, or of a quarter of a
    ring rank's share (seq_len / (4 x ring), at least 2 x ring x 128) when that is shorter, are cut into
    2 x ring pieces (zigzag inside the document); shorter ones go whole to one ring rank
    (``costs.document_balance.split_threshold``)."""

    def __post_init__(self) -> None:
        _require(
            isinstance(self.heads_per_stage, int) and self.heads_per_stage >= 0,
            "upipe.heads_per_stage",
            self.heads_per_stage,
            "0 (U = Ulysses degree) or a positive multiple of the Ulysses degree dividing n_heads",
        )
        _require_choice(self.attention_backend, "upipe.attention_backend", ATTENTION_BACKENDS)
        _require(
            isinstance(self.ulysses_degree, int) and self.ulysses_degree >= 0,
            "upipe.ulysses_degree",
            self.ulysses_degree,
            "0 (all of CP) or a positive divisor of parallelism.context_parallel_degree",
        )
        check_document_balance(self.document_balance, self.document_min_split, "upipe.")


@dataclass
class TSP:
    """Settings of the ``tsp`` converter (folded tensor and sequence parallelism, ``docs/tsp.md``);
    its degree is ``parallelism.context_parallel_degree``, its kernel ``[upipe] attention_backend``."""

    kv_heads_per_bucket: int = 0
    """KV heads per K/V all-gather (the paper's head buckets): each all-gather moves this many KV
    heads of the whole sequence, so the attention holds ``2 x bucket x head_dim`` values per token
    of K/V at once. 0: all of a rank's ``n_kv_heads / D`` KV heads in one all-gather per owner.
    Must divide ``n_kv_heads / D``."""

    overlap: bool = True
    """Start each transfer before the compute that does not need it: the next owner's weight
    broadcast during this owner's attention, the next bucket's K/V all-gather during this bucket's,
    the MLP ring's send/receive during the step's GEMMs (async collectives; the same numbers)."""

    mlp_recompute: bool = True
    """The ring MLP saves only its weight shards and recomputes each step's two ``[T, F/D]``
    projections in backward (two more GEMMs per step): ``2 x T x F`` values per block less from its
    forward to its backward (at 1M tokens on 8 ranks, Llama3-8B: 7 GiB in bf16)."""

    def __post_init__(self) -> None:
        _require(isinstance(self.overlap, bool), "tsp.overlap", self.overlap, "true or false")
        _require(isinstance(self.mlp_recompute, bool), "tsp.mlp_recompute", self.mlp_recompute, "true or false")
        _require(isinstance(self.kv_heads_per_bucket, int) and not isinstance(self.kv_heads_per_bucket, bool)
                 and self.kv_heads_per_bucket >= 0, "tsp.kv_heads_per_bucket", self.kv_heads_per_bucket,
                 "0 (all of a rank's KV heads) or a positive divisor of n_kv_heads / context_parallel_degree")


def _require_tile(value: object, key: str) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, key, value,
             "0 (automatic size) or a positive number of tokens")


@dataclass
class Transforms:
    """Settings of the memory transforms (``tiled_mlp``, ``tiled_rmsnorm``, ``fused_ce``
    converters). Every size is in tokens of this rank's batch; 0 picks the default. A setting
    whose converter is not in ``model.converters`` has no effect (a warning: ``checks.ignored``)."""

    mlp_tile_tokens: int = 0
    """Tokens per tiled-MLP tile; 0 means d_model tokens (the paper's square tile)."""

    rmsnorm_tile_tokens: int = 0
    """Tokens per tiled-RMSNorm tile; 0 means d_model tokens."""

    ce_chunk_tokens: int = 0
    """Tokens per fused cross-entropy chunk (torch path); 0 makes a chunk's logits about as
    large as the hidden states (ceil(tokens * d_model / vocab) tokens)."""

    ce_backend: str = "auto"
    """auto (Liger's fused linear cross-entropy on CUDA when installed, else the chunked torch
    path), torch, or liger (CUDA with liger-kernel installed)."""

    def __post_init__(self) -> None:
        _require_tile(self.mlp_tile_tokens, "transforms.mlp_tile_tokens")
        _require_tile(self.rmsnorm_tile_tokens, "transforms.rmsnorm_tile_tokens")
        _require_tile(self.ce_chunk_tokens, "transforms.ce_chunk_tokens")
        _require_choice(self.ce_backend, "transforms.ce_backend", KERNEL_BACKENDS)


@dataclass
class ActivationCheckpointOffload:
    """Fields merged into TorchTitan's own ``[activation_checkpoint]`` section (TorchTitan merges
    same-named sections field by field; its ``mode`` etc. stay as they are). Checked by
    ``titan_upipe.torchtitan_0_2.checks.check_offload`` because the merged section keeps TorchTitan's class."""

    cpu_offload: bool = False
    """With ``mode = "full"``: keep each block's saved input in host memory between forward and
    backward; backward prefetches the next block's input while the current one recomputes."""

    pin_memory: bool = True
    """Offload into page-locked host memory (faster copies; set false when host RAM is short)."""

    resident_blocks: int = 0
    """With ``cpu_offload``: the last N blocks keep their input on the device (backward needs them
    first): N block inputs less host memory, N more on the device from their forward to their
    backward, never at the backward peak (blocks 0-1) (``docs/planner.md``, issue 18). At most
    the model's blocks (``checks.training.check_resident_blocks``; all of them: a warning)."""

    prefetch_after_attention: bool = False
    """With ``cpu_offload``: start the copy of the input the next block's backward needs only after
    this block's attention backward, not before its recompute: one hidden state less at the
    backward peak, a copy the next block may wait for (``docs/planner.md``, issue 18)."""

    keep_attention: str = "off"
    """With ``cpu_offload`` and a context-parallel converter: blocks keep their attention's output
    and LSE from forward to backward, so their recomputation does not run the attention kernel's
    forward again (``titan_upipe.attention.keep``; ``T x H x (D x a + 4)`` bytes per block and rank,
    1.02 GiB for Llama3-8B at 1M tokens on 8 ranks). off (every block recomputes it), device (kept
    on the GPU), host (in pinned host memory, copied on the offload streams and fetched back with
    the block's input), auto (on the GPU for as many blocks as fit its memory, then on the host
    for as many as fit host memory; sized by the planner at launch). The results are bit for bit
    those of full recomputation."""

    keep_attention_blocks: str = "auto"
    """With ``keep_attention``: how many blocks keep (the last ones: their backward comes first),
    a number from 0 to the model's blocks, or auto (as many as fit: the planner sizes it at launch,
    from the GPU's memory and the node's host memory)."""


@dataclass
class OptimizerHostState:
    """Fields merged into TorchTitan's own ``[optimizer]`` section (checked by
    ``titan_upipe.torchtitan_0_2.checks.check_optimizer``: the merged section keeps TorchTitan's class)."""

    state_on_host: bool = False
    """AdamW's ``exp_avg``/``exp_avg_sq`` in host memory (pinned on CUDA), streamed through two
    device buffers of the largest parameter shard during the step (``titan_upipe.optim.host_adamw``):
    ``8 P / W`` bytes per rank move from the device to the host, the update is bitwise AdamW's."""


NONFINITE_ACTIONS = ("stop", "skip_step", "warn")
"""``training.on_nonfinite``: what a step whose loss or gradient norm is NaN or infinite does
(``titan_upipe.torchtitan_0_2.health``)."""


@dataclass
class TrainingHealth:
    """Fields merged into TorchTitan's own ``[training]`` section (checked by
    ``titan_upipe.torchtitan_0_2.checks.health``: the merged section keeps TorchTitan's class)."""

    on_nonfinite: str = "stop"
    """A step whose loss or gradient norm is NaN or infinite: stop (the job ends at once with one
    line: the step, the value, the last complete checkpoint, the likely cause; exit status 3),
    skip_step (no optimizer or LR step for it, its gradients dropped, a warning; training goes on)
    or warn (a warning, and the update is applied as TorchTitan does: the weights are then
    usually NaN for good)."""


@dataclass
class MetricsConsole:
    """Fields merged into TorchTitan's own ``[metrics]`` section: what the console shows (the merged
    section keeps TorchTitan's class). Progress lines through a long step:
    ``titan_upipe.torchtitan_common.progress``, checked by ``checks.training.check_metrics``."""

    progress_after_seconds: float = 60.0
    """Once a step has run this long (or the previous one did), rank 0 logs its forward, backward and
    optimizer progress block by block, with an estimate for the step, and writes the phase times
    to TensorBoard (``progress/…``). 0: every step."""

    log_all_ranks: bool = False
    """Every rank logs its INFO and WARNING lines (TorchTitan's step lines, the model arguments, its
    start-up warnings). Off: rank 0 alone does, the others log errors only, so that each line
    reaches the console once."""


@dataclass
class LocalData:
    """The files of ``training.dataset = "local_text"`` (``titan_upipe.data.local_text``)."""

    paths: list[str] = field(default_factory=list)
    """Glob patterns of .jsonl / .parquet / .txt files (``**`` recurses; relative to the launch
    directory). Every match is read, in sorted order; each pattern must match a file."""

    text_key: str = "text"
    """The JSON key / Parquet column holding a document's text (.txt files are one document each)."""

    skip_bad_records: bool = False
    """Skip a record that cannot be read (a JSONL line that is not a JSON object, a record without
    ``text_key`` or whose text is not a string, a text file that is not UTF-8) instead of stopping
    the job with its file and line; each skip counts, the first ones logged with file and line."""

    def __post_init__(self) -> None:
        _require(isinstance(self.paths, list) and all(isinstance(p, str) and p for p in self.paths),
                 "local_data.paths", self.paths, "a list of glob patterns, e.g. [\"/data/books/*.jsonl\"]")
        _require(isinstance(self.text_key, str) and bool(self.text_key), "local_data.text_key", self.text_key,
                 "a non-empty key name")
        _require(isinstance(self.skip_bad_records, bool), "local_data.skip_bad_records", self.skip_bad_records,
                 "true or false")


T = TypeVar("T")


def plugin_fields(section: object, fields_class: type[T]) -> T:
    """The plugin's fields of a TorchTitan section as ``fields_class`` (``ActivationCheckpointOffload``,
    ``OptimizerHostState``, ``Transforms``): TorchTitan merges same-named sections field by field,
    so ``[activation_checkpoint]`` and ``[optimizer]`` keep TorchTitan's class, and a config parsed
    without this module (``-m torchtitan.train`` with ``custom_import`` alone) has none of them.
    The section's values where it has them, else the defaults stated once, in the dataclass
    (values are taken as they are: the job checks say what is wrong with one)."""
    values = {f.name: getattr(section, f.name) for f in fields(fields_class) if hasattr(section, f.name)}
    instance = object.__new__(fields_class)
    for f in fields(fields_class):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        object.__setattr__(instance, f.name, values.get(f.name, default))
    return instance
