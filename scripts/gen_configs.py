"""Generate every TOML under ``configs/`` from one table of recipes.

    python scripts/gen_configs.py            # (re)write configs/ and titan_upipe/resources/recipes.json
    python scripts/gen_configs.py --check    # exit 1 if a committed file differs (tests run this)

``recipes.json`` holds the same recipes as the TOML files, by name (``llama3_8b_upipe_1m``): TorchTitan
0.3's config functions (``titan_upipe.torchtitan_0_3.config_registry``) read it from the package.

One place holds the settings all runs share (the paper's setup for GPU recipes: FSDP over all
ranks, bf16, batch 1, full activation checkpointing offloaded to host memory, tiled MLP and
RMSNorm, fused RoPE, fused cross-entropy), and each recipe adds what is its own: model, method,
length, GPU count. Edit this file, not the TOMLs.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"

K, M = 1024, 1024 * 1024
LENGTH_NAMES = {128 * K: "128k", 256 * K: "256k", 512 * K: "512k", M: "1m", 2 * M: "2m", 5 * M // 2: "2_5m",
                3 * M: "3m", 4 * M: "4m", 5 * M: "5m", 6 * M: "6m", 7 * M: "7m", 8 * M: "8m"}
"""File-name part of each length (``2_5m``: 2.5M = 2,621,440 tokens; ``length_label`` writes it ``2.5M``)."""


def length_label(seq: int) -> str:
    """The length as the descriptions and ``--seq-len`` write it: 128K, 1M, 2.5M."""
    return LENGTH_NAMES[seq].replace("_", ".").upper()


MEMORY_TRANSFORMS = ["tiled_mlp", "tiled_rmsnorm", "fused_rope", "fused_ce"]

# Method -> (attention converter, Ulysses degree as a function of the CP degree and GPUs per node).
METHODS = {
    "ulysses": "ulysses",
    "upipe": "upipe",
    "ring": "ring",
    "usp": "usp",
    "upipe_usp": "upipe",  # UPipe on a 2-D (ring x ulysses) mesh
    "tsp": "tsp",
}


@dataclass(frozen=True)
class Model:
    spec: str
    flavor: str
    hf_assets: str
    description: str
    n_layers: int = 0
    dim: int = 0


LLAMA3_8B = Model("upipe_llama3", "8B", "./assets/hf/Llama-3.1-8B", "Llama3-8B", n_layers=32, dim=4096)
QWEN3_32B = Model("upipe_qwen3", "32B", "./assets/hf/Qwen3-32B", "Qwen3-32B", n_layers=64, dim=5120)
LLAMA3_DEBUG = Model("upipe_llama3", "debug", "", "llama3 debug")
QWEN3_DEBUG = Model("upipe_qwen3", "debug", "", "qwen3 debug")
LLAMA3_DEBUG_KV4 = Model("upipe_llama3", "debug_kv4", "", "llama3 debug_kv4 (8 / 4 heads)")
LLAMA3_DEBUG_DOCS = Model("upipe_llama3", "debug_flex", "", "llama3 debug_flex (block_causal)")

GPU_DATA = ["./data/train/**/*.jsonl"]
"""Where the GPU recipes read their text (docs/training.md): every JSONL file under data/train."""

GPU_STEPS = 1000
CHECKPOINT_INTERVAL = 50
"""Steps between checkpoints: at 1M-8M tokens a step takes from seconds to minutes, so a
preempted job loses at most an interval's work."""

GPUS_PER_NODE = 8
PINNED_OFFLOAD_LIMIT = 1 << 40
"""Most offloaded bytes per node we pin (1 TiB). The paper's nodes have 1.9 TiB of host RAM and
it pinned every run except Llama3-8B at 5M, whose block inputs are 1.25 TiB per node; pinned
blocks come from CUDA's caching host allocator, which rounds sizes up to a power of two."""


def offloaded_bytes_per_node(recipe: Recipe) -> int:
    """bf16 block inputs that offloaded checkpointing keeps in one node's host memory."""
    tokens_per_node = recipe.seq_len * min(recipe.ranks, GPUS_PER_NODE) // recipe.cp_degree
    return recipe.model.n_layers * tokens_per_node * recipe.model.dim * 2


