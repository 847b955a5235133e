"""The real TorchTitan trainer through torchrun on gloo: parity with one rank, TensorBoard output."""

import pytest
from trainer_utils import (
    E2E_SEQ,
    E2E_STEPS,
    assert_losses_close,
    counting_layouts,
    create_seed_checkpoint,
    e2e_validation,
    layout_counts,
    load_seed,
    losses,
    read_scalars,
    torchrun,
)

STEPS = E2E_STEPS


def test_fsdp_two_ranks_matches_one_rank(llama3_seed, llama3_one_rank, llama3_two_ranks, tmp_path):
    reference = losses(llama3_one_rank)
    assert len(reference) == int(STEPS)
    assert_losses_close(losses(llama3_two_ranks), reference, rtol=1e-5)
    assert_losses_close(losses(llama3_two_ranks, VALIDATION), losses(llama3_one_rank, VALIDATION), rtol=1e-5)
    check_counters(llama3_two_ranks, local_batch=2, cp=1, data_parallel=2, plain_same_batches=llama3_two_ranks)
    # Two batches of different samples: the worse one's mean is above the global mean.
    assert all(m > a for m, a in zip(losses(llama3_two_ranks, "loss_metrics/global_max_loss"),
                                     losses(llama3_two_ranks), strict=True))
    # The comparison is sensitive: a different global batch gives a different loss.
    assert abs(reference[0] - losses_of_other_batch(llama3_seed, tmp_path)[0]) > 1e-4


def losses_of_other_batch(seed, tmp_path):
    out = tmp_path / "other_batch"
    torchrun(1, "titan_upipe.train", "configs/debug/llama3_fsdp.toml", out, "--training.steps", "1",
             "--training.local_batch_size", "2", *load_seed(seed))
    return losses(out)


def test_tensorboard_has_loss_throughput_and_memory(llama3_one_rank):
    scalars = read_scalars(llama3_one_rank)
    steps = int(STEPS)
    for tag in ("loss_metrics/global_avg_loss", "throughput(tps)", "memory/max_reserved(GiB)",
                "memory/max_active(GiB)", "time_metrics/end_to_end(s)"):
        assert [s for s, _ in scalars[tag]] == list(range(1, steps + 1)), tag
    assert all(0 < v < 20 for _, v in scalars["loss_metrics/global_avg_loss"])
    check_counters(llama3_one_rank, local_batch=4, cp=1, data_parallel=1, plain_same_batches=llama3_one_rank)
    assert all(v > 0 for _, v in scalars["throughput(tps)"])
    # CPU memory comes from the process RSS: a live trainer holds well over 50 MiB, under 24 GiB.
    assert all(0.05 < v < 24 for _, v in scalars["memory/max_reserved(GiB)"])


# --- context parallelism through the real trainer (UPipe core issue) -------------------------

VALIDATION = "validation_metrics/loss"

CP_CASES = [
    # (config, ranks, CP degree, overrides): every case has a global batch of 4 sequences like the 1-rank run
    ("configs/debug/llama3_ring.toml", 2, 2, ("--training.local_batch_size", "4",
                                              "--parallelism.context_parallel_degree", "2")),
    ("configs/debug/llama3_ulysses.toml", 2, 2, ("--training.local_batch_size", "4")),
    # CP = 2 inside, data parallel 2 outside, U = 2C = 4
    ("configs/debug/llama3_upipe.toml", 4, 2, ("--training.local_batch_size", "2", "--upipe.heads_per_stage", "4")),
    # UPipe inside USP: stages of U = 2 heads, each stage's attention a ring over 2, on the 2-D
    # ("ring", "ulysses") mesh plain USP uses too (tokens/labels/positions sharded zigzag over the
    # ring, contiguous over Ulysses); USP's attention itself: test_check's in-process parity check
    ("configs/debug/llama3_upipe_usp.toml", 4, 4, ("--training.local_batch_size", "4")),
    # TSP: weights sharded over the 2 CP ranks (DTensors outside FSDP), zigzag tokens, GQA 8 / 2
    ("configs/debug/tsp.toml", 2, 2, ("--training.local_batch_size", "4", "--parallelism.context_parallel_degree", "2",
                                      "--model.flavor", "debug")),
]


