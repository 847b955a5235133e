"""The walk through one steady-state training step, moment by moment, and ``plan``.

Moments: the embedding, the forward of the first and last block (the last has the most below
it), the loss forward and backward, the backward of the last, second-to-last, lowest resident,
second and first block (recomputation, MLP, ffn_norm, attention, the block's reduce-scatter),
the embedding backward and the AdamW step (with packed documents also the mask's build and its segments' at block 0).
Each moment is the state, FSDP's buffers, the activations kept by the blocks below (``below``)
and the terms of what runs; the peak is the largest total.
"""

from __future__ import annotations

from titan_upipe.plan.block import (
    attention_terms,
    block_backward_moments,
    block_forward_peak,
    block_retained,
    prefetches,
)
from titan_upipe.plan.documents import documents_note, mask_build_bytes, segments_build_bytes
from titan_upipe.plan.job import PlanInput
from titan_upipe.plan.kept import kept_bytes, kept_tensor_bytes
from titan_upipe.plan.loss import loss_terms
from titan_upipe.plan.result import MemoryPlan, Moment
from titan_upipe.plan.sizes import StepSizes
from titan_upipe.plan.state import (
    ATTENTION_NORM,
    fsdp_block_terms,
    grad_shards,
    host_adamw_terms,
    norm_out,
    optimizer_host_bytes,
    state_terms,
)
from titan_upipe.plan.terms import Counted, Term, Terms, labelled
from titan_upipe.spec.units import pow2_ceil


