"""The one place a TorchTitan 0.3 recipe (``recipe.Recipe``: its ``Trainer.Config`` and the plugin's
sections) becomes the plugin's ``JobSpec``, the same spec the 0.2 adapter builds from a ``JobConfig``.

The model's shape comes from the ``ModelSpec`` the recipe's flavor gave (``flavors``), the CP layout
is built here once (the 0.2 adapter's job checks build its own), and the settings come from the
recipe's stock fields and the plugin's sections, read with the same pure functions as on 0.2
(``spec.cp_layout.cp_mode``, ``spec.keep_attention.keep_setting_of`` and ``stated_plan``).
Packed documents: the plugin's ``debug_flex`` flavors (``flavors.DOCUMENT_FLAVORS``); TorchTitan's flavors
carry no ``attn_mask_type`` and run causal rows, as on 0.2.
"""

from __future__ import annotations

from titan_upipe.spec.cp_layout import CPLayout, cp_mode
from titan_upipe.spec.job_spec import JobSpec, degrees_world_size, section_fields, writes_async_checkpoints
from titan_upipe.spec.keep_attention import keep_setting_of, stated_plan
from titan_upipe.torchtitan_0_3.flavors import model_dims_from_config, packs_documents
from titan_upipe.torchtitan_0_3.recipe import Recipe


def recipe_layout(recipe: Recipe) -> CPLayout:
    """The recipe's context-parallel layout, validated (``LayoutError`` names the valid values)."""
    trainer, upipe = recipe.trainer, recipe.plugin["upipe"]
    mode = cp_mode(list(recipe.converters))
    attention = trainer.model_spec.model.layers[0].attention
    n_heads, n_kv_heads = (attention.n_heads, attention.n_kv_heads or attention.n_heads) if mode else (0, 0)
    return CPLayout(mode, trainer.parallelism.context_parallel_degree, upipe.ulysses_degree, n_heads, n_kv_heads,
                    upipe.heads_per_stage, trainer.training.seq_len)


def job_spec(recipe: Recipe, world_size: int | None = None) -> JobSpec:
    """The ``JobSpec`` of a 0.3 recipe on ``world_size`` ranks (default: the configured degrees' product)."""
    trainer, plugin = recipe.trainer, recipe.plugin
    offload, checkpoint = plugin["activation_checkpoint"], trainer.checkpoint
    model = model_dims_from_config(f"{recipe.model_name}:{recipe.flavor}", trainer.model_spec.model)
    where, blocks = keep_setting_of(offload.keep_attention, offload.keep_attention_blocks, model.n_layers,
                                    recipe.flavor)
    return JobSpec(
        model=model, seq_len=trainer.training.seq_len, local_batch=trainer.training.local_batch_size,
        world_size=degrees_world_size(trainer.parallelism) if world_size is None else world_size,
        layout=recipe_layout(recipe), documents=packs_documents(recipe.flavor), rope_tables=model.n_layers,
        param_dtype=trainer.training.mixed_precision_param, reduce_dtype=trainer.training.mixed_precision_reduce,
        keep_attention=where, keep_attention_blocks=blocks, keep_plan=stated_plan(where, blocks),
        async_checkpoint=writes_async_checkpoints(checkpoint.enable, checkpoint.async_mode),
        **section_fields(recipe.converters, plugin["upipe"], plugin["transforms"], plugin["tsp"], offload,
                         plugin["optimizer"].state_on_host, recipe.ac_mode, recipe.selective_ac_option),
    )
