"""The model keys of a TorchTitan checkpoint by version: what carries over between 0.2.2 and 0.3.

Both save DCP checkpoints whose model entries are the flattened parameter FQNs. Two names moved:

===================================== =============================================
TorchTitan 0.2.2                      TorchTitan 0.3
===================================== =============================================
``layers.N.attention.wq.weight``      ``layers.N.attention.qkv_linear.wq.weight``
(also ``wk``, ``wv``)                 (0.3 saves a fused ``wqkv`` split so)
``output.weight``                     ``lm_head.weight``
===================================== =============================================

Every other model key (norms, ``wo``, ``q_norm``/``k_norm``, the feed-forward, the embedding) is
the same. The other states (optimizer, LR schedule, data cursor, step) differ in format between
the versions and do not carry over.
"""

from __future__ import annotations

import re

VERSIONS = ("0.2", "0.3")
NON_MODEL_PREFIXES = ("optimizer.", "lr_scheduler", "dataloader", "train_state")
"""The top-level entries of a checkpoint that are not the model's parameters."""

_RENAMES = (
    (re.compile(r"(^|\.)attention\.(w[qkv])\."), r"\1attention.qkv_linear.\2."),
    (re.compile(r"^output\."), "lm_head."),
)
_BACK = (
    (re.compile(r"(^|\.)attention\.qkv_linear\.(w[qkv])\."), r"\1attention.\2."),
    (re.compile(r"^lm_head\."), "output."),
)


def is_model_key(key: str) -> bool:
    return not key.startswith(NON_MODEL_PREFIXES)


def model_key_for(key: str, version: str) -> str:
    """``key`` (a model key of the other version) as TorchTitan ``version`` names it."""
    if version not in VERSIONS:
        raise ValueError(f"unknown TorchTitan version {version!r}: valid versions are {', '.join(VERSIONS)}")
    for pattern, replacement in _RENAMES if version == "0.3" else _BACK:
        key = pattern.sub(replacement, key)
    return key


def written_by(keys) -> str | None:
    """The TorchTitan version whose names a checkpoint's model ``keys`` use (None: no key tells)."""
    model = [key for key in keys if is_model_key(key)]
    if any(model_key_for(key, "0.3") != key for key in model):
        return "0.2"
    if any(model_key_for(key, "0.2") != key for key in model):
        return "0.3"
    return None
