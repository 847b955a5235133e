"""Kept attention (``[activation_checkpoint] keep_attention``, ``titan_upipe.attention.keep``).

A block that keeps records its attention's kernel results in its forward and replays them in the
recomputation its backward runs. The claims:

* bit for bit: losses and every gradient with kept attention (on the device, on the host, or a
  mix) equal those of full recomputation, in every mode: Ulysses, UPipe (U = C and U = H), ring,
  USP, UPipe in USP, packed documents (UPipe, ring, USP) and TSP, on real gloo ranks in fp32; and
  they equal one device (the unconverted model, or for packed documents the one-rank converted
  model) within fp32 rounding;
* the kernel's forward runs once per block that keeps, not twice;
* the test can fail: a record replayed out of order changes the gradients.

The emulator's kept bytes against the planner's term: ``test_emulate.py``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from dist_utils import run_distributed

from titan_upipe.attention.keep import KeptAttention
from titan_upipe.spec.keep_attention import KeepAttentionPlan, kept_attention_bytes

SEQ = 64
BATCH = 2
N_LAYERS = 3
VOCAB = 200
EOS = VOCAB - 1
FP32_RTOL = 2e-5
PLANS = {"device": KeepAttentionPlan(device_blocks=N_LAYERS), "host": KeepAttentionPlan(host_blocks=N_LAYERS),
         "mixed": KeepAttentionPlan(device_blocks=1, host_blocks=1)}
"""Every block on the device, every block on the host, and the top block on the device, the next on
the host, the lowest recomputing."""


def model(family: str = "llama3", **overrides):
    """8 query / 4 KV heads of dim 8: every mode runs on 4 ranks (TSP needs KV heads % 4 == 0)."""
    if family == "qwen3":
        from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
        from torchtitan.models.qwen3.model.model import Qwen3Model

        args = Qwen3ModelArgs(dim=64, n_layers=N_LAYERS, n_heads=8, n_kv_heads=4, head_dim=8, hidden_dim=96,
                              vocab_size=VOCAB, qk_norm=True, rope_theta=1000000, max_seq_len=SEQ,
                              enable_weight_tying=False, **overrides)
        built = Qwen3Model(args)
    else:
        from torchtitan.models.llama3.model.args import TransformerModelArgs
        from torchtitan.models.llama3.model.model import Transformer

        args = TransformerModelArgs(dim=64, n_layers=N_LAYERS, n_heads=8, n_kv_heads=4, vocab_size=VOCAB,
                                    multiple_of=32, rope_theta=500000, max_seq_len=SEQ, **overrides)
        built = Transformer(args)
    with torch.no_grad():
        built.init_weights()
    return built


class CountingKernel:
    """A local kernel that counts its forward calls (delegating to the wrapped one)."""

    def __init__(self, inner) -> None:
        self.inner, self.forwards = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, *args, **kwargs):
        self.forwards += 1
        return self.inner.forward(*args, **kwargs)


class LseKeptInBf16(KeptAttention):
    """Sabotage, a tempting memory saving: the LSE (a record's tensors after the output) kept in
    bf16 precision."""

    def record(self, out, *lses):
        super().record(out, *(lse.to(torch.bfloat16).float() for lse in lses))


class CountedKept(KeptAttention):
    """Counts its replays."""

    replayed = 0

    def replay(self):
        self.replayed += 1
        return super().replay()


def count_records(schedule) -> list[CountedKept]:
    """The kept records ``schedule`` makes from now on (one per block call that keeps)."""
    made: list[CountedKept] = []
    make = schedule.kept_attention

    def counted(where):
        kept = make(where)
        if kept is not None:
            kept = CountedKept(kept._hold)
            made.append(kept)
        return kept

    schedule.kept_attention = counted
    return made


def _loss_and_grads(built, tokens, labels, n_valid, **kwargs):
    from torchtitan.components.loss import cross_entropy_loss

    loss = cross_entropy_loss(built(tokens, **kwargs), labels) / n_valid  # (a sum over the tokens)
    loss.backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in built.named_parameters()}


# ---- in-process: one rank, the kept path's own properties ------------------------------------


def _one_rank(mode: str, plan: KeepAttentionPlan, kept_class=KeptAttention, family: str = "llama3",
              dtype: torch.dtype = torch.float32, fused_rope: bool = False, resident_blocks: int = 0):
    from fake_meshes import OneRankMesh

    from titan_upipe.attention import convert_attention
    from titan_upipe.transforms import offload
    from titan_upipe.transforms.model_forward import enable_fused_rope

    torch.manual_seed(3)
    built = model(family)
    for param in built.parameters():  # the parameters only, as FSDP's mixed precision (the RoPE table stays)
        param.data = param.data.to(dtype)
    kernel = None
    for block in built.layers.values():
        block.attention = convert_attention(block.attention, mode, OneRankMesh())
        kernel = kernel or CountingKernel(block.attention.backend)
        block.attention.backend = kernel
    if fused_rope:
        enable_fused_rope(built)
    schedule = offload.apply_offloaded_ac(built, pin_memory=False, keep=plan, resident_blocks=resident_blocks)
    if kept_class is not KeptAttention:
        make = schedule.kept_attention
        schedule.kept_attention = lambda where: None if where is None else kept_class(make(where)._hold)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    loss, grads = _loss_and_grads(built, tokens, tokens.roll(-1, 1), tokens.numel())
    return loss, grads, kernel.forwards


@pytest.mark.parametrize("mode", ["upipe", "ulysses"])
def test_kept_blocks_run_the_kernel_forward_once_and_change_no_bit(mode):
    loss, grads, forwards = _one_rank(mode, KeepAttentionPlan())
    per_block = {"upipe": 8, "ulysses": 1}[mode]  # kernel calls of one block forward: UPipe's U = C = 1 stages
    assert forwards == 2 * N_LAYERS * per_block  # forward and recomputation
    for name, plan in PLANS.items():
        kept_loss, kept_grads, kept_forwards = _one_rank(mode, plan)
        assert kept_forwards == (2 * N_LAYERS - plan.blocks) * per_block, name
        assert torch.equal(kept_loss, loss), name
        assert all(torch.equal(kept_grads[k], grads[k]) for k in grads), name


@pytest.mark.parametrize("mode", ["upipe", "ulysses"])
def test_bit_for_bit_in_bf16_with_fused_rope_and_resident_inputs(mode):
    """Qwen3 in bf16 with ``fused_rope`` (whose in-place rotation, in a no-grad forward, rounds Q/K
    differently from the rotation under autograd: a kept block's forward must rotate as its
    recomputation will) and the top block's input resident on the device (its kept copies are
    fetched without a prefetch from above)."""
    options = {"family": "qwen3", "dtype": torch.bfloat16, "fused_rope": True, "resident_blocks": 1}
    loss, grads, _ = _one_rank(mode, KeepAttentionPlan(), **options)
    for name, plan in PLANS.items():
        kept_loss, kept_grads, _ = _one_rank(mode, plan, **options)
        assert torch.equal(kept_loss, loss), name
        assert all(torch.equal(kept_grads[k], grads[k]) for k in grads), (name, [k for k in grads
                                                                                if not torch.equal(kept_grads[k], grads[k])])


@pytest.mark.parametrize("mode", ["upipe", "ulysses"])
def test_a_record_kept_inexactly_is_caught(mode):
    """The comparison above can fail: an LSE kept at bf16 precision leaves the loss as it was (the
    forward's output is exact) and changes the gradients."""
    loss, grads, _ = _one_rank(mode, KeepAttentionPlan())
    sabotaged_loss, sabotaged_grads, _ = _one_rank(mode, PLANS["device"], LseKeptInBf16)
    assert torch.equal(sabotaged_loss, loss)
    assert not all(torch.equal(sabotaged_grads[k], grads[k]) for k in grads)


def test_kept_record_rules():
    kept = KeptAttention()
    with pytest.raises(RuntimeError, match="replayed before"):
        kept.replay()
    a, b = torch.ones(2), torch.zeros(3)
    kept.record(a, b)
    kept.record(b)
    kept.seal()
    with pytest.raises(RuntimeError, match="after it was sealed"):
        kept.record(a)
    first = kept.replay()
    assert first[0] is a and first[1] is b and kept.replay()[0] is b
    with pytest.raises(RuntimeError, match="more often"):
        kept.replay()


def test_plan_places_the_last_blocks_on_the_device_then_the_host():
    plan = KeepAttentionPlan(device_blocks=2, host_blocks=3)
    assert [plan.placement(i, 8) for i in range(8)] == [None, None, None, "host", "host", "host", "device", "device"]
    assert plan.describe(8) == "5 of 8 blocks keep their attention (2 on the device, 3 on the host)"
    assert KeepAttentionPlan().describe(4).startswith("no block of 4")
    # Llama3-8B at 1M tokens on 8 ranks (bf16): 1.016 GiB per block
    assert kept_attention_bytes(2**20 // 8, 32, 128, 2) / 2**30 == pytest.approx(1.015625)


# ---- real gloo ranks: every mode ------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    name: str
    mode: str
    ulysses: int = 0
    heads_per_stage: int | None = None
    documents: str | None = None
    """None: causal; else the document balance ("zigzag" or "documents")."""
    family: str = "llama3"

    def __str__(self) -> str:
        return self.name


MODES = [
    Mode("ulysses", "ulysses"),
    Mode("upipe-U=C", "upipe", heads_per_stage=4),
    Mode("upipe-U=H-qwen3", "upipe", heads_per_stage=8, family="qwen3"),
    Mode("ring", "ring"),
    Mode("usp", "usp", ulysses=2),
    Mode("upipe-in-usp", "upipe", ulysses=2),
    Mode("tsp", "tsp"),
    Mode("upipe-documents", "upipe", documents="zigzag"),
    Mode("ring-documents", "ring", documents="documents"),
    Mode("usp-documents-qwen3", "usp", ulysses=2, documents="documents", family="qwen3"),
]


def _convert(built, case: Mode, world_mesh):
    from titan_upipe.attention import convert_attention
    from titan_upipe.parallel import context_parallel_mesh
    from titan_upipe.tsp.modules import convert_block

    mesh = context_parallel_mesh(world_mesh, case.mode, case.ulysses)
    for block in built.layers.values():
        if case.mode == "tsp":
            convert_block(block, mesh, "sdpa")
        else:
            block.attention = convert_attention(block.attention, case.mode, mesh, heads_per_stage=case.heads_per_stage)
    return mesh


def _tokens(case: Mode):
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, EOS, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, EOS, (BATCH, SEQ), generator=generator)
    if case.documents:  # documents of 5 to 40 tokens, one row with a long one
        for row, ends in enumerate(([4, 20, 27, 50], [40, 47])):
            tokens[row, ends] = EOS
    labels[:, :3] = -100
    return tokens, labels


def _parallel_run(case: Mode, world_mesh, plan: KeepAttentionPlan, reference, gathered: list | None = None):
    """Loss and this rank's gradients (TSP: of its shards) with ``plan``; ``gathered`` gets the K/V
    bytes TSP's forwards (recomputations included) gathered."""
    from titan_upipe.parallel.inputs import prepare_cp_batch
    from titan_upipe.transforms.offload import apply_offloaded_ac
    from titan_upipe.tsp.collectives import CommLog

    built = copy.deepcopy(reference)
    mesh = _convert(built, case, world_mesh)
    logs = [CommLog() for _ in built.layers]
    if case.mode == "tsp":
        for block, log in zip(built.layers.values(), logs, strict=True):
            block.attention.comm_log = log
    schedule = apply_offloaded_ac(built, pin_memory=False, keep=plan)
    records = count_records(schedule)
    tokens, labels = _tokens(case)
    batch = prepare_cp_batch(tokens, labels, mesh, eos_id=EOS if case.documents else None, ignore_index=-100,
                             document_balance=case.documents or "zigzag", document_min_split=8)
    loss, grads = _loss_and_grads(built, batch.tokens, batch.labels, int(batch.valid_tokens), **batch.model_kwargs())
    torch.distributed.all_reduce(loss)
    if gathered is not None:
        gathered.append(sum(log.received[("forward", "all_gather")] for log in logs))
    # every block that keeps replayed what it recorded, and nothing is left
    assert len(records) == plan.blocks and all(k.replayed and not len(k) for k in records), records
    local = {k: (g.to_local() if hasattr(g, "to_local") else g) for k, g in grads.items()}
    return loss, local, grads


def _one_device(case: Mode, reference):
    """The loss and gradients one device computes: the unconverted model; for packed documents the
    converted model on a one-rank mesh (TorchTitan's own block-causal kernels have no CPU backward)."""
    from fake_meshes import OneRankMesh

    from titan_upipe.attention import convert_attention
    from titan_upipe.parallel.inputs import prepare_cp_batch

    built = copy.deepcopy(reference)
    tokens, labels = _tokens(case)
    kwargs = {}
    if case.documents:
        for block in built.layers.values():
            block.attention = convert_attention(block.attention, "upipe", OneRankMesh())
        batch = prepare_cp_batch(tokens, labels, OneRankMesh(), eos_id=EOS, ignore_index=-100)
        kwargs = {"attention_masks": batch.attention_masks}
    return _loss_and_grads(built, tokens, labels, int((labels != -100).sum()), **kwargs)


def _run_mode(rank: int, world: int, world_mesh, case: Mode) -> dict[str, object]:
    from titan_upipe.tsp.modules import tsp_sharded_parameters  # noqa: F401  (imported: the TSP modules load)

    torch.manual_seed(5)
    reference = model(case.family)
    gathered: list[int] = []
    loss, local, full = _parallel_run(case, world_mesh, KeepAttentionPlan(), reference, gathered)
    out: dict[str, object] = {"gathered": gathered}
    for name, plan in PLANS.items():
        kept_loss, kept_local, _ = _parallel_run(case, world_mesh, plan, reference, gathered)
        out[f"bitwise {name}"] = torch.equal(kept_loss, loss) and all(torch.equal(kept_local[k], local[k])
                                                                      for k in local)
    one_loss, one_grads = _one_device(case, reference)
    out["loss error"] = float(((loss - one_loss).abs() / one_loss.abs()).item())
    worst = 0.0
    for name, grad in full.items():
        whole = grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()
        if not hasattr(grad, "full_tensor"):  # a replicated parameter: the ranks' shares add up
            torch.distributed.all_reduce(whole)
        key = name.replace("._checkpoint_wrapped_module", "")
        scale = one_grads[key].abs().max().clamp_min(1e-12)
        worst = max(worst, float(((whole - one_grads[key]).abs().max() / scale).item()))
    out["grad error"] = worst
    return out


def _run_modes(rank, world, world_mesh, cases):
    return [_run_mode(rank, world, world_mesh, case) for case in cases]


_RESULTS: list | None = None


def _results(case: Mode) -> list[dict[str, object]]:
    global _RESULTS
    if _RESULTS is None:
        _RESULTS = run_distributed(4, _run_modes, MODES, timeout=600)
    return [per_rank[MODES.index(case)] for per_rank in _RESULTS]


@pytest.mark.parametrize("case", MODES, ids=str)
def test_every_mode_keeps_bit_for_bit_and_matches_one_device(case: Mode):
    for rank, result in enumerate(_results(case)):
        for name in PLANS:
            assert result[f"bitwise {name}"], (rank, name)
        assert result["loss error"] <= FP32_RTOL, (rank, result)
        assert result["grad error"] <= FP32_RTOL, (rank, result)
        if case.mode == "tsp":  # a kept block's recomputation gathers no K/V: N forwards + (N - k) recomputations
            full, *kept = result["gathered"]
            assert full > 0 and kept == [full * (2 * N_LAYERS - plan.blocks) // (2 * N_LAYERS)
                                         for plan in PLANS.values()], (rank, result["gathered"])


# ---- memory: the emulator's kept bytes are the planner's term ---------------------------------

_MEASURE = """
import json, sys
from titan_upipe.emulate import measure_step
from titan_upipe.torchtitan_0_2.config_parse import parse_config
out = []
for world, n_layers, args in json.loads(sys.argv[1]):
    m = measure_step(parse_config(args, quiet=True), world, fake=True, n_layers=n_layers,
                     full_layers=None if n_layers is None else 4)
    out.append({"retained": m.retained_bytes_per_layer, "host": m.host_offload_bytes, "layers": m.n_layers,
                "forward": m.full.phase_peak_bytes["forward"], "full_host": m.full.host_offload_bytes,
                "measured_forward": m.phase_peak_bytes["forward"]})
print(json.dumps(out))
"""

OFFLOADED = ("--activation_checkpoint.mode", "full", "--activation_checkpoint.cpu_offload",
             "--activation_checkpoint.no-pin_memory", "--training.seq_len", "512")
MEMORY_CASES = [("configs/debug/llama3_upipe_transforms.toml", 2), ("configs/debug/ulysses.toml", 4),
                ("configs/debug/tsp.toml", 4)]
KEEPS = [("device", "2"), ("device", "1"), ("host", "1")]
"""The plans of a 4-block model (the debug flavor's 2 blocks plus 2, ``--full-layers 4``) whose top
2 blocks the emulator measures: both keeping on the device; the top one alone; one on the host."""


def _keep_args(config: str, keep: str, blocks: str = "2") -> list[str]:
    return ["--job.config_file", config, *OFFLOADED, "--activation_checkpoint.keep_attention", keep,
            "--activation_checkpoint.keep_attention_blocks", blocks]


@pytest.fixture(scope="module")
def emulated() -> dict[str, list[dict]]:
    """Every emulator measurement of this module, in two processes at once (fake process group, CPU)."""
    import os

    from plan_jobs import run_split

    runs = {"terms": [(world, None, _keep_args(config, keep)) for config, world in MEMORY_CASES
                      for keep in ("off", "device", "host")],
            "extrapolated": [(2, n_layers, _keep_args(MEMORY_CASES[0][0], where, blocks))
                             for where, blocks in KEEPS for n_layers in (2, 4)]}
    flat = [run for name in runs for run in runs[name]]
    measured = run_split(_MEASURE, flat, {**os.environ, "TITAN_UPIPE_DEVICE": "cpu"}, timeout=600)
    return {"terms": measured[:len(runs["terms"])], "extrapolated": measured[len(runs["terms"]):]}


def test_emulated_kept_bytes_are_the_planners_term(emulated):
    """Per block, on the device: the emulator's tracked bytes a block keeps after its forward grow by
    exactly the planner's term; on the host: the offloaded bytes grow by it (pageable, exact)."""
    from titan_upipe.plan.kept import kept_bytes, kept_tensor_bytes
    from titan_upipe.plan.sizes import StepSizes
    from titan_upipe.torchtitan_0_2.config_parse import parse_config
    from titan_upipe.torchtitan_0_2.job_plan import plan_input_from_job_config
    from titan_upipe.torchtitan_0_2.registry import register_plugin

    register_plugin()
    for index, (config, world) in enumerate(MEMORY_CASES):
        off, device, host = emulated["terms"][3 * index: 3 * index + 3]
        job = plan_input_from_job_config(parse_config(_keep_args(config, "device"), quiet=True), world, "cpu")
        sizes = StepSizes.of(job)
        term = kept_bytes(sizes)
        assert term == sum(kept_tensor_bytes(sizes)) > 0
        assert device["retained"] - off["retained"] == term, (config, device, off, term)
        assert host["host"] - off["host"] == host["layers"] * term, (config, host, off, term)
        assert host["retained"] == off["retained"], config


def test_two_blocks_extrapolate_kept_attention_to_four(emulated):
    """The emulator's 2 measured blocks are the top of a 4-block model and keep as its plan's top
    blocks do; the blocks below keep as the plan says: the extrapolated forward peak (the end of
    forward: every kept record alive) and host bytes equal a measured 4-block model's exactly."""
    for index, keep in enumerate(KEEPS):
        two, four = emulated["extrapolated"][2 * index: 2 * index + 2]
        assert two["forward"] == four["measured_forward"], (keep, two, four)
        assert two["full_host"] == four["host"], (keep, two, four)


def _agree(rank: int, world: int, world_mesh, plans: list[tuple[int, int]]) -> tuple[int, int]:
    from titan_upipe.torchtitan_0_2.checks.keep_attention import (
        known_keep_attention_plan,
        set_keep_attention_plan,
    )
    from titan_upipe.torchtitan_0_2.config_parse import parse_config
    from titan_upipe.torchtitan_0_2.parallelize import agreed_keep_plan
    from titan_upipe.torchtitan_0_2.registry import register_plugin

    register_plugin()
    job_config = parse_config(["--job.config_file", "configs/debug/llama3_upipe_transforms.toml",
                               "--activation_checkpoint.keep_attention", "auto"], quiet=True)
    set_keep_attention_plan(job_config, KeepAttentionPlan(*plans[rank]))  # as if this rank's memory sized it
    agreed = agreed_keep_plan(job_config)
    assert known_keep_attention_plan(job_config) == agreed  # what TensorBoard then writes
    return agreed.device_blocks, agreed.host_blocks


def test_ranks_whose_memory_sizes_auto_differently_keep_the_smallest_plan():
    """A kept block skips communication (UPipe's all-to-alls, a ring's passes): every rank must keep
    the same blocks, however its machine's memory sized ``auto``."""
    assert run_distributed(2, _agree, [(2, 0), (1, 1)], timeout=300) == [(1, 0), (1, 0)]
