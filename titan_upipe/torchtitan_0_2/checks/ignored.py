"""Settings that have no effect in this job's layout, named as warnings (``checks.config_warnings``).

A plugin field set away from its default (the default stated once, in its dataclass in
``torchtitan_0_2.config``) where nothing reads it: U without the ``upipe`` converter, a tile size
without its tiled converter, offload or TSP knobs without offload or TSP, the local files without
the ``local_text`` dataset, offload with every block resident. The job runs as if it were not
set, which is what a user should hear before it does. (A setting that contradicts the model,
``resident_blocks`` above its block count, is an error: ``training.check_resident_blocks``.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any

from titan_upipe.data.local_text import LOCAL_TEXT_DATASET
from titan_upipe.errors import ConfigError
from titan_upipe.spec.cp_layout import CPMode, cp_mode, layout_degrees
from titan_upipe.torchtitan_0_2.config import (
    TSP,
    ActivationCheckpointOffload,
    LocalData,
    Transforms,
    UPipe,
    plugin_fields,
)
from titan_upipe.torchtitan_0_2.flavors import flavor_args

Unused = Callable[[Any], str | None]
"""``unused(job_config)``: why the keys have no effect in this job (None: they have one)."""


@dataclass(frozen=True)
class Rule:
    """Keys of one plugin section and when they have no effect."""

    section: str
    fields_class: type
    keys: tuple[str, ...]
    unused: Unused
    fix: str
    """What to do besides dropping the keys (``", or add 'tiled_mlp' to model.converters"``)."""


def _mode(job_config) -> CPMode | None:
    return cp_mode(list(job_config.model.converters))


def _not_upipe(job_config) -> str | None:
    mode = _mode(job_config)
    if mode is CPMode.UPIPE:
        return None
    runs = f"runs {mode.value!r}" if mode else "has no context-parallel attention"
    return f"it is U, UPipe's query heads per stage, and model.converters {runs}"


def _no_cp_attention(job_config) -> str | None:
    if _mode(job_config) is not None:
        return None
    return "model.converters has no context-parallel attention (TorchTitan's attention runs)"


def _without_converter(name: str) -> Unused:
    def unused(job_config) -> str | None:
        return None if name in job_config.model.converters else f"model.converters has no {name!r}"

    return unused


def _not_offloaded(job_config) -> str | None:
    if plugin_fields(job_config.activation_checkpoint, ActivationCheckpointOffload).cpu_offload:
        return None
    return "activation_checkpoint.cpu_offload is false (no block input is offloaded)"


def _keeps_no_attention(job_config) -> str | None:
    where = plugin_fields(job_config.activation_checkpoint, ActivationCheckpointOffload).keep_attention
    return None if where != "off" else "activation_checkpoint.keep_attention is \"off\" (no block keeps its attention)"


def _local_readers(job_config) -> list[str]:
    """The settings whose dataset is ``local_text``."""
    validation = job_config.validation
    readers = ["training.dataset"] if job_config.training.dataset == LOCAL_TEXT_DATASET else []
    if validation.enable and validation.dataset == LOCAL_TEXT_DATASET:
        readers.append("validation.dataset")
    return readers


def _no_local_training_data(job_config) -> str | None:
    if "training.dataset" in _local_readers(job_config):
        return None
    return f"training.dataset is {job_config.training.dataset!r}, not {LOCAL_TEXT_DATASET!r}"


def _no_local_data(job_config) -> str | None:
    if _local_readers(job_config):
        return None
    return f"neither training.dataset nor an enabled validation.dataset is {LOCAL_TEXT_DATASET!r}"


def _no_documents_on_a_ring(job_config) -> str | None:
    mode = _mode(job_config)
    upipe = plugin_fields(job_config.upipe, UPipe)
    if mode is None or mode is CPMode.TSP:
        return "model.converters has no ring attention (ring, usp, upipe inside usp)"
    cp = job_config.parallelism.context_parallel_degree
    ring = (layout_degrees(mode, cp, upipe.ulysses_degree)[0]
            if isinstance(upipe.ulysses_degree, int) and isinstance(cp, int) else 2)
    if ring == 1:
        return f"{mode.value!r} on {cp} ranks has no ring (Ulysses and UPipe alone are balanced already)"
    try:
        mask_type = getattr(flavor_args(job_config, update=False), "attn_mask_type", "causal")
    except ConfigError:  # an unknown flavor: check_job says so
        return None
    if mask_type != "block_causal":
        return f"model.flavor {job_config.model.flavor!r} has attn_mask_type {mask_type!r} (no packed documents)"
    return None


def _no_document_layout(job_config) -> str | None:
    why = _no_documents_on_a_ring(job_config)
    if why or plugin_fields(job_config.upipe, UPipe).document_balance == "documents":
        return why
    return "upipe.document_balance is 'zigzag' (the fixed layout splits no document by size)"


RULES = (
    Rule("upipe", UPipe, ("heads_per_stage",), _not_upipe, ", or use the 'upipe' converter"),
    Rule("upipe", UPipe, ("attention_backend", "ulysses_degree"), _no_cp_attention,
         ", or add a context-parallel converter to model.converters"),
    Rule("upipe", UPipe, ("document_balance",), _no_documents_on_a_ring, ""),
    Rule("upipe", UPipe, ("document_min_split",), _no_document_layout, ""),
    Rule("tsp", TSP, (), _without_converter("tsp"), ", or use the 'tsp' converter"),
    Rule("transforms", Transforms, ("mlp_tile_tokens",), _without_converter("tiled_mlp"),
         ", or add 'tiled_mlp' to model.converters"),
    Rule("transforms", Transforms, ("rmsnorm_tile_tokens",), _without_converter("tiled_rmsnorm"),
         ", or add 'tiled_rmsnorm' to model.converters"),
    Rule("transforms", Transforms, ("ce_chunk_tokens", "ce_backend"), _without_converter("fused_ce"),
         ", or add 'fused_ce' to model.converters"),
    Rule("activation_checkpoint", ActivationCheckpointOffload, ("pin_memory",), _not_offloaded,
         ", or set activation_checkpoint.cpu_offload = true"),
    Rule("activation_checkpoint", ActivationCheckpointOffload, ("keep_attention_blocks",), _keeps_no_attention,
         ", or set activation_checkpoint.keep_attention = \"auto\""),
    Rule("local_data", LocalData, ("paths",), _no_local_training_data, ""),
    Rule("local_data", LocalData, (), _no_local_data, ""),
)
"""Every plugin key that some layouts ignore (``resident_blocks`` and ``prefetch_after_attention``
without offload are errors: ``training.check_offload``). A rule with no keys covers the fields of
its class that no earlier rule names."""


def _toml(value: object) -> str:
    """A value as a TOML file writes it (``false``, ``"sdpa"``, ``["a"]``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return f"[{', '.join(_toml(item) for item in value)}]"
    return str(value)


def _changed(section: object, fields_class: type, keys: tuple[str, ...]) -> dict[str, object]:
    """``keys`` of ``section`` (all of ``fields_class``'s when empty) set away from their default."""
    values = plugin_fields(section, fields_class)
    changed = {}
    for f in fields(fields_class):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if (not keys or f.name in keys) and getattr(values, f.name) != default:
            changed[f.name] = getattr(values, f.name)
    return changed


def _rule_keys(rule: Rule) -> tuple[str, ...]:
    """A rule's keys; for a catch-all rule, its class's fields that no other rule of the section names."""
    if rule.keys:
        return rule.keys
    named = {key for other in RULES if other.section == rule.section for key in other.keys}
    return tuple(f.name for f in fields(rule.fields_class) if f.name not in named)


def _offloads_nothing(job_config) -> list[str]:
    """``cpu_offload`` with every block resident: nothing is offloaded (more than every block is
    an error: ``training.check_resident_blocks``)."""
    offload = plugin_fields(job_config.activation_checkpoint, ActivationCheckpointOffload)
    if not offload.cpu_offload or not isinstance(offload.resident_blocks, int) or not offload.resident_blocks:
        return []
    try:
        n_layers = flavor_args(job_config, update=False).n_layers
    except ConfigError:  # an unknown flavor: check_job says so
        return []
    if offload.resident_blocks != n_layers:
        return []
    return [f"activation_checkpoint.cpu_offload = true has no effect: resident_blocks = {n_layers} keeps the input "
            f"of every one of the {n_layers} blocks on the device (full activation checkpointing); set "
            "cpu_offload = false, or resident_blocks below the block count"]


def _keeps_nothing(job_config) -> list[str]:
    """``keep_attention`` with ``keep_attention_blocks = 0``: no block keeps."""
    offload = plugin_fields(job_config.activation_checkpoint, ActivationCheckpointOffload)
    blocks = str(offload.keep_attention_blocks).strip()
    if offload.keep_attention == "off" or blocks != "0":
        return []
    return [f"activation_checkpoint.keep_attention = {_toml(offload.keep_attention)} has no effect: "
            "keep_attention_blocks = 0 keeps no block's attention; set keep_attention_blocks to a number of blocks "
            "or \"auto\", or keep_attention = \"off\""]


def ignored_settings(job_config) -> list[str]:
    """One line per setting that has no effect in this job: the key, its value, why, the fix."""
    lines = _offloads_nothing(job_config) + _keeps_nothing(job_config)
    for rule in RULES:
        section = getattr(job_config, rule.section, None)
        if section is None:  # parsed without the plugin's sections
            continue
        changed = _changed(section, rule.fields_class, _rule_keys(rule))
        if not changed:
            continue
        try:
            why = rule.unused(job_config)
        except ConfigError:  # converters that name two CP modes: check_job says so
            continue
        if why:
            lines += [f"{rule.section}.{key} = {_toml(value)} has no effect: {why}; drop it{rule.fix}"
                      for key, value in changed.items()]
    return lines
