"""TSP next to Ulysses and UPipe: communication per training step and weight memory per rank
(docs/tsp.md). Arithmetic from the exact per-layer counts (``titan_upipe.costs.tsp_comm``, checked
byte for byte against the CPU runs in tests/test_tsp.py; ``attention.comm_model`` for the
all-to-alls) and the paper's eqs. 14-16; bf16 weights and activations, fp32 gradient sums, full
activation checkpointing (the forward's communication runs twice), batch 1, D = 8 ranks.

    python scripts/tsp_compare.py            # a second
    python scripts/tsp_compare.py --memory   # the planner's per-rank memory table (docs/tsp.md)
"""

from __future__ import annotations

import sys
from dataclasses import replace

from titan_upipe.costs.attention_comm import attention_comm_bytes
from titan_upipe.costs.tsp_comm import layer_comm_bytes, paper_layer_comm_bytes
from titan_upipe.plan import GIB, PlanInput, Term, as_tsp, model_dims, parse_length, plan
from titan_upipe.spec.head_schedule import build_schedule
from titan_upipe.tsp import TSPShards

D, BETA = 8, 2
LENGTHS = ("128K", "256K", "512K", "1M")
GB = 1e9


def fsdp_block_bytes(block_params: int) -> float:
    """Bytes one rank receives per block and step under FSDP over D ranks: the bf16 all-gather in
    forward and again in backward (TorchTitan reshards after forward), the fp32 reduce-scatter."""
    return (D - 1) / D * block_params * (2 * BETA + 4)


def main() -> None:
    for name in ("llama3_8b", "qwen3_32b"):
        m = model_dims(name)
        shards = TSPShards(m.n_heads, m.n_kv_heads, m.head_dim, m.ffn_dim, D)
        print(f"\n{name}: L = {m.n_layers}, per-rank GB received per step")
        print("| length | TSP (this code) | TSP (paper eq. 16, no DP) | Ulysses + FSDP | UPipe U = 8 + FSDP | "
              "TSP / Ulysses |")
        print("|---|---|---|---|---|---|")
        for length in LENGTHS:
            s = parse_length(length)
            layer = layer_comm_bytes(shards, m.dim, 1, s, BETA)
            forward = sum(v for (phase, _), v in layer.items() if phase == "forward")
            backward = sum(v for (phase, _), v in layer.items() if phase == "backward")
            tsp = m.n_layers * (2 * forward + backward)
            paper = paper_layer_comm_bytes(shards, m.dim, 1, s, BETA, recompute=True)
            tsp_paper = m.n_layers * sum(paper.values())
            others = {}
            for mode, u in (("ulysses", m.n_heads), ("upipe", D)):
                comm = attention_comm_bytes(build_schedule(m.n_heads, m.n_kv_heads, D, u), mode, 1, 1, s // D,
                                            m.head_dim, BETA)
                a2a = comm.per_step(m.n_layers, 1.0)["a2a_wire_bytes"]
                others[mode] = a2a + m.n_layers * fsdp_block_bytes(m.block_params)
            print(f"| {length} | {tsp / GB:.1f} | {tsp_paper / GB:.1f} | {others['ulysses'] / GB:.1f} | "
                  f"{others['upipe'] / GB:.1f} | {tsp / others['ulysses']:.2f} |")
        attention_shard = sum(shards.attention_rows) * m.dim * BETA
        mlp_shard = sum(shards.mlp_rows) * m.dim * BETA
        block = (attention_shard + mlp_shard) * D
        print(f"block weights in the compute dtype per rank: TSP keeps the D shards a block received for its "
              f"backward ({block / 2**20:.0f} MiB) plus the next one in flight (attention {attention_shard / 2**20:.0f}"
              f" / MLP {mlp_shard / 2**20:.0f} MiB); FSDP the unsharded block and the next block's all-gather "
              f"(2 x {m.block_params * BETA / 2**20:.0f} MiB)")


MEMORY_LENGTHS = ("128K", "512K", "1M")


def memory_jobs(name: str, length: str) -> dict[str, PlanInput]:
    """The compared jobs on D = 8 GPUs: the GPU recipes' settings (bf16 FSDP, full AC, tiled
    RMSNorm, fused CE; Ulysses and UPipe also tiled MLP and fused RoPE, which TSP refuses), each
    with and without the block inputs offloaded to host memory."""
    base = PlanInput(model_dims(name), seq_len=parse_length(length), cp=D, ulysses=D)
    jobs = {}
    for offload in (True, False):
        tag = "offloaded AC" if offload else "full AC"
        jobs[f"Ulysses, {tag}"] = replace(base, mode="ulysses", cpu_offload=offload)
        jobs[f"UPipe U = 8, {tag}"] = replace(base, mode="upipe", cpu_offload=offload)
        jobs[f"TSP, {tag}"] = replace(as_tsp(base), cpu_offload=offload)
    return jobs


WEIGHTS_IN_FLIGHT = {Term.FSDP_BLOCK, Term.FSDP_GATHER_THIS, Term.FSDP_GATHER_NEXT, Term.FSDP_OUTPUT_GROUP,
                     Term.FSDP_EMBEDDING_GATHER, Term.FSDP_EMBEDDING, Term.TSP_ATTENTION_SHARDS, Term.TSP_PACKED_FP32,
                     Term.TSP_MLP_SHARDS}
"""Block weights in flight: FSDP's unsharded groups and their all-gather buffers; TSP's received shards
and its packed fp32 shard (not the fp32 reduce-scatter buffers: gradients)."""


def _in_flight(result) -> int:
    """Per-rank bytes of ``WEIGHTS_IN_FLIGHT`` at the peak (labels may carry a block prefix)."""
    labels = {term.label for term in WEIGHTS_IN_FLIGHT}
    return sum(v for k, v in result.peak.terms.items() if k.split(": ", 1)[-1] in labels or k in labels)


def memory_table() -> None:
    """Per-rank GiB at the predicted peak: the state (fp32 parameter, gradient and AdamW shards), the
    block weights in flight, the activations (the rest), the peak and where it is."""
    for name in ("llama3_8b", "qwen3_32b"):
        print(f"\n{name}, D = 8, per rank GiB at the planner's peak")
        print("| length | job | state | weights in flight | activations | peak | peak moment |")
        print("|---|---|---|---|---|---|---|")
        for length in MEMORY_LENGTHS:
            for label, job in memory_jobs(name, length).items():
                r = plan(job)
                state = sum(v for k, v in r.peak.terms.items() if k.startswith(("parameters", "AdamW", "gradients")))
                weights = _in_flight(r)
                rest = r.peak_gpu_bytes - state - weights
                print(f"| {length} | {label} | {state / GIB:.2f} | {weights / GIB:.2f} | {rest / GIB:.2f} | "
                      f"{r.peak_gpu_bytes / GIB:.2f} | {r.peak.where} |")


if __name__ == "__main__":
    memory_table() if "--memory" in sys.argv[1:] else main()
