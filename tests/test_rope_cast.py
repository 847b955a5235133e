"""Qwen3's RoPE table reaches every block as the model's one fp32 tensor (issue 34).

FSDP2's ``MixedPrecisionPolicy`` casts a module's floating-point forward inputs to the parameter
dtype by default. Qwen3's RoPE table is fp32 ``cos||sin`` ``[S, 2D]`` (with ``fused_rope`` this
rank's rows ``[T, 2D]``), so every block got a bf16 copy of it, and under offloaded full AC every
block kept its copy to its backward. ``parallelize.apply_fsdp`` (``torchtitan_common.fsdp.shard_decoder``)
turns the cast off for the blocks.
The "cast" variant below is FSDP's default restored (``cast_forward_inputs=True`` for every
group): the code before the fix, as far as the blocks' inputs go.

Expected bytes, computed here from the config alone (rank 0 of 2, bf16 parameters, UPipe CP 2,
Qwen3 debug flavor: ``head_dim`` D = 16), L blocks, T = seq_len / 2 local tokens:

* one bf16 copy per block: ``T * 2D * 2`` bytes with ``fused_rope``, ``seq_len * 2D * 2`` without;
* forward peak (inputs offloaded: nothing else grows with depth): L copies fewer;
* whole-step peak, without ``fused_rope``: L copies fewer (the fp32 table is a model buffer, part
  of the baseline). With ``fused_rope``: the fp32 rows (``T * 2D * 4``, two copies' bytes), built
  per step, are now what the blocks keep to their backward: L - 2 copies fewer. The saving grows
  with depth: 62 copies at Qwen3-32B's 64 blocks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from plan_jobs import run_split

from titan_upipe.attention.projection import RotaryKind, rotate, rotate_
from titan_upipe.torchtitan_0_2.flavors import model_flavors

REPO = Path(__file__).resolve().parents[1]
HEAD_DIM = 16
"""Qwen3 debug flavor's ``head_dim`` (checked against the flavor below)."""
DOC = " ".join((REPO / "docs/transforms.md").read_text().split())
"""docs/transforms.md, white space collapsed (it quotes the measurements)."""

EMULATE = r"""
import json, sys
from torch.distributed.fsdp import MixedPrecisionPolicy
from titan_upipe.attention.module import ContextParallelAttention
from titan_upipe.emulate import measure_step
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_common import fsdp

tables = []  # the RoPE table every attention call receives from its block
attention_forward = ContextParallelAttention.forward
def recording_forward(self, x, freqs_cis, *args, **kwargs):
    tables.append((str(freqs_cis.dtype).removeprefix("torch."), freqs_cis.untyped_storage().data_ptr(),
                   list(freqs_cis.shape)))
    return attention_forward(self, x, freqs_cis, *args, **kwargs)
ContextParallelAttention.forward = recording_forward

out = []
for spec in json.loads(sys.argv[1]):
    result = {}
    for variant in ("fixed", "cast"):
        fsdp.MixedPrecisionPolicy = (MixedPrecisionPolicy if variant == "fixed" else
                                     lambda **kw: MixedPrecisionPolicy(**{**kw, "cast_forward_inputs": True}))
        tables.clear()
        m = measure_step(parse_config(spec["args"]), 2, fake=True, time_attention=False, n_layers=spec["layers"])
        result[variant] = {"total": m.total_peak_bytes, "forward": m.phase_peak_bytes["forward"],
                           "retained": m.retained_bytes_per_layer, "dtypes": sorted({d for d, _, _ in tables}),
                           "storages": len({p for _, p, _ in tables}), "shapes": sorted({tuple(s) for *_, s in tables}),
                           "calls": len(tables)}
    out.append(result)
print(json.dumps(out))
"""


def _run_snippet(code: str, specs: list[dict]) -> list:
    """``code`` in fresh processes (each its own process group), ``specs`` dealt to them as their
    argument; each process's last stdout line, parsed, a result per spec. ``tests/`` is importable there (the model builders of test_transforms)."""
    env = {**os.environ, "TITAN_UPIPE_DEVICE": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))}
    return run_split(code, specs, env)  # two specs at once, one per core


