"""Settings and inputs that cannot run exactly fail with a ConfigError before any communication;
conversion keeps the module's parameters, names and meta-device construction.

``NoCommMesh`` stands in for a 1-D DeviceMesh and fails the test if anything asks it for a
process group, which is how "before any communication" is checked.
"""

from __future__ import annotations

import re

import pytest
import torch
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import Attention as Llama3Attention
from torchtitan.models.llama3.model.model import precompute_freqs_cis
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
from torchtitan.models.qwen3.model.model import Attention as Qwen3Attention
from torchtitan.models.qwen3.model.model import precompute_rope_cache

from titan_upipe.attention import convert_attention
from titan_upipe.parallel import ContiguousLayout, shard_sequence
from titan_upipe.torchtitan_0_2.config import ConfigError


class NoCommMesh:
    """A mesh of ``size`` ranks seen from rank 0 that refuses to communicate (size 1: no group needed).
    ``names``/``shape`` make it a named 1-D ("ring") or 2-D ("ring", "ulysses") mesh."""

    def __init__(self, size: int, ndim: int = 1, names: tuple[str, ...] | None = None,
                 shape: tuple[int, ...] | None = None) -> None:
        self._size, self.ndim, self.mesh_dim_names = size, ndim, names
        self.shape = shape or (size,)

    def size(self, dim: int | None = None) -> int:
        return self._size if dim is None else self.shape[dim]

    def get_local_rank(self, dim: str | None = None) -> int:
        return 0

    def get_group(self):
        if self._size == 1:
            return None
        raise AssertionError("communication attempted before validation finished")


def llama3(n_heads: int = 8, n_kv_heads: int = 2, **kw) -> Llama3Attention:
    return Llama3Attention(TransformerModelArgs(dim=16 * n_heads, n_heads=n_heads, n_kv_heads=n_kv_heads, **kw))


def qwen3(n_heads: int = 8, n_kv_heads: int = 2, **kw) -> Qwen3Attention:
    return Qwen3Attention(Qwen3ModelArgs(dim=32, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=16, **kw))


def ring_mesh(size: int) -> NoCommMesh:
    return NoCommMesh(size, names=("ring",))


def usp_mesh(ring: int, ulysses: int) -> NoCommMesh:
    return NoCommMesh(ring * ulysses, ndim=2, names=("ring", "ulysses"), shape=(ring, ulysses))


@pytest.mark.parametrize(("mode", "mesh", "message"), [
    ("ring", NoCommMesh(2), "mode 'ring' needs a 1-D mesh named 'ring'"),
    ("ring", usp_mesh(2, 2), "mode 'ring' needs"),
    ("usp", NoCommMesh(4), "mode 'usp' needs a 2-D"),
    ("usp", ring_mesh(4), "mode 'usp' needs a 2-D"),
    ("ulysses", usp_mesh(2, 2), "use mode 'usp'"),
    ("upipe", ring_mesh(2), "named 'ring' is sharded zigzag"),
    ("usp", NoCommMesh(4, ndim=2, names=("dp", "cp"), shape=(2, 2)), r"2-D with dims \('ring', 'ulysses'\)"),
])
def test_mode_and_mesh_must_agree(mode: str, mesh: NoCommMesh, message: str) -> None:
    """The mesh decides the sequence layout; a mode that attends another layout is refused."""
    with pytest.raises(ConfigError, match=message):
        convert_attention(llama3(), mode, mesh)


@pytest.mark.parametrize(("mode", "mesh"), [("ring", ring_mesh(4)), ("usp", usp_mesh(2, 2)),
                                            ("upipe", usp_mesh(2, 2)), ("ring", usp_mesh(4, 1))])
def test_ring_modes_convert_without_communication(mode: str, mesh: NoCommMesh) -> None:
    layer = convert_attention(qwen3(), mode, mesh)
    ring, ulysses = mesh.shape if mesh.ndim == 2 else (mesh.size(), 1)
    assert (layer.cp_degree, layer.ring_degree, layer.ulysses_degree) == (ring * ulysses, ring, ulysses)


