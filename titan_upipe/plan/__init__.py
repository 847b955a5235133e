"""Memory planner: predicted per-rank peak memory of a training step, the longest context that
fits, and the UPipe head chunk ``U`` to use.

``python -m titan_upipe.plan --job.config_file X.toml [--world-size N] [--section.key value ...]``
``python -m titan_upipe.plan --model llama3_8b --seq-len 5M --cp 8 --ulysses 8 --gpu-mem 80 --host-mem 1900``
(add ``--json`` for one JSON object, ``--plot out.png`` for peak vs sequence length).

The model is a walk through one training step of *this* implementation (TorchTitan 0.2.2 +
FSDP2 + the plugin's attention and transforms), rank by rank and moment by moment: at each
moment the bytes of every live tensor are a named term, and the peak is the largest total.
Terms come from reading the code and were checked against the tracked live bytes of real
steps on CPU (``titan_upipe.emulate``; ``tests/test_plan.py``, ``docs/planner.md``):

* state: fp32 sharded parameters, AdamW's two fp32 moments (steady state: a step after the
  first), fp32 sharded gradients of the groups already reduced;
* FSDP2: the unsharded block in the compute dtype, its all-gather buffer (forward: FSDP keeps
  it until the next all-gather; backward: the next block's prefetch), the previous group's
  fp32 reduce-scatter input (held until this group's reduce-scatter), the norm+output group
  kept unsharded from forward to backward (TorchTitan: no reshard after forward);
* activations: what each block keeps between forward and backward (no AC: autograd's saved
  tensors; full AC: its input; offloaded AC: nothing on the device), the transients of the
  block being run (attention per mode, MLP plain or tiled, RMSNorm plain or tiled), RoPE
  tables, the loss (stock, chunked torch or Liger fused linear cross-entropy);
* UPipe's attention terms are ``titan_upipe.costs.attention_memory`` (validated per stage
  against measurement in ``tests/test_attention_memory.py``: a stage's backward kernel and the
  final dX GEMM), plus the weight-gradient fp32 accumulators and, on GPU, the flash kernel's
  fp32 dQ accumulator.

Everything is bytes per rank. ``peak_gpu_bytes`` is comparable to
``torch.cuda.max_memory_allocated`` (what the paper's Table 4 reports). The runtime reserve
(CUDA context, NCCL buffers, allocator slack) is a separate, named line used only when
deciding whether a plan fits.

Modules (imports point down the list):

===============  ==========================================================================
``models``       ``KNOWN_MODELS``/``model_dims``: the paper's two models (checked against the
                 adapter's flavors by tests/test_job_spec.py)
``job``          ``PlanInput``: one job; its CP layout is ``spec.cp_layout.CPLayout``
``spec_input``   ``plan_input_from_spec``: a ``JobSpec`` (``titan_upipe.spec``) as a PlanInput
``terms``        ``Term``: one enum member per kind of live tensor, its value the label
``result``       ``Moment`` and ``MemoryPlan``
``documents``    packed documents: the document mask's index, build and segment terms
``sizes``        ``StepSizes``: the per-rank sizes terms are written in (``T``, ``u``, ...)
``state``        state, RoPE, FSDP buffers, RMSNorm outputs, saved MLP tensors
``attention``    local kernels, zigzag ring, Ulysses/ring/USP attention
``upipe``        UPipe's attention (``memory_model`` plus the code's own terms)
``tsp``          TSP's attention (D owners, K/V buckets) and ring MLP (weight shards in flight)
``block``        one block: kept activations, forward peak, backward moments
``loss``         final norm and cross-entropy (stock, chunked torch, Liger)
``step``         the walk through one step (``StepWalk``) and ``plan``
``search``       ``max_seq_len``, ``longest_fit`` (and the settings it needs), ``recommended_heads_per_stage``
``report``       ``summary``, ``render``, the plot and the paper's Table 4
``machine``      ``MachineMemory``: what a node offers its ranks (plain values; detecting them is the adapter's)
===============  ==========================================================================

The planner is arithmetic over a ``JobSpec`` (``titan_upipe.spec``): no module here imports torch or
TorchTitan (``tests/test_layers.py``), so it sits in the core, and the TorchTitan adapter calls it.
What reads a TorchTitan job lives with the adapter: ``torchtitan_0_2.job_plan`` (a parsed TOML through
its ``JobSpec``, the machine's memory, sizing ``keep_attention = "auto"``) and
``torchtitan_0_2.memory_guard`` (the launchers' memory guard). The command line is a tool:
``tools.plan_arguments`` (its arguments, read without torch, so ``--help`` answers at once) and
``tools.plan_cli`` (the run); ``python -m titan_upipe.plan`` (``__main__``) reads the first, then
imports the second.
"""

from __future__ import annotations

from titan_upipe.costs.attention_memory import paper_table2_peak, paper_table6_peak
from titan_upipe.plan.job import MODES, RUNTIME_RESERVE_GIB_CUDA, PlanInput, as_tsp
from titan_upipe.plan.models import KNOWN_MODELS, MODEL_FLAVORS, model_dims
from titan_upipe.plan.report import (
    PAPER_ROWS,
    PAPER_TABLES_CSV,
    PLOT_LENGTHS,
    make_plot,
    paper_table4,
    plot_variants,
    render,
    summary,
)
from titan_upipe.plan.result import MemoryPlan, Moment
from titan_upipe.plan.search import LEVERS, longest_fit, max_seq_len, recommended_heads_per_stage
from titan_upipe.plan.spec_input import PLAN_AUTO_BACKEND, plan_input_from_spec
from titan_upipe.plan.step import plan
from titan_upipe.plan.terms import Term
from titan_upipe.spec.model_dims import ModelDims
from titan_upipe.spec.units import GIB, K, format_length, parse_length

# Paper formulas re-exported for the docs/tests comparing the attention term with Tables 2/6.
__all__ = [
    "GIB", "K", "KNOWN_MODELS", "MODEL_FLAVORS", "MODES", "PAPER_ROWS", "PAPER_TABLES_CSV", "PLAN_AUTO_BACKEND",
    "PLOT_LENGTHS", "RUNTIME_RESERVE_GIB_CUDA", "MemoryPlan", "ModelDims", "Moment", "PlanInput", "Term",
    "LEVERS", "as_tsp", "format_length", "longest_fit", "make_plot", "max_seq_len", "model_dims",
    "paper_table2_peak", "paper_table4", "paper_table6_peak", "parse_length", "plan", "plan_input_from_spec",
    "plot_variants", "recommended_heads_per_stage", "render", "summary",
]