@pytest.mark.parametrize("config, ranks, cp, overrides", CP_CASES,
                         ids=["ring-cp2", "ulysses-cp2", "upipe-cp2-dp2-u4", "upipe-in-usp-u2r2", "tsp-cp2"])
def test_context_parallel_matches_one_rank(llama3_seed, llama3_one_rank, llama3_two_ranks, tmp_path, config, ranks,
                                           cp, overrides):
    """Training and validation losses of every CP layout equal one rank's, and the counters
    count each global batch once (UPipe CP2 itself: conftest.upipe_text_job). Each rank builds
    the job's ``CPLayout`` once, in the job checks; the converters, parallelize, the trainer and
    the validation loss read that one."""
    torchrun(ranks, "titan_upipe.train", config, tmp_path, "--training.steps", STEPS, *overrides,
             *e2e_validation(ranks // cp), *load_seed(llama3_seed), env=counting_layouts(tmp_path / "layouts"))
    assert layout_counts(tmp_path / "layouts") == [1] * ranks
    assert_losses_close(losses(tmp_path), losses(llama3_one_rank), rtol=1e-5)
    assert [s for s, _ in read_scalars(tmp_path)[VALIDATION]] == [1, 2, 4]
    assert_losses_close(losses(tmp_path, VALIDATION), losses(llama3_one_rank, VALIDATION), rtol=1e-5)
    check_counters(tmp_path, local_batch=int(overrides[1]), cp=cp, data_parallel=ranks // cp,
                   plain_same_batches=llama3_one_rank if ranks == cp else llama3_two_ranks)


def check_counters(out, local_batch: int, cp: int, data_parallel: int, plain_same_batches) -> None:
    """Against independent counts: the global batch per step, this rank's 1/C share per device,
    and the max loss of a plain run over the same data-parallel batches."""
    scalars = read_scalars(out)
    steps = range(1, int(STEPS) + 1)
    assert scalars["n_tokens_seen"] == [(s, s * local_batch * data_parallel * E2E_SEQ) for s in steps]
    for (_, tps), (_, seconds) in zip(scalars["throughput(tps)"], scalars["time_metrics/end_to_end(s)"],
                                      strict=True):  # log_freq 1: one step's tokens per device
        assert tps * seconds == pytest.approx(local_batch * E2E_SEQ / cp, rel=1e-4)
    max_loss = "loss_metrics/global_max_loss"
    assert_losses_close(losses(out, max_loss), losses(plain_same_batches, max_loss), rtol=1e-5)
    if data_parallel == 1:  # one batch per step: its mean is the max
        assert_losses_close(losses(out, max_loss), losses(out), rtol=1e-6)


def test_qwen3_upipe_matches_one_rank(tmp_path_factory):
    """Qwen3 UPipe (CP 2) equals one rank; the one-rank run is launched through TorchTitan's own entry
    point (``torchtitan.train``): users who launch it directly get the plugin through the configs'
    ``experimental.custom_import``."""
    seed = create_seed_checkpoint("configs/debug/qwen3_fsdp.toml", tmp_path_factory.mktemp("qwen_seed"))
    one, cp = tmp_path_factory.mktemp("qwen_one"), tmp_path_factory.mktemp("qwen_cp")
    torchrun(1, "torchtitan.train", "configs/debug/qwen3_fsdp.toml", one, "--training.steps", "3",
             "--training.local_batch_size", "2", *load_seed(seed))
    torchrun(2, "titan_upipe.train", "configs/debug/qwen3_upipe.toml", cp, "--training.steps", "3",
             "--training.local_batch_size", "2", *load_seed(seed))
    assert_losses_close(losses(cp), losses(one), rtol=1e-5)


def test_torchtitan_entry_point_with_cp_is_refused(tmp_path):
    """TorchTitan's trainer shards CP inputs head-tail; the converted model must refuse them."""
    with pytest.raises(AssertionError, match="not in titan_upipe.s sequence layout"):
        torchrun(2, "torchtitan.train", "configs/debug/llama3_upipe.toml", tmp_path, "--training.steps", "1")


# --- packed documents (issue 17): attn_mask_type = "block_causal" through the real trainer ----

DOCS = "configs/debug/llama3_upipe_docs.toml"  # debug_flex (block_causal), synthetic_docs, UPipe CP = 2
DOCS_RUN = ("--training.steps", STEPS, "--training.local_batch_size", "2")
"""One global batch of 2 packed rows per step (1-token documents, documents across every shard
boundary, a different split per row: tests/test_data.py)."""


@pytest.fixture(scope="module")
def docs_one_rank(llama3_seed, tmp_path_factory):
    """The reference: 1 rank, no CP, TorchTitan's own block_causal attention (its flex BlockMask
    from the EOS tokens, the mask materialized into SDPA on CPU: tests/flex_reference.py), validated."""
    out = tmp_path_factory.mktemp("docs_one_rank")
    torchrun(1, "titan_upipe.train", "configs/debug/llama3_fsdp.toml", out, *DOCS_RUN, "--model.flavor", "debug_flex",
             "--training.dataset", "synthetic_docs", "--experimental.custom_import", "tests.flex_reference",
             *e2e_validation(dataset="synthetic_docs"), *load_seed(llama3_seed))
    return out


@pytest.mark.parametrize("overrides", [
    (), ("--upipe.ulysses_degree", "1", "--upipe.document_balance", "zigzag"),
    ("--upipe.ulysses_degree", "1", "--upipe.document_min_split", "64")],
    ids=["upipe-cp2", "upipe-in-usp-r2u1-zigzag", "upipe-in-usp-r2u1-documents"])
def test_block_causal_matches_one_rank(llama3_seed, docs_one_rank, tmp_path, overrides):
    """block_causal under UPipe (CP 2) and UPipe inside USP (ring 2 x ulysses 1) on the fixed zigzag
    and on each batch's document-aware layout (documents of 64 tokens or more zigzagged inside
    themselves, the rest dealt whole; [B, S/C] positions; the layout check at every forward):
    training and validation losses equal TorchTitan's own 1 rank."""
    run = torchrun(2, "titan_upipe.train", DOCS, tmp_path, *DOCS_RUN, *overrides,
                   *e2e_validation(dataset="synthetic_docs"), *load_seed(llama3_seed))
    balance = "documents" if "--upipe.document_min_split" in overrides else "zigzag"
    assert ('packed documents: the fixed zigzag' in run.stdout + run.stderr) == (balance == "zigzag" and bool(overrides))
    assert ('packed documents: each batch in its own layout over the ring of 2 (upipe.document_balance = "documents": '
            "documents of 64 tokens" in run.stdout + run.stderr) == (balance == "documents")
    assert len(losses(docs_one_rank)) == int(STEPS)
    assert_losses_close(losses(tmp_path), losses(docs_one_rank), rtol=1e-5)
    assert [s for s, _ in read_scalars(tmp_path)[VALIDATION]] == [1, 2, 4]
    assert_losses_close(losses(tmp_path, VALIDATION), losses(docs_one_rank, VALIDATION), rtol=1e-5)
    # packed documents on a ring: every logged step has the batch's busiest / mean ring work, under the
    # fixed zigzag and under the document layout (their arithmetic: tests/test_document_layout.py)
    ring_work = {tag: values for tag, values in read_scalars(tmp_path).items() if tag.startswith("data/ring_work")}
    if overrides:
        assert len(ring_work) == 2 and all(len(v) == int(STEPS) and all(x >= 1 for _, x in v)
                                            for v in ring_work.values()), ring_work
        zigzag, documents = (ring_work[f"data/ring_work_busiest_over_mean_{name}"] for name in ("zigzag", "documents"))
        print("ring work busiest/mean, zigzag:", zigzag, "documents:", documents)
        if "--upipe.document_min_split" in overrides:  # the layout this job runs balances its batches
            assert all(d < z for (_, d), (_, z) in zip(documents, zigzag, strict=True))
    else:  # UPipe alone has no ring: nothing to balance, no scalar
        assert ring_work == {}