@dataclass(frozen=True)
class Recipe:
    path: str
    model: Model
    method: str | None  # None: FSDP only
    seq_len: int
    ranks: int
    ulysses_degree: int = 0
    gpu: bool = True
    launch: str = ""
    extra_converters: tuple[str, ...] = ()
    offload: bool = False
    description: str = ""
    steps: int = 0
    overrides: dict[str, dict[str, object]] = field(default_factory=dict)

    @property
    def cp_degree(self) -> int:
        return self.ranks if self.method else 1


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def sections(recipe: Recipe) -> dict[str, dict[str, object]]:
    """The TOML sections of one recipe, in file order."""
    name = Path(recipe.path).relative_to("configs").with_suffix("").as_posix().replace("/", "_")
    converters = ([METHODS[recipe.method]] if recipe.method else []) + list(recipe.extra_converters)
    job = {"dump_folder": f"./outputs/{name}", "description": recipe.description,
           "custom_config_module": "titan_upipe.config"}
    model: dict[str, object] = {"name": recipe.model.spec, "flavor": recipe.model.flavor, "converters": converters}
    if recipe.model.hf_assets:
        model["hf_assets_path"] = recipe.model.hf_assets
    training: dict[str, object] = {
        "dataset": "local_text" if recipe.gpu else "synthetic_copy",
        "local_batch_size": 1 if recipe.gpu else 2,
        "seq_len": recipe.seq_len,
        "steps": recipe.steps or (GPU_STEPS if recipe.gpu else 30),
        "max_norm": 1.0,
        "mixed_precision_param": "bfloat16" if recipe.gpu else "float32",
        "mixed_precision_reduce": "float32",
    }
    parallelism: dict[str, object] = {"data_parallel_shard_degree": -1, "context_parallel_degree": recipe.cp_degree}
    result: dict[str, dict[str, object]] = {
        "job": job,
        "experimental": {"custom_import": "titan_upipe.plugin"},
        "model": model,
        "metrics": {"log_freq": 1, "enable_tensorboard": True, "save_tb_folder": "tb"},
        "optimizer": {"name": "AdamW", "lr": 2e-5 if recipe.gpu else 3e-3, "implementation": "foreach"},
        "lr_scheduler": {"warmup_steps": 20 if recipe.gpu else 5},
        "training": training,
        "parallelism": parallelism,
    }
    if recipe.gpu:
        result["local_data"] = {"paths": GPU_DATA, "text_key": "text"}
        result["checkpoint"] = checkpoint_section()
    if recipe.method:
        # GPU: the fastest installed kernel that honours the backend contract (flash-attn-4 with
        # the [gpu] extra, else torch's fused SDPA kernels); CPU: torch's SDPA kernel, named.
        upipe: dict[str, object] = {"attention_backend": "auto" if recipe.gpu else "sdpa"}
        if recipe.method in ("upipe", "upipe_usp"):
            upipe["heads_per_stage"] = 0
        if recipe.ulysses_degree:
            upipe["ulysses_degree"] = recipe.ulysses_degree
        result["upipe"] = upipe
    if recipe.method == "tsp":
        result["tsp"] = {"kv_heads_per_bucket": 0, "overlap": True, "mlp_recompute": True}
    if any(t in converters for t in ("tiled_mlp", "tiled_rmsnorm", "fused_ce")):
        result["transforms"] = {"mlp_tile_tokens": 0, "rmsnorm_tile_tokens": 0, "ce_chunk_tokens": 0,
                                "ce_backend": "auto"}
    checkpointing: dict[str, object] = {"mode": "full" if recipe.offload else "none"}
    if recipe.offload:
        pin = recipe.gpu and offloaded_bytes_per_node(recipe) <= PINNED_OFFLOAD_LIMIT
        checkpointing.update(cpu_offload=True, pin_memory=pin)
        if recipe.gpu and recipe.method:
            # Blocks keep their attention's output and LSE instead of recomputing it, as many as fit
            # (the planner sizes it at launch for the GPU and host there): every block of Llama3-8B
            # up to 1M on 80 GiB, fewer beyond, none where memory is already full (issue 41).
            checkpointing.update(keep_attention="auto", keep_attention_blocks="auto")
    result["activation_checkpoint"] = checkpointing
    if recipe.gpu:
        # Steps at millions of tokens take minutes; TorchTitan's default 100 s collective
        # timeout would kill a healthy job.
        result["comm"] = {"init_timeout_seconds": 1800, "train_timeout_seconds": 3600}
    result["debug"] = {"seed": 42}
    for section, values in recipe.overrides.items():
        result.setdefault(section, {}).update(values)
    return result