def test_usp_ulysses_degree_must_split_the_heads() -> None:
    with pytest.raises(ConfigError, match=re.escape("ulysses degree 3 cannot split n_heads=8, n_kv_heads=2 exactly: "
                                                    "valid CP degrees are [2, 4, 8]")):
        convert_attention(llama3(), "usp", usp_mesh(2, 3))
    with pytest.raises(ConfigError, match=r"valid values for n_heads=8 at CP degree 2 are 0 \(= 2\) or \[2, 4, 8\]"):
        convert_attention(llama3(), "upipe", usp_mesh(2, 2), heads_per_stage=3)


@pytest.mark.parametrize(("mesh", "local_len", "message"), [
    (ring_mesh(2), 3, r"2 x ring x ulysses = 2 x 2 x 1 = 4"),
    (usp_mesh(3, 2), 5, r"2 x 3 x 2 = 12"),
])
def test_ring_sequence_split_rejected_before_communication(mesh: NoCommMesh, local_len: int, message: str) -> None:
    layer = convert_attention(llama3(), "usp" if mesh.ndim == 2 else "ring", mesh)
    with pytest.raises(ConfigError, match=message):
        layer(torch.zeros(1, local_len, 128), precompute_freqs_cis(16, 64), None)
    with pytest.raises(ConfigError, match=message):
        shard_sequence(torch.zeros(1, local_len * mesh.size(), 8), mesh, seq_dim=1)


def test_unknown_mode() -> None:
    with pytest.raises(ConfigError, match="valid modes are ulysses, upipe"):
        convert_attention(llama3(), "pipe", NoCommMesh(2))


@pytest.mark.parametrize("mesh", [ring_mesh(2), NoCommMesh(2), usp_mesh(2, 2)], ids=["ring", "1-D", "usp"])
@pytest.mark.parametrize("model", [llama3, qwen3])
def test_tsp_is_not_an_attention_mode(model, mesh: NoCommMesh) -> None:
    """tsp shards the attention's and the MLP's weights: convert_attention refuses it, on every mesh,
    naming the tsp converter (it used to build a replicated-weight UPipe U = H / ring attention)."""
    with pytest.raises(ConfigError, match=re.escape('convert_attention does not build TSP') + '.*'
                       + re.escape('model.converters = ["tsp"]') + '.*convert_block'):
        convert_attention(model(), "tsp", mesh)


