"""The plugin's train specs: TorchTitan's Llama3 and Qwen3 with our infrastructure.

``upipe_llama3`` and ``upipe_qwen3`` keep TorchTitan's model classes and
flavors (so checkpoints and HF conversion are unchanged) and swap in our
``parallelize_fn``, data/tokenizer builders and loss (TorchTitan's summed cross-entropy,
or the fused head's under the ``fused_ce`` converter) and metrics (causal attention FLOPs,
grouped TensorBoard tags: ``titan_upipe.metrics``). Each spec owns a copy of the flavor dict, because
``update_from_config`` mutates the flavor args in place.

Debug flavors (vocabulary = the embedded tokenizer's 512 ids):

=============  ======  =====  =========  ========  =======  =========
flavor         layers  dim    q/kv heads  head dim  qk-norm  tied emb.
=============  ======  =====  =========  ========  =======  =========
llama3 debug   2       128    8 / 2      16        no       no
qwen3 debug    2       128    8 / 2      16        yes      no (FSDP
                                                            rejects tied
                                                            on torch 2.13)
=============  ======  =====  =========  ========  =======  =========
"""

from __future__ import annotations

import copy
import dataclasses

from torchtitan.models.llama3 import TransformerModelArgs
from torchtitan.models.qwen3 import Qwen3ModelArgs
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

from titan_upipe.data import synthetic
from titan_upipe.data.tokenizer import VOCAB_SIZE
from titan_upipe.metrics import build_metrics_processor
from titan_upipe.parallelize import parallelize
from titan_upipe.transforms.loss import build_loss_fn

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
}

QWEN3_DEBUG_FLAVORS = {
    "debug": Qwen3ModelArgs(
        dim=128, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=16, hidden_dim=384,
        vocab_size=VOCAB_SIZE, qk_norm=True, rope_theta=1000000, max_seq_len=8192,
        enable_weight_tying=False,
    ),
}


def _derived_spec(base_name: str, debug_flavors: dict) -> TrainSpec:
    base = get_train_spec(base_name)
    flavors = {name: copy.deepcopy(args) for name, args in base.model_args.items()}
    flavors.update(copy.deepcopy(debug_flavors))
    return dataclasses.replace(
        base,
        model_args=flavors,
        parallelize_fn=parallelize,
        pipelining_fn=None,
        build_dataloader_fn=synthetic.build_dataloader,
        build_tokenizer_fn=synthetic.build_tokenizer,
        build_loss_fn=build_loss_fn,
        build_metrics_processor_fn=build_metrics_processor,
    )


def _is_registered(name: str) -> bool:
    try:
        get_train_spec(name)
    except ValueError:
        return False
    return True


def register() -> None:
    for name, base, flavors in ((LLAMA3_SPEC, "llama3", LLAMA3_DEBUG_FLAVORS),
                                (QWEN3_SPEC, "qwen3", QWEN3_DEBUG_FLAVORS)):
        if not _is_registered(name):
            register_train_spec(name, _derived_spec(base, flavors))


def flavor_args(job_config, *, update: bool = True):
    """A copy of the configured flavor's model args, updated from the job config as the trainer
    does (``update_from_config``) unless ``update`` is False. A copy, because a train spec's
    flavor dict is shared module state that ``update_from_config`` would mutate."""
    from titan_upipe.config import ConfigError

    flavors = get_train_spec(job_config.model.name).model_args
    if job_config.model.flavor not in flavors:
        raise ConfigError(
            f"model.flavor = {job_config.model.flavor!r} is not a flavor of {job_config.model.name}: "
            f"valid values are {', '.join(flavors)}"
        )
    args = copy.deepcopy(flavors[job_config.model.flavor])
    if update:
        args.update_from_config(job_config)
    return args
