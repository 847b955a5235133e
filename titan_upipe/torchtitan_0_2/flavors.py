"""The plugin's model flavors: TorchTitan's Llama3 and Qwen3 ones plus small debug flavors.

Debug flavors (vocabulary = the embedded tokenizer's 512 ids):

=============  ======  =====  =========  ========  =======  =========
flavor         layers  dim    q/kv heads  head dim  qk-norm  tied emb.
=============  ======  =====  =========  ========  =======  =========
llama3 debug   2       128    8 / 2      16        no       no
qwen3 debug    2       128    8 / 2      16        yes      no (FSDP
                                                            rejects tied
                                                            on torch 2.13)
=============  ======  =====  =========  ========  =======  =========

``debug_mha`` (llama3) has 8 / 8 heads, ``debug_kv4`` (llama3) 8 / 4 (GQA that 4 TSP ranks can
split: TSP needs the degree to divide the KV heads). ``debug_flex`` (llama3 and qwen3) is ``debug`` with
TorchTitan's packed-document settings, as its ``debugmodel_flex_attn`` / ``8B_flex`` flavors
set them: ``attn_type = "flex"``, ``attn_mask_type = "block_causal"`` (documents end at each
EOS token). Under a CP converter the attention is the plugin's, which reads the documents from
``attn_mask_type`` whatever the ``attn_type`` (``titan_upipe.torchtitan_0_2.cp_inputs.document_eos_id``).
"""

from __future__ import annotations

import copy

from torchtitan.models.llama3 import Transformer, TransformerModelArgs
from torchtitan.models.qwen3 import Qwen3ModelArgs
from torchtitan.protocols.train_spec import get_train_spec

from titan_upipe.data.tokenizer import VOCAB_SIZE
from titan_upipe.errors import ConfigError, with_suggestion
from titan_upipe.spec.model_dims import ModelDims

LLAMA3_SPEC = "upipe_llama3"
QWEN3_SPEC = "upipe_qwen3"

LLAMA3_DEBUG_FLAVORS = {
    "debug": TransformerModelArgs(
        dim=128, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=VOCAB_SIZE,
        multiple_of=64, rope_theta=500000, max_seq_len=8192,
    ),
    "debug_mha": TransformerModelArgs(
        dim=128, n_layers=2, n_heads=8, n_kv_heads=8, vocab_size=VOCAB_SIZE,
        multiple_of=64, rope_theta=500000, max_seq_len=8192,
    ),
    "debug_kv4": TransformerModelArgs(
        dim=128, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=VOCAB_SIZE,
        multiple_of=64, rope_theta=500000, max_seq_len=8192,
    ),
    "debug_flex": TransformerModelArgs(
        dim=128, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=VOCAB_SIZE,
        multiple_of=64, rope_theta=500000, max_seq_len=8192, attn_type="flex", attn_mask_type="block_causal",
    ),
}

QWEN3_DEBUG_FLAVORS = {
    "debug": Qwen3ModelArgs(
        dim=128, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=16, hidden_dim=384,
        vocab_size=VOCAB_SIZE, qk_norm=True, rope_theta=1000000, max_seq_len=8192,
        enable_weight_tying=False,
    ),
    "debug_flex": Qwen3ModelArgs(
        dim=128, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=16, hidden_dim=384,
        vocab_size=VOCAB_SIZE, qk_norm=True, rope_theta=1000000, max_seq_len=8192,
        enable_weight_tying=False, attn_type="flex", attn_mask_type="block_causal",
    ),
}

BASE_MODELS = {LLAMA3_SPEC: ("llama3", LLAMA3_DEBUG_FLAVORS), QWEN3_SPEC: ("qwen3", QWEN3_DEBUG_FLAVORS)}
"""Each plugin train spec: the TorchTitan model it derives from and the flavors it adds."""