class StepWalk:
    """Builds the moments of one step for a job (``build``)."""

    def __init__(self, job: PlanInput) -> None:
        job.check()
        self.job = job
        self.sizes = StepSizes.of(job)
        self.attention = attention_terms(self.sizes)
        self.moments: list[Moment] = []
        self.notes: list[str] = []

    def add(self, phase: str, where: str, terms: Terms, *prefixed: tuple[str, Terms]) -> None:
        """A moment of ``terms`` then each ``(prefix, terms)`` (labels after ``prefix: ``)."""
        labels = labelled(terms)
        for prefix, part in prefixed:
            labels.update(labelled(part, prefix))
        self.moments.append(Moment(phase, where, labels))

    def below(self, blocks: int) -> Terms:
        """Activations on the device kept by ``blocks`` blocks whose backward has not run yet
        (their inputs included: the embedding output is block 0's input)."""
        job, u = self.job, self.sizes.hidden
        if job.offloaded:
            # the last ``resident_blocks`` blocks' inputs stay on the device (blocks >= n - N), and
            # the last ``keep_device_blocks`` blocks' kept attention
            n = self.sizes.model.n_layers
            resident = max(0, blocks - (n - job.resident_blocks))
            terms: Terms = {Counted(Term.BLOCKS_RESIDENT, resident): resident * u} if resident else {}
            keeping = max(0, blocks - (n - job.keep_device_blocks))
            if keeping:
                kept = kept_bytes(self.sizes)
                terms[Counted(Term.BLOCKS_KEPT_ATTENTION, keeping, kept)] = keeping * kept
            return terms
        if blocks == 0:
            return {}
        if job.ac_mode == "full":
            return {Counted(Term.BLOCKS_CHECKPOINTED, blocks): blocks * u}
        per_block = sum(block_retained(self.sizes, self.attention).values())
        return {Term.BLOCK0_INPUT: u, Counted(Term.BLOCKS_KEPT, blocks, per_block): blocks * per_block}

    def build(self) -> MemoryPlan:
        self.forward()
        self.loss()
        self.backward()
        self.optimizer()
        return self.host()

    def documents(self) -> None:
        """Packed documents: the mask built from the global batch (before the forward) and its
        segments (at block 0's first attention call, beside the block input and its norm)."""
        s, job = self.sizes, self.job
        if not job.documents:
            return
        self.add("forward", "document mask built (from_eos)",
                 {**state_terms(s, 0), Term.DOC_BUILD: mask_build_bytes(job)})
        inputs = {Term.BLOCK0_INPUT: s.hidden} if job.ac_mode == "none" else {Term.BLOCK_INPUT: s.hidden}
        terms = {**state_terms(s, 0), **fsdp_block_terms(s, "forward", 0), **inputs}
        self.add("forward", "block 0 forward: document segments built", terms,
                 ("block 0 fwd", {**norm_out(s, ATTENTION_NORM), Term.DOC_SEGMENTS_BUILD: segments_build_bytes(job)}))
        self.notes.append(documents_note(job))

    def forward(self) -> None:
        """The embedding, then the first and last block's forward peak."""
        s, job, m, u = self.sizes, self.job, self.sizes.model, self.sizes.hidden
        self.documents()
        terms = state_terms(s, 0)
        if s.fsdp > 1:
            terms[Term.FSDP_EMBEDDING_GATHER] = 2 * m.embedding_params * s.weight_bytes
        terms[Term.EMBEDDING_OUT] = u
        self.add("forward", "embedding", terms)
        where, inner = block_forward_peak(s, self.attention, grad=job.ac_mode != "full")
        where_keeping, inner_keeping = block_forward_peak(s, self.attention, grad=False, kept=kept_bytes(s))
        if job.ac_mode == "full" and not job.offloaded and not job.tsp:
            # TorchTitan's (non-reentrant) checkpoint runs the first forward with autograd on and
            # drops what would be saved: the grad-mode temporaries (RoPE) appear, saves do not
            grad_mode = {**norm_out(s, ATTENTION_NORM), **self.attention.forward}
            if sum(grad_mode.values()) > sum(inner.values()):
                where, inner = "attention (autograd, saves dropped)", grad_mode
        for i in sorted({0, m.n_layers - 1}):
            terms = {**state_terms(s, 0), **fsdp_block_terms(s, "forward", i)}
            if job.ac_mode == "none":
                terms.update(self.below(i) or {Term.BLOCK0_INPUT: u})
            else:
                terms.update(self.below(i))
                terms[Term.BLOCK_INPUT] = u
            keeps = job.keep.placement(i, m.n_layers) is not None
            at, block_terms = (where_keeping, inner_keeping) if keeps else (where, inner)
            self.add("forward", f"block {i} forward: {at}", terms, (f"block {i} fwd", block_terms))

    def output_group(self) -> Terms:
        """TorchTitan keeps the norm + output FSDP group unsharded from forward to backward."""
        s = self.sizes
        return {Term.FSDP_OUTPUT_GROUP: s.model.output_params * s.weight_bytes} if s.fsdp > 1 else {}

    def loss(self) -> None:
        """The loss forward (outside the model's forward) and backward through the output projection."""
        s, m = self.sizes, self.sizes.model
        loss = loss_terms(s)
        base = {**state_terms(s, 0), **self.output_group(), **self.below(m.n_layers)}
        self.add("loss", "loss forward", {**base, **loss.forward})
        terms = {**base, **loss.backward}
        if s.fsdp > 1:
            terms[Term.FSDP_GATHER_NEXT] = s.fsdp_block_params * s.weight_bytes
        self.add("loss", "loss backward", terms)

    def backward(self) -> None:
        """Blocks from the top (i = n-1) to the bottom (i = 0), then the embedding."""
        s, job, m, u = self.sizes, self.job, self.sizes.model, self.sizes.hidden
        n = m.n_layers
        out_grads = grad_shards(s, m.output_params)
        # the last blocks (most resident inputs), the lowest block that prefetches (most gradients
        # with a prefetched input, block 1 without resident blocks) and block 0 (most gradients)
        lowest_resident = min(max(n - job.resident_blocks, 0), n - 1)
        # with kept attention also the lowest block keeping it on the device (the most kept bytes
        # above the blocks' gradients) and the blocks fetching the highest and the lowest host-kept
        keeping = {min(max(n - job.keep_device_blocks, 0), n - 1), min(max(n - job.keep_device_blocks, 1), n - 1),
                   min(max(n - job.keep.blocks + 1, 1), n - 1)} if job.keep.blocks else set()
        for i in sorted({n - 1, max(n - 2, 0), lowest_resident, min(1, n - 1), 0, *keeping}, reverse=True):
            prefetch = prefetches(job, i, n)
            kept_below = kept_bytes(s) if i >= 1 and job.keep.placement(i - 1, n) == "host" else 0
            inside = block_backward_moments(s, self.attention, prefetch, kept_below)
            grads = out_grads + (n - 1 - i) * grad_shards(s, m.block_params)
            below = self.below(i)
            if job.ac_mode == "none" and i == 0:
                below = {Term.BLOCK0_INPUT: u}
            for moment in inside:
                terms = {**state_terms(s, grads), **fsdp_block_terms(s, "backward", i), **below}
                self.add("backward", f"block {i} backward: {moment.where}", terms,
                         (f"block {i}", moment.activations), ("", moment.unsharded_grads))
            if s.fsdp > 1:
                self.reduce_scatter(i, grads, prefetch, kept_below)
        grads = out_grads + n * grad_shards(s, m.block_params)
        terms = state_terms(s, grads)
        terms[Term.GRAD_EMBEDDING_OUT] = u
        terms[Term.EMBEDDING_GRAD] = m.embedding_params * s.weight_bytes
        if s.fsdp > 1:
            terms[Term.FSDP_EMBEDDING] = m.embedding_params * s.weight_bytes
            terms[Term.FSDP_REDUCE_HELD] = s.fsdp_block_params * s.reduce_bytes
        self.add("backward", "embedding backward", terms)

    def reduce_scatter(self, i: int, grads: int, prefetch: bool, prefetched_kept: int = 0) -> None:
        """Block ``i``'s post-backward: its gradients reduce-scattered while the next block is fetched
        (its parameters, with ``prefetch`` its offloaded input, and its host-kept attention)."""
        s, m = self.sizes, self.sizes.model
        terms = {**state_terms(s, grads), **(self.below(i) if i > 0 else {})}
        if prefetch:
            terms[Term.PREFETCHED_INPUT] = s.hidden
        if prefetched_kept:
            terms[Term.PREFETCHED_KEPT_ATTENTION] = prefetched_kept
        params = s.fsdp_block_params
        prev = params if i > 0 else m.embedding_params
        terms[Term.FSDP_GATHER_NEXT] = prev * s.weight_bytes
        terms[Term.FSDP_BLOCK_GRADS] = params * s.weight_bytes
        terms[Term.FSDP_REDUCE] = params * s.reduce_bytes + grad_shards(s, params)
        terms[Term.GRAD_BLOCK_INPUT] = s.hidden
        self.add("backward", f"block {i} backward: reduce-scatter", terms)

    def optimizer(self) -> None:
        """Gradient clipping (in place) + foreach AdamW (one temporary: sqrt of exp_avg_sq), over
        all parameters, or one parameter at a time through the work buffers with the moments on the host."""
        s = self.sizes
        all_grads = grad_shards(s, s.model.total_params)
        terms = state_terms(s, all_grads)
        if self.job.optimizer_state_on_host:
            terms.update(host_adamw_terms(s))
            self.add("optimizer", "AdamW step (moments streamed from host)", terms)
            return
        terms[Term.ADAMW_TEMP] = grad_shards(s, s.model.total_params)
        self.add("optimizer", "AdamW step", terms)

    def host(self) -> MemoryPlan:
        """The plan, with the offloaded block inputs and host-kept attention in host memory
        (PyTorch's pinned allocator rounds each tensor up to a power of 2)."""
        job, u = self.job, self.sizes.hidden
        n = max(self.sizes.model.n_layers - job.resident_blocks, 0)  # inputs on the host
        pageable = n * u if job.offloaded else 0
        pinned = n * pow2_ceil(u) if job.offloaded else 0
        if job.keep_host_blocks:
            tensors = kept_tensor_bytes(self.sizes)
            pageable += job.keep_host_blocks * sum(tensors)
            pinned += job.keep_host_blocks * sum(pow2_ceil(t) for t in tensors)
        use_pinned = job.offloaded and job.pin_memory is not False
        moments = optimizer_host_bytes(self.sizes, pinned=self.sizes.cuda)
        return MemoryPlan(job, self.moments, (pinned if use_pinned else pageable) + moments, use_pinned,
                          pageable + moments, pinned + moments, self.notes, host_optimizer_bytes_per_rank=moments)


def plan(job: PlanInput, host_mem_bytes: float | None = None) -> MemoryPlan:
    """The memory plan of ``job``. With ``pin_memory=None`` the offload buffers are pinned when
    they fit ``host_mem_bytes`` (per node), else pageable."""
    result = StepWalk(job).build()
    if job.pin_memory is None and job.offloaded:
        nodes_ranks = min(job.ranks, job.gpus_per_node)
        pinned_fits = host_mem_bytes is None or result.host_bytes_pinned_per_rank * nodes_ranks <= host_mem_bytes
        result.host_pinned = pinned_fits
        result.host_bytes_per_rank = (result.host_bytes_pinned_per_rank if pinned_fits
                                      else result.host_bytes_pageable_per_rank)
        if not pinned_fits:
            result.notes.append("pinned offload buffers (rounded to powers of two by PyTorch's pinned allocator) "
                                "do not fit host memory: pageable buffers assumed (activation_checkpoint.pin_memory = false)")
    return result