def _qwen3_offloaded(seq_len: int, converters: str) -> list[str]:
    return ["--job.config_file", str(REPO / "configs/debug/qwen3_upipe.toml"), "--training.local_batch_size", "1",
            "--training.seq_len", str(seq_len), "--model.converters", converters,
            "--transforms.ce_backend", "torch", "--training.mixed_precision_param", "bfloat16",
            "--activation_checkpoint.mode", "full", "--activation_checkpoint.cpu_offload"]


# (seq_len, blocks, fused_rope)
CASES = [(2048, 4, True), (1024, 3, False)]


def test_blocks_receive_the_fp32_table_and_the_peak_drops_by_the_copies():
    assert model_flavors("upipe_qwen3")["debug"].head_dim == HEAD_DIM
    specs = [{"args": _qwen3_offloaded(seq, "upipe,tiled_rmsnorm,fused_ce,tiled_mlp" + (",fused_rope" if fused else "")),
              "layers": layers} for seq, layers, fused in CASES]
    results = _run_snippet(EMULATE, specs)
    for (seq, layers, fused), got in zip(CASES, results, strict=True):
        rows = seq // 2 if fused else seq  # this rank's rows, or the full table (max_seq_len = seq_len)
        copy = rows * 2 * HEAD_DIM * 2  # one bf16 copy
        fixed, cast = got["fixed"], got["cast"]
        # Every attention call (forward, and the recompute in backward) gets the model's one fp32
        # table; with the cast each block gets a bf16 copy of its own.
        assert fixed["calls"] == cast["calls"] == 2 * layers, got
        assert fixed["shapes"] == cast["shapes"] == [[rows, 2 * HEAD_DIM]], got
        assert (fixed["dtypes"], fixed["storages"]) == (["float32"], 1), got
        assert (cast["dtypes"], cast["storages"]) == (["bfloat16"], layers), got
        # Bytes: each block kept its copy from its forward (the emulator's retained bytes per block)...
        assert (fixed["retained"], cast["retained"]) == (0, copy), got
        # ... all L live at the last block's forward, ...
        assert cast["forward"] - fixed["forward"] == layers * copy, got
        # ... and to the backward peak, where the fp32 rows (2 copies' bytes) now stand in for them.
        assert cast["total"] - fixed["total"] == (layers - 2 if fused else layers) * copy, got
        # docs/transforms.md quotes these measurements.
        quoted = (f"retained per block {copy:,} → 0 B, forward peak −{layers * copy:,} B, total "
                  f"−{(layers - 2) * copy:,} B" if fused else f"total −{layers * copy:,} B")
        assert quoted in DOC, quoted


def test_qwen3_32b_copies_as_documented():
    """The doc's scale: one bf16 copy of this rank's rows per block, Qwen3-32B at 2.5M tokens on 8."""
    args = model_flavors("upipe_qwen3")["32B"]
    rows = 2621440 // 8  # 2.5M tokens over 8 CP ranks
    assert args.n_layers * rows * 2 * args.head_dim * 2 == 10 * 2**30
    assert f"{args.n_layers} × {rows:,} × {2 * args.head_dim} × 2 B = 10 GiB" in DOC


STRUCTURE = r"""
import json, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.models.llama3.infra.parallelize import apply_fsdp as torchtitan_apply_fsdp
from test_transforms import llama3, qwen3
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_0_2.parallelize import apply_fsdp

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)


def describe(model):
    # Every FSDP module: the modules sharing its state, reshard after forward, mixed precision,
    # offload, mesh, and its parameters' FQNs.
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        group = state._fsdp_param_group
        names = {id(m): n for n, m in model.named_modules()}
        out[name or "<root>"] = {
            "modules": [names[id(m)] for m in state._modules], "mp": repr(state._mp_policy),
            "reshard": None if group is None else group.post_forward_mesh_info is not None,
            "offload": None if group is None else type(group.offload_policy).__name__,
            "mesh": None if group is None else list(group.mesh_info.mesh.mesh_dim_names),
            "params": None if group is None else sorted(f"{names[id(p._module_info.module)]}.{p._module_info.param_name}"
                                                   for p in group.fsdp_params)}
    return out


result = []
for case in json.loads(sys.argv[1]):
    job = parse_config(case["args"])
    names = ["dp_replicate", "fsdp"] if case["replicate"] else ["fsdp"]
    mesh = init_device_mesh("cpu", (2, 2) if case["replicate"] else (4,), mesh_dim_names=tuple(names))
    build = llama3 if case["family"] == "llama3" else qwen3
    with torch.device("meta"):  # as TorchTitan shards (CPU offload would pin real memory)
        ours, theirs = build(), build()
    apply_fsdp(ours, mesh, job)
    torchtitan_apply_fsdp(theirs, mesh, TORCH_DTYPE_MAP[job.training.mixed_precision_param],
                          TORCH_DTYPE_MAP[job.training.mixed_precision_reduce], pp_enabled=False,
                          cpu_offload=job.training.enable_cpu_offload,
                          reshard_after_forward_policy=job.parallelism.fsdp_reshard_after_forward)
    result.append({"ours": describe(ours), "theirs": describe(theirs)})
print(json.dumps(result))
"""

