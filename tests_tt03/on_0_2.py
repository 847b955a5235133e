"""What the TorchTitan 0.3 pass compares with TorchTitan 0.2.2, computed in one 0.2.2 process (its imports
are most of the time): every recipe's ``JobSpec``, the ``plan --json`` output of some, and a reference
job, a seed checkpoint of ``configs/debug/llama3_fsdp.toml`` and a one-rank run from it. The runs are the
0.2 adapter's launch (``torchtitan_0_2.launch.train_main``) on one rank in that process, under
torchrun's environment, one after the other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from forked_ranks import free_port

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import contextlib, dataclasses, io, json, os, sys
from titan_upipe.torchtitan_0_2.launch import train_main
from titan_upipe.torchtitan_0_2.load_job import spec_of_recipe
from titan_upipe.tools.plan_cli import main as plan
request = json.loads(sys.argv[1])
specs = {p: dataclasses.asdict(spec_of_recipe(["--job.config_file", p])) for p in request["recipes"]}
printed = {}
for p in request["plans"]:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        plan(["--job.config_file", p, "--json"])
    printed[p] = out.getvalue()
for port, args in zip(request["ports"], request["runs"]):
    os.environ["MASTER_PORT"] = str(port)
    sys.argv = ["titan_upipe.train", *args]
    train_main()
with open(request["out"], "w") as f:
    json.dump({"specs": specs, "plans": printed}, f, default=str, sort_keys=True)
"""

REFERENCE_CONFIG = "configs/debug/llama3_fsdp.toml"
REFERENCE_STEPS = "3"
REFERENCE_BATCH = "4"
DOCS_ARGS = ("--model.flavor", "debug_flex", "--training.dataset", "synthetic_docs", "--training.local_batch_size", "2",
             "--validation.enable", "--validation.dataset", "synthetic_docs", "--validation.seq_len", "512",
             "--validation.local_batch_size", "2", "--validation.steps", "1", "--validation.freq", "2")
"""The packed-document reference: 0.2's ``debug_flex`` (block_causal) on ``synthetic_docs``, 2 rows a step,
validated; its attention TorchTitan 0.2.2's own flex mask (``tests/flex_reference.py`` runs it on CPU)."""


def run_on_0_2(recipes: list[str], plans: list[str], folder: Path) -> dict:
    """``{"specs", "plans", "seed", "one_rank", "docs_one_rank"}``: the JobSpecs of ``recipes`` and the ``plan
    --json`` output of ``plans`` on TorchTitan 0.2.2, the reference seed checkpoint's folder and the dump
    folders of the one-rank runs from it (causal; packed documents, ``DOCS_ARGS``)."""
    seed, one_rank, out = folder / "seed02", folder / "one02", folder / "on_0_2.json"
    docs_one_rank = folder / "docs02"
    runs = [["--job.config_file", REFERENCE_CONFIG, "--job.dump_folder", str(seed), "--checkpoint.enable",
             "--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree", "1"],
            ["--job.config_file", REFERENCE_CONFIG, "--job.dump_folder", str(one_rank), "--training.steps",
             REFERENCE_STEPS, "--training.local_batch_size", REFERENCE_BATCH, "--checkpoint.enable",
             "--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0"), "--checkpoint.load_only"],
            ["--job.config_file", REFERENCE_CONFIG, "--job.dump_folder", str(docs_one_rank), "--training.steps",
             REFERENCE_STEPS, *DOCS_ARGS, "--experimental.custom_import", "tests.flex_reference", "--checkpoint.enable",
             "--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0"), "--checkpoint.load_only"]]
    request = {"recipes": recipes, "plans": plans, "runs": runs, "ports": [free_port() for _ in runs], "out": str(out)}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # without .tt03: TorchTitan 0.2.2
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               TITAN_UPIPE_DEVICE="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(request)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {**json.loads(out.read_text()), "seed": seed / "checkpoint" / "step-0", "one_rank": one_rank,
            "docs_one_rank": docs_one_rank}