def test_a_context_parallel_attention_built_as_tsp_does_not_run() -> None:
    """Built by hand under tsp's name, the plain module refuses its first forward instead of running
    UPipe; TSPAttention (its own forward) is the only thing that runs as tsp."""
    from titan_upipe.attention.module import AttentionSpec, ContextParallelAttention
    from titan_upipe.spec.head_schedule import build_schedule

    source = llama3()
    layer = ContextParallelAttention(source, AttentionSpec.of(source), "tsp", NoCommMesh(1), build_schedule(8, 2, 1, 8),
                                     "sdpa")
    with pytest.raises(ConfigError, match="convert_attention does not build TSP"):
        layer(torch.zeros(1, 4, 128), precompute_freqs_cis(16, 64), None)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(("heads", "cp", "u", "message"), [
    ((16, 4), 4, 6, r"not a multiple of the CP degree 4\): valid values .* \[4, 8, 16\]"),
    ((24, 6), 2, 10, r"n_heads=24 is not divisible by it\): valid values .* \[2, 4, 6, 8, 12, 24\]"),
    ((8, 2), 2, 16, r"valid values for n_heads=8 at CP degree 2 are 0 \(= 2\) or \[2, 4, 8\]"),
])
def test_invalid_heads_per_stage(heads, cp: int, u: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        convert_attention(llama3(*heads), "upipe", NoCommMesh(cp), heads_per_stage=u)


@pytest.mark.parametrize(("heads", "cp", "valid"), [
    ((8, 2), 3, "[2, 4, 8]"),
    ((12, 3), 2, "[3, 6, 12]"),  # 2 ranks cannot split 3 KV heads, nor share one
    ((8, 8), 16, "[2, 4, 8]"),
])
@pytest.mark.parametrize("mode", ["ulysses", "upipe"])
def test_invalid_cp_degree_names_the_valid_ones(heads, cp: int, valid: str, mode: str) -> None:
    with pytest.raises(ConfigError, match="valid CP degrees are " + re.escape(valid)):
        convert_attention(llama3(*heads), mode, NoCommMesh(cp))


def test_sequence_not_divisible_by_cp() -> None:
    with pytest.raises(ConfigError, match="not divisible by the context-parallel degree 4"):
        shard_sequence(torch.zeros(1, 10, 8), NoCommMesh(4), seq_dim=1)
    with pytest.raises(ConfigError, match="use a multiple of 4"):
        ContiguousLayout(10, 4)


@pytest.mark.parametrize("mode", ["ulysses", "upipe"])
def test_other_masks_rejected_before_communication(mode: str) -> None:
    layer = convert_attention(qwen3(), mode, NoCommMesh(2))
    with pytest.raises(ConfigError, match="attention_masks from titan_upipe.attention.document_mask"):
        layer(torch.zeros(1, 4, 32), precompute_rope_cache(16, 8), attention_masks=object())
    from titan_upipe.parallel.document_mask import document_mask

    with pytest.raises(ConfigError, match="covers 6 tokens but the sequence has 8"):
        layer(torch.zeros(1, 4, 32), precompute_rope_cache(16, 8), attention_masks=document_mask(torch.zeros(1, 6, dtype=torch.long)))


@pytest.mark.parametrize("make, attn_type", [(llama3, "flex"), (llama3, "varlen"), (qwen3, "flex")])
def test_flex_and_varlen_modules_convert(make, attn_type: str) -> None:
    """TorchTitan's flex/varlen kernels are replaced like sdpa's (packed documents come as a
    document_mask, built by the trainer from attn_mask_type; other masks: the test above)."""
    source = make(attn_type=attn_type)
    layer = convert_attention(source, "upipe", NoCommMesh(2))
    assert layer.wq is source.wq and layer.attn_type == "sdpa"


def test_unknown_and_unavailable_backends() -> None:
    with pytest.raises(ConfigError, match="unknown attention backend 'xformers'"):
        convert_attention(llama3(), "upipe", NoCommMesh(2), backend="xformers")
    if not torch.cuda.is_available():
        for name in ("cudnn", "flash_attn", "flash_attn3", "flash_attn4"):
            with pytest.raises(ConfigError, match="needs a CUDA device"):
                convert_attention(llama3(), "upipe", NoCommMesh(2), backend=name)


@pytest.mark.parametrize("positions", [torch.arange(3), torch.arange(8).view(2, 4), torch.zeros(4, 2, dtype=torch.long),
                                       torch.arange(4.0)])
def test_bad_positions_rejected_before_communication(positions: torch.Tensor) -> None:
    layer = convert_attention(llama3(), "upipe", NoCommMesh(2))
    with pytest.raises(ConfigError, match="positions must"):
        layer(torch.zeros(3, 4, 128), precompute_freqs_cis(16, 64), None, positions=positions)


def test_wrong_rope_table_rejected() -> None:
    layer = convert_attention(llama3(), "upipe", NoCommMesh(2))
    with pytest.raises(ConfigError, match="Llama3 freqs_cis"):
        layer(torch.zeros(1, 4, 128), precompute_rope_cache(16, 64), None)
    with pytest.raises(ConfigError, match="exceeds the RoPE table"):
        layer(torch.zeros(1, 4, 128), precompute_freqs_cis(16, 6), None)


def test_mesh_and_module_kinds() -> None:
    with pytest.raises(ConfigError, match="1-D"):
        convert_attention(llama3(), "upipe", NoCommMesh(2, ndim=2))
    with pytest.raises(ConfigError, match="Llama3 and Qwen3 Attention"):
        convert_attention(torch.nn.Linear(4, 4), "upipe", NoCommMesh(2))


# --- what conversion preserves --------------------------------------------------------------


@pytest.mark.parametrize("make", [llama3, qwen3])
@pytest.mark.parametrize("mode", ["ulysses", "upipe"])
def test_parameters_are_shared_with_unchanged_names(make, mode: str) -> None:
    source = make()
    layer = convert_attention(source, mode, NoCommMesh(2))
    assert list(layer.state_dict()) == list(source.state_dict())
    assert all(a is b for a, b in zip(layer.parameters(), source.parameters(), strict=True))
    assert [n for n, _ in layer.named_parameters()] == [n for n, _ in source.named_parameters()]
    with torch.no_grad():  # as TorchTitan's Transformer.init_weights calls it
        layer.init_weights(0.02)


def test_converts_on_the_meta_device() -> None:
    """TorchTitan converts the model on the meta device before materializing it."""
    with torch.device("meta"):
        source = qwen3(16, 4)
    layer = convert_attention(source, "upipe", NoCommMesh(4), heads_per_stage=8)
    assert layer.wq.weight.is_meta and layer.heads_per_stage == 8 and layer.schedule.n_stages == 2
    layer.to_empty(device="cpu")
    assert layer.wq.weight.device.type == "cpu"


def test_qwen3_without_qk_norm() -> None:
    torch.manual_seed(0)
    source = qwen3(qk_norm=False)
    layer = convert_attention(source, "upipe", NoCommMesh(1))
    x, table = torch.randn(2, 8, 32), precompute_rope_cache(16, 8)
    torch.testing.assert_close(layer(x, table, None), source(x, table, None), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [llama3, qwen3])
@pytest.mark.parametrize(("mode", "u"), [("ulysses", None), ("upipe", None), ("upipe", 4)])
def test_one_rank_mesh_matches_the_module(make, mode: str, u: int | None) -> None:
    torch.manual_seed(0)
    source = make()
    table = precompute_freqs_cis(16, 32) if make is llama3 else precompute_rope_cache(16, 32)
    x = torch.randn(2, 12, source.wq.in_features)
    x_ref, x_cp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ref = source(x_ref, table, None)
    y_ref.sum().backward()
    ref_grads = [p.grad.clone() for p in source.parameters()]
    source.zero_grad()
    layer = convert_attention(source, mode, NoCommMesh(1), heads_per_stage=u)
    y = layer(x_cp, table, None)
    y.sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_cp.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for got, want in zip((p.grad for p in layer.parameters()), ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_biased_projections_rejected_at_conversion() -> None:
    module = llama3()
    module.wo = torch.nn.Linear(module.wo.in_features, module.wo.out_features, bias=True)
    with pytest.raises(ConfigError, match="projections without bias .* wo of this module"):
        convert_attention(module, "upipe", NoCommMesh(2))


def test_upipe_second_backward_raises() -> None:
    """UPipe's backward reuses its saved output buffer for the query projections' gradients, so a
    second backward through the same graph must fail loudly, never compute from overwritten data."""
    layer = convert_attention(llama3(), "upipe", NoCommMesh(1))
    x = torch.randn(1, 8, 128, requires_grad=True)
    y = layer(x, precompute_freqs_cis(16, 8), None)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_document_layout_for_another_ring_is_rejected_before_communication() -> None:
    """A mask laid out (``document_balance = "documents"``) for another ring or Ulysses degree than the
    attention's mesh, or a balanced mask asked for without a mesh, is one ConfigError naming the fix."""
    from titan_upipe.parallel.document_mask import DocumentMask, document_mask

    ids = torch.zeros(1, 16, dtype=torch.long)
    ids[0, 5:] = 1
    layer = convert_attention(llama3(), "usp", usp_mesh(2, 2))
    x, table = torch.zeros(1, 4, 128), precompute_freqs_cis(16, 32)
    for ring, ulysses in ((4, 1), (2, 1)):
        mask = DocumentMask.from_ids(ids).balanced(ring, ulysses, min_split=4)
        with pytest.raises(ConfigError, match=rf"layout is for ring {ring} x ulysses {ulysses} ranks but the "
                                              r"attention runs on ring 2 x ulysses 2: build the mask with the model's"):
            layer(x, table, attention_masks=mask)
    balanced = document_mask(ids, usp_mesh(2, 2), balance="documents", min_split=4)
    for positions in (torch.arange(4),):  # the fixed layouts' [S/C]
        with pytest.raises(ConfigError, match=r"positions have shape .* not its \[1, 4\]: shard the inputs with "
                                              r"titan_upipe.parallel.shard_sequence\(t, cp_mesh, 1, mask.layout\)"):
            layer(x, table, attention_masks=balanced, positions=positions)
    with pytest.raises(ConfigError, match="lays the batch out over a ring: pass the cp_mesh"):
        document_mask(ids, balance="documents")
    with pytest.raises(ConfigError, match="invalid document_balance = 'zig': valid values are zigzag, documents"):
        document_mask(ids, usp_mesh(2, 2), balance="zig")
    assert document_mask(ids, ring_mesh(2), balance="documents", min_split=4).layout.ring_size == 2
    assert document_mask(ids, NoCommMesh(2), balance="documents").layout is None  # no ring: the contiguous layout