def checkpoint_section() -> dict[str, object]:
    """Resumable training from the pretrained HF weights in ``model.hf_assets_path``: full
    checkpoints every interval and at the end (a model-only final save could not be resumed),
    saved asynchronously, the newest two kept (TorchTitan refuses 1: the newest may still be
    being written when the next save starts)."""
    return {"enable": True, "folder": "checkpoint", "interval": CHECKPOINT_INTERVAL, "async_mode": "async",
            "keep_latest_k": 2, "last_save_model_only": False, "initial_load_in_hf": True}


def render(recipe: Recipe) -> str:
    data = []
    if recipe.gpu:
        data = [f"# Needs: tokenizer + HF weights in {recipe.model.hf_assets} and text in {GPU_DATA[0]} "
                "(docs/training.md); resumes from its last checkpoint when relaunched."]
    lines = [f"# {recipe.description}", f"# {recipe.launch}", *data,
             "# Generated by scripts/gen_configs.py: edit that file, then run it, not this one."]
    for section, values in sections(recipe).items():
        lines.append("")
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
    return "\n".join(lines) + "\n"


def _gpu_launch(ranks: int, path: str) -> str:
    if ranks <= 8:
        return f"Launch: NGPU={ranks} CONFIG={path} scripts/run_train.sh"
    return f"Launch: CONFIG={path} sbatch --nodes={ranks // 8} scripts/slurm/train.sbatch"


