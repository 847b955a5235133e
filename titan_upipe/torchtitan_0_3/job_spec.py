"""The one place a TorchTitan 0.3 recipe (``recipe.Recipe``: its ``Trainer.Config`` and the plugin's
sections) becomes the plugin's ``JobSpec``, the same spec the 0.2 adapter builds from a ``JobConfig``.

The model's shape comes from the ``ModelSpec`` the recipe's flavor gave (``flavors``), the CP layout
is built here once (the 0.2 adapter's job checks build its own), and the settings come from the
recipe's stock fields and the plugin's sections, read with the same pure functions as on 0.2
(``spec.cp_layout.cp_mode``, ``spec.keep_attention.keep_setting_of`` and ``stated_plan``).
Packed documents: 0.3's flavors carry no ``attn_mask_type`` and the plugin's 0.3 data loaders do not
exist yet, so a 0.3 spec is causal (``documents = False``; issue 44).
"""

from __future__ import annotations

from titan_upipe.spec.cp_layout import CPLayout, cp_mode
from titan_upipe.spec.job_spec import JobSpec, degrees_world_size
from titan_upipe.spec.keep_attention import keep_setting_of, stated_plan
from titan_upipe.torchtitan_0_3.flavors import model_dims_from_config
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
    upipe, transforms, tsp, offload = plugin["upipe"], plugin["transforms"], plugin["tsp"], plugin["activation_checkpoint"]
    model = model_dims_from_config(f"{recipe.model_name}:{recipe.flavor}", trainer.model_spec.model)
    where, blocks = keep_setting_of(offload.keep_attention, offload.keep_attention_blocks, model.n_layers,
                                    recipe.flavor)
    converters = recipe.converters
    checkpoint = trainer.checkpoint
    return JobSpec(
        model=model, seq_len=trainer.training.seq_len, local_batch=trainer.training.local_batch_size,
        world_size=degrees_world_size(trainer.parallelism) if world_size is None else world_size,
        layout=recipe_layout(recipe), documents=False, attention_backend=upipe.attention_backend,
        document_balance=upipe.document_balance, document_min_split=upipe.document_min_split,
        param_dtype=trainer.training.mixed_precision_param, reduce_dtype=trainer.training.mixed_precision_reduce,
        tiled_mlp="tiled_mlp" in converters, tiled_rmsnorm="tiled_rmsnorm" in converters,
        fused_rope="fused_rope" in converters, fused_ce="fused_ce" in converters,
        mlp_tile_tokens=transforms.mlp_tile_tokens, rmsnorm_tile_tokens=transforms.rmsnorm_tile_tokens,
        ce_chunk_tokens=transforms.ce_chunk_tokens, ce_backend=transforms.ce_backend,
        ac_mode=recipe.ac_mode, selective_ac_option=recipe.selective_ac_option if recipe.ac_mode == "selective" else "",
        cpu_offload=bool(offload.cpu_offload), pin_memory=bool(offload.pin_memory),
        prefetch_after_attention=bool(offload.prefetch_after_attention), resident_blocks=int(offload.resident_blocks),
        optimizer_state_on_host=bool(plugin["optimizer"].state_on_host),
        keep_attention=where, keep_attention_blocks=blocks, keep_plan=stated_plan(where, blocks),
        async_checkpoint=bool(checkpoint.enable and checkpoint.async_mode != "disabled"),
        tsp_kv_heads_per_bucket=tsp.kv_heads_per_bucket, tsp_overlap=tsp.overlap, tsp_mlp_recompute=tsp.mlp_recompute,
    )
