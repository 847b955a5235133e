"""The job as pure values (core layer, bottom): no torch, no TorchTitan, nothing but arithmetic.

``JobSpec`` is the job decided once (by the TorchTitan adapter, from its config) and passed down;
the other modules are the arithmetic it is made of, which the planner and the runtime share.

=================  ===========================================================================
module             holds
=================  ===========================================================================
job_spec           ``JobSpec``: the model's shape, the CP layout, kernel, documents, transforms,
                   memory, keep-attention and TSP settings of one job
model_dims         ``ModelDims``: the dimensions of a model that decide memory and time
cp_layout          ``CPMode``, ``CPLayout``: mode, CP / ring / Ulysses degrees, U, sequence divisor
head_schedule      UPipe's GQA-aware head schedule (stages of U query heads)
keep_attention     ``KeepAttentionPlan``: which blocks keep their attention output, and where
tsp_shards         TSP's degree rules and weight-shard arithmetic (``TSPShardSizes``)
document_deal      the document-aware ring layout's deal of documents to ranks (and the zigzag's)
settings           the valid names of the settings the planner reads (kernels, balances, dtypes)
units              lengths as configs and command lines write them (``128K``, ``5M``), bytes
=================  ===========================================================================

Nothing here imports torch: ``tests/test_layers.py`` checks it, so the planner that reads these
answers without loading torch (``python -m titan_upipe.plan --help``).
"""