def gpu_recipes() -> list[Recipe]:
    recipes = []
    paper = dict(extra_converters=tuple(MEMORY_TRANSFORMS), offload=True)

    def add(model: Model, folder: str, method: str, seq: int, ranks: int, ulysses: int = 0,
            overrides: dict[str, dict[str, object]] | None = None, note: str = "", stem: str = "") -> None:
        path = f"configs/{folder}/{stem or method}_{LENGTH_NAMES[seq]}.toml"
        layout = f"ulysses {ulysses} x ring {ranks // ulysses}" if ulysses else f"CP {ranks}"
        description = (f"{model.description}, {method} ({layout}), {length_label(seq)} tokens on {ranks} GPUs; "
                       "FSDP, bf16, offloaded full AC, tiled MLP/RMSNorm, fused RoPE/CE" + (f"; {note}" if note else ""))
        recipes.append(Recipe(path, model, method, seq, ranks, ulysses_degree=ulysses, launch=_gpu_launch(ranks, path),
                              description=description, overrides=overrides or {}, **paper))

    for method in ("ulysses", "upipe", "ring"):
        for seq in (128 * K, 256 * K, 512 * K, M, 2 * M, 3 * M, 4 * M, 5 * M):
            add(LLAMA3_8B, "llama3_8b", method, seq, 8, ulysses=1 if method == "ring" else 0)
    # Past the paper's 5M on one node (issue 18, planner predictions): 6M fits as it is, 7M with the
    # next block's input fetched after the attention backward (docs/planner.md, "Beyond 5M").
    add(LLAMA3_8B, "llama3_8b", "upipe", 6 * M, 8)
    add(LLAMA3_8B, "llama3_8b", "upipe", 7 * M, 8, overrides={"activation_checkpoint": {"prefetch_after_attention": True}},
        note="inputs prefetched after the attention backward")
    # TSP (issue 19): weights and sequence sharded over the 8 GPUs; tiled_mlp and fused_rope do not
    # compose with it (its MLP is a weight ring; its attention rotates with the full table). Not yet
    # run on a GPU: the suite's memory stage measures how far it fits (docs/tsp.md).
    for seq in (128 * K, M, 2 * M):
        path = f"configs/llama3_8b/tsp_{LENGTH_NAMES[seq]}.toml"
        recipes.append(Recipe(path, LLAMA3_8B, "tsp", seq, 8, launch=_gpu_launch(8, path),
                              description=f"Llama3-8B, tsp (CP 8), {LENGTH_NAMES[seq].upper()} tokens on 8 GPUs; "
                                          "weights sharded over the 8 ranks, bf16, offloaded full AC, tiled RMSNorm, "
                                          "fused CE; not yet measured on a GPU",
                              extra_converters=("tiled_rmsnorm", "fused_ce"), offload=True))
    for method in ("usp", "upipe_usp"):
        for seq in (512 * K, M, 2 * M, 4 * M, 6 * M, 8 * M):
            add(LLAMA3_8B, "llama3_8b", method, seq, 16, ulysses=8)
        for seq in (128 * K, 256 * K, 512 * K, M, 2 * M, 3 * M, 4 * M):
            add(QWEN3_32B, "qwen3_32b", method, seq, 16, ulysses=8)
    # Qwen3-32B past the paper's 4M (issue 18, predictions): 5M as it is; 6M host-bound unless the last
    # block's input stays on the device, and GPU-bound unless the next input is fetched late.
    add(QWEN3_32B, "qwen3_32b", "upipe_usp", 5 * M, 16, ulysses=8)
    add(QWEN3_32B, "qwen3_32b", "upipe_usp", 6 * M, 16, ulysses=8,
        overrides={"activation_checkpoint": {"prefetch_after_attention": True, "resident_blocks": 1}},
        note="inputs prefetched after the attention backward, the last block's input on the device")
    # Qwen3-32B on one 8-GPU node (issue 34, planner predictions; the paper ran it on 16 GPUs):
    # AdamW's moments on the host at every length (as configured the GPU fits only 1,030,776 tokens).
    # 2M and 2.5M save checkpoints synchronously: an async save stages the state shards (366 GiB
    # per node) beside the offloaded inputs, over 1,900 GiB. At 2.5M the last two blocks keep their
    # inputs on the device: 50 GiB more host headroom (20 -> 70 GiB, for what the planner does not
    # count: the processes, the loader), no step time, and no device memory at the peak (block 1's
    # MLP backward, after those inputs are freed). docs/planner.md, "Qwen3-32B on one 8-GPU node".
    # peak: the planner's per GPU; host: per node as `validate` counts it (offloaded inputs, the
    # moments, an async save's staging); tests/test_recipes.py recomputes both.
    for seq, peak, host in ((M, 47.7, 1670), (2 * M, 58.6, 1560), (5 * M // 2, 64.1, 1830)):
        one_node: dict[str, dict[str, object]] = {"optimizer": {"state_on_host": True}}
        if seq > M:
            one_node["checkpoint"] = {"async_mode": "disabled"}
        if seq > 2 * M:
            one_node["activation_checkpoint"] = {"resident_blocks": 2}
        add(QWEN3_32B, "qwen3_32b", "upipe", seq, 8, stem="upipe_8gpu", overrides=one_node,
            note="AdamW moments on the host" + ("; synchronous checkpoints" if seq > M else "")
                 + ("; the last 2 blocks' inputs on the device" if seq > 2 * M else "")
                 + f"; planner prediction, not yet measured on a GPU: peak {peak} GiB per GPU (of 80), "
                   f"host {host:,} GiB per node (of 1,900)")
    return recipes


def debug_recipes() -> list[Recipe]:
    """CPU (gloo) configs: ``make run``, the tests and the parity check use them."""

    def launch(path: str, ranks: int) -> str:
        return f"CPU: torchrun --nproc_per_node {ranks} -m titan_upipe.train --job.config_file {path}"

    def debug(path, model, method, ranks, description, ulysses=0, **kwargs) -> Recipe:
        return Recipe(path, model, method, 512, ranks, ulysses_degree=ulysses, gpu=False,
                      launch=launch(path, ranks), description=description, **kwargs)

    four_rank = [
        debug("configs/debug/ulysses.toml", LLAMA3_DEBUG, "ulysses", 4, "llama3 debug, Ulysses CP=4 (C > KV heads)"),
        debug("configs/debug/upipe.toml", LLAMA3_DEBUG, "upipe", 4, "llama3 debug, UPipe CP=4, U = C = 4"),
        debug("configs/debug/ring.toml", LLAMA3_DEBUG, "ring", 4, "llama3 debug, zigzag ring attention CP=4",
              ulysses=1),
        debug("configs/debug/usp.toml", LLAMA3_DEBUG, "usp", 4, "llama3 debug, USP ulysses 2 x ring 2", ulysses=2),
        debug("configs/debug/upipe_usp.toml", LLAMA3_DEBUG, "upipe_usp", 4,
              "llama3 debug, UPipe inside USP: ulysses 2 x ring 2, U = 2", ulysses=2),
        debug("configs/debug/tsp.toml", LLAMA3_DEBUG_KV4, "tsp", 4,
              "llama3 debug_kv4, TSP over 4 ranks (weights and sequence sharded)"),
    ]
    return four_rank + [
        debug("configs/debug/llama3_fsdp.toml", LLAMA3_DEBUG, None, 2, "llama3 debug, FSDP over 2 ranks"),
        debug("configs/debug/qwen3_fsdp.toml", QWEN3_DEBUG, None, 2, "qwen3 debug (qk-norm), FSDP over 2 ranks"),
        debug("configs/debug/llama3_upipe.toml", LLAMA3_DEBUG, "upipe", 2,
              "llama3 debug, UPipe CP=2 + FSDP (the `make run` default)"),
        debug("configs/debug/llama3_ulysses.toml", LLAMA3_DEBUG, "ulysses", 2, "llama3 debug, Ulysses CP=2 + FSDP"),
        debug("configs/debug/qwen3_upipe.toml", QWEN3_DEBUG, "upipe", 2, "qwen3 debug (qk-norm), UPipe CP=2"),
        debug("configs/debug/llama3_ring.toml", LLAMA3_DEBUG, "ring", 4, "llama3 debug, zigzag ring CP=4", ulysses=1),
        debug("configs/debug/llama3_usp.toml", LLAMA3_DEBUG, "usp", 4, "llama3 debug, USP ulysses 2 x ring 2",
              ulysses=2),
        debug("configs/debug/llama3_upipe_usp.toml", LLAMA3_DEBUG, "upipe_usp", 4,
              "llama3 debug, UPipe inside USP (ulysses 2 x ring 2)", ulysses=2),
        debug("configs/debug/llama3_upipe_transforms.toml", LLAMA3_DEBUG, "upipe", 2,
              "llama3 debug, UPipe CP=2 + all memory transforms + offloaded full AC",
              extra_converters=tuple(MEMORY_TRANSFORMS), offload=True),
        # Packed documents: attn_mask_type = "block_causal" (the flavor's), EOS-separated documents.
        debug("configs/debug/llama3_upipe_docs.toml", LLAMA3_DEBUG_DOCS, "upipe", 2,
              "llama3 debug, UPipe CP=2, packed documents (block_causal) on synthetic_docs",
              overrides={"training": {"dataset": "synthetic_docs"}}),
    ]


def all_recipes() -> list[Recipe]:
    return debug_recipes() + gpu_recipes()


def intended_world_size(recipe: Recipe) -> int:
    return recipe.ranks


RECIPES_JSON = REPO / "titan_upipe" / "resources" / "recipes.json"


def config_name(recipe: Recipe) -> str:
    """A recipe's name as a 0.3 config function: its path under ``configs/``, ``/`` as ``_``."""
    return Path(recipe.path).relative_to("configs").with_suffix("").as_posix().replace("/", "_")


def recipes_json() -> str:
    """Every recipe's sections by config name, the package's copy of ``configs/`` (sorted, stable)."""
    import json

    table = {config_name(r): {"path": r.path, "sections": sections(r)} for r in all_recipes()}
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed files; write nothing")
    args = parser.parse_args(argv)
    stale = []
    for recipe in all_recipes():
        target = REPO / recipe.path
        text = render(recipe)
        if args.check:
            if not target.exists() or target.read_text() != text:
                stale.append(recipe.path)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    table = recipes_json()
    if args.check:
        if not RECIPES_JSON.exists() or RECIPES_JSON.read_text() != table:
            stale.append(str(RECIPES_JSON.relative_to(REPO)))
    else:
        RECIPES_JSON.write_text(table)
    if stale:
        print("out of date (run python scripts/gen_configs.py):\n  " + "\n  ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