# (family, replicate, overrides)
STRUCTURE_CASES = [
    ("qwen3", False, ()),
    ("llama3", True, ("--parallelism.fsdp_reshard_after_forward", "always")),
    ("qwen3", False, ("--parallelism.fsdp_reshard_after_forward", "never", "--training.enable_cpu_offload")),
]


def test_fsdp_wraps_as_torchtitan_but_for_the_blocks_input_cast():
    """``apply_fsdp`` (the one FSDP of every mode, TSP's included) against TorchTitan's own on the
    same model and mesh (a fake 4-rank process group): the same groups, parameters, reshard
    policy, mixed precision, CPU offload and mesh (dp_replicate x fsdp included); the blocks'
    policy differs in ``cast_forward_inputs`` alone."""
    specs = [{"family": family, "replicate": replicate,
              "args": ["--job.config_file", str(REPO / "configs/debug/qwen3_fsdp.toml"),
                       "--training.mixed_precision_param", "bfloat16", *overrides]}
             for family, replicate, overrides in STRUCTURE_CASES]
    results = _run_snippet(STRUCTURE, specs)
    for (family, replicate, overrides), got in zip(STRUCTURE_CASES, results, strict=True):
        ours, theirs = got["ours"], got["theirs"]
        blocks = [name for name in theirs if name.startswith("layers.")]
        assert len(blocks) == 2 and {"tok_embeddings", "norm", "<root>"} <= set(theirs), theirs
        for name in blocks:
            assert "cast_forward_inputs=True" in theirs[name]["mp"], theirs[name]
            theirs[name]["mp"] = theirs[name]["mp"].replace("cast_forward_inputs=True", "cast_forward_inputs=False")
        assert ours == theirs, (family, replicate, overrides)
        assert ours["norm"]["reshard"] is ("always" in overrides)
        assert ours["layers.0"]["offload"] == ("CPUOffloadPolicy" if "--training.enable_cpu_offload" in overrides
                                               else "OffloadPolicy")
        assert ours["layers.0"]["mesh"] == (["dp_replicate", "fsdp"] if replicate else ["fsdp"])


@pytest.mark.parametrize("positions_shape", [(1, 300), (2, 300)])
def test_rope_of_the_fp32_table_equals_rope_of_its_bf16_cast_bit_for_bit(positions_shape):
    """What FSDP's cast handed the attention before (the table rounded to bf16, then rows
    selected) and what it gets now (the fp32 table; each RoPE rounds the selected rows to x's
    dtype) give the same bits: TorchTitan's Qwen3 RoPE, the converted attention's autograd RoPE
    and its in-place RoPE (``fused_rope``, which without its own rounding would multiply by the
    unrounded fp32 cos/sin)."""
    from torchtitan.models.qwen3.model.model import apply_rotary_emb, precompute_rope_cache

    torch.manual_seed(0)
    table = precompute_rope_cache(64, 512, 1e6)
    cast = table.to(torch.bfloat16)
    positions = torch.randint(0, 512, positions_shape)
    x = (torch.randn(2, 300, 3, 64) * 10).to(torch.bfloat16)
    k = (torch.randn(2, 300, 1, 64) * 10).to(torch.bfloat16)
    assert torch.equal(rotate(x, table, positions, RotaryKind.COS_SIN), rotate(x, cast, positions, RotaryKind.COS_SIN))
    got = rotate_(x.clone(), table, positions, RotaryKind.COS_SIN)
    assert torch.equal(got, rotate_(x.clone(), cast, positions, RotaryKind.COS_SIN))
    # The comparison is live: rotating by the unrounded fp32 cos/sin gives other bits.
    unrounded = rotate_(x.float(), table, positions, RotaryKind.COS_SIN).to(torch.bfloat16)
    assert not torch.equal(got, unrounded)
    for a, b in zip(apply_rotary_emb(x, k, table, positions), apply_rotary_emb(x, k, cast, positions), strict=True):
        assert torch.equal(a, b)