def model_flavors(model_name: str) -> dict:
    """The flavors of ``model.name``: for the plugin's specs TorchTitan's base flavors plus the
    debug ones (read without registering anything), else the registered spec's own. Shared
    dicts: copy before changing one (``flavor_args``)."""
    if model_name in BASE_MODELS:
        base, debug = BASE_MODELS[model_name]
        return {**get_train_spec(base).model_args, **debug}
    try:
        return get_train_spec(model_name).model_args
    except ValueError:  # TorchTitan's "TrainSpec X is not registered."
        from torchtitan.models import _supported_models

        raise ConfigError(with_suggestion(
            f"model.name = {model_name!r} is not a registered train spec: valid values are "
            f"{', '.join(BASE_MODELS)} (or TorchTitan's {', '.join(sorted(_supported_models))})",
            model_name, [*BASE_MODELS, *_supported_models])) from None


def flavor_args(job_config, *, update: bool = True):
    """A copy of the configured flavor's model args, updated from the job config as the trainer
    does (``update_from_config``) unless ``update`` is False. A copy, because a train spec's
    flavor dict is shared module state that ``update_from_config`` would mutate."""
    flavors = model_flavors(job_config.model.name)
    if job_config.model.flavor not in flavors:
        raise ConfigError(
            f"model.flavor = {job_config.model.flavor!r} is not a flavor of {job_config.model.name}: "
            f"valid values are {', '.join(flavors)}"
        )
    args = copy.deepcopy(flavors[job_config.model.flavor])
    if update:
        args.update_from_config(job_config)
    return args


def head_dim(args) -> int:
    """A flavor's attention head dimension (Qwen3 sets it; Llama3's is dim / heads)."""
    return getattr(args, "head_dim", None) or args.dim // args.n_heads


def packs_documents(args) -> bool:
    """The flavor attends within packed documents (``attn_mask_type = "block_causal"``)."""
    return getattr(args, "attn_mask_type", "causal") == "block_causal"


def ffn_hidden_dim(args) -> int:
    """The feed-forward width ``F`` of a Llama3 ``TransformerModelArgs`` (``2/3 * 4d``, scaled by
    ``ffn_dim_multiplier``, rounded up to ``multiple_of``, as TorchTitan's ``FeedForward`` sizes it)
    or a Qwen3 ``Qwen3ModelArgs`` (its ``hidden_dim``)."""
    if hasattr(args, "hidden_dim"):
        return args.hidden_dim
    hidden = int(2 * (4 * args.dim) / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


def model_dims_from_args(name: str, args) -> ModelDims:
    """ModelDims of a TorchTitan Llama3 ``TransformerModelArgs`` or Qwen3 ``Qwen3ModelArgs``."""
    n_kv = args.n_kv_heads or args.n_heads
    if hasattr(args, "hidden_dim"):  # Qwen3
        return ModelDims(name, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=n_kv,
                         head_dim=args.head_dim, ffn_dim=args.hidden_dim, vocab=args.vocab_size,
                         tied=bool(getattr(args, "enable_weight_tying", False)), qk_norm=bool(args.qk_norm),
                         rope="qwen3")
    return ModelDims(name, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=n_kv,
                     head_dim=args.dim // args.n_heads,
                     ffn_dim=ffn_hidden_dim(args),
                     vocab=args.vocab_size, rope="llama3")


def flavor_model_dims(name: str) -> ModelDims:
    """``ModelDims`` of ``<model.name>:<flavor>`` (a train spec's flavor), for the planner's ``--model``."""
    if ":" not in name:
        raise ValueError(f"unknown model {name!r}: use llama3_8b, qwen3_32b or <model.name>:<flavor>")
    model_name, flavor = name.split(":", 1)
    flavors = model_flavors(model_name)
    if flavor not in flavors:
        raise ValueError(f"{flavor!r} is not a flavor of {model_name}: valid values are {', '.join(flavors)}")
    return model_dims_from_args(name, flavors[flavor])


def llama3_model(**args) -> Transformer:
    """TorchTitan's Llama3 ``Transformer`` of ``TransformerModelArgs(**args)`` on the current default
    device, unconverted (the GPU suite's kernel checks build their own small models through it)."""
    return Transformer(TransformerModelArgs(**args))