def test_rotate_with_the_fp32_table_peaks_as_with_its_bf16_cast():
    """The autograd RoPE (UPipe's projection backward, TSP, non-fused UPipe) selects the rows of
    the fp32 table now: twice the bytes of the bf16 rows it selected from the cast table. It
    lets them go once cos and sin are rounded (as many bytes as the bf16 rows), so its products
    peak on the same bytes as before. Live-tensor bytes, 4 heads of 64 over 256 positions."""
    from torchtitan.models.qwen3.model.model import precompute_rope_cache

    from titan_upipe.toolkit.memory_tracker import LiveTensorTracker

    torch.manual_seed(0)
    table = precompute_rope_cache(64, 512, 1e6)
    cast = table.to(torch.bfloat16)
    x = torch.randn(1, 256, 4, 64).to(torch.bfloat16)
    positions = torch.randperm(512)[:256].unsqueeze(0)
    peaks = []
    for rope in (table, cast):
        with LiveTensorTracker() as mem:
            rotate(x, rope, positions, RotaryKind.COS_SIN)
        peaks.append(mem.peak_bytes)
    rows, heads = 256 * 2 * 64 * 2, 256 * 4 * 64 * 2  # bf16 rows of the cast table; x
    # The bf16 rows (or cos and sin), x*cos, rotate_half(x)*sin and their sum.
    assert peaks == [rows + 3 * heads] * 2


CAST_SITE = """
import os
import torch.distributed.fsdp as _fsdp

_Policy = _fsdp.MixedPrecisionPolicy


def _casting(**kw):
    with open(os.path.join(os.environ["ROPE_CAST_MARKS"], str(os.getpid())), "a") as marks:
        marks.write("cast\\n")
    return _Policy(**{**kw, "cast_forward_inputs": True})


_fsdp.MixedPrecisionPolicy = _casting
"""


def test_qwen3_fused_rope_training_bit_for_bit_as_with_the_cast(tmp_path):
    """Two bf16 training steps of Qwen3 UPipe with ``fused_rope`` on 2 gloo ranks, offloaded full
    AC: the same losses and gradient norms, to the last bit, as with FSDP's cast restored (a
    ``sitecustomize`` of the test's own, imported before ``parallelize``)."""
    from trainer_utils import read_scalars, torchrun

    site, marks = tmp_path / "site", tmp_path / "marks"
    site.mkdir()
    marks.mkdir()
    (site / "sitecustomize.py").write_text(CAST_SITE)
    path = os.environ.get("PYTHONPATH")
    cast_env = {"PYTHONPATH": str(site) + (os.pathsep + path if path else ""), "ROPE_CAST_MARKS": str(marks)}
    run = ("--training.steps", "2", "--training.mixed_precision_param", "bfloat16", "--model.converters",
           "upipe,tiled_rmsnorm,fused_ce,tiled_mlp,fused_rope", "--transforms.ce_backend", "torch",
           "--activation_checkpoint.mode", "full", "--activation_checkpoint.cpu_offload")
    scalars = {}
    for variant, env in (("fixed", None), ("cast", cast_env)):
        torchrun(2, "titan_upipe.train", "configs/debug/qwen3_upipe.toml", tmp_path / variant, *run, env=env)
        got = read_scalars(tmp_path / variant)
        scalars[variant] = {tag: got[tag] for tag in ("loss_metrics/global_avg_loss", "grad_norm")}
    assert [s for s, _ in scalars["fixed"]["grad_norm"]] == [1, 2]
    # The cast was on: both ranks built their FSDP policies through the patch.
    assert len([f for f in marks.iterdir() if f.read_text()]) == 2
    assert scalars["fixed"] == scalars["cast"]
