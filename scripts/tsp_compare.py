"""TSP next to Ulysses and UPipe: communication per training step and weight memory per rank
(docs/tsp.md). Arithmetic from the exact per-layer counts (``titan_upipe.costs.tsp_comm``, checked
byte for byte against the CPU runs in tests/test_tsp.py; ``attention.comm_model`` for the
all-to-alls) and the paper's eqs. 14-16; bf16 weights and activations, fp32 gradient sums, full
activation checkpointing (the forward's communication runs twice), batch 1, D = 8 ranks.

    python scripts/tsp_compare.py        # a second
"""

from __future__ import annotations

from titan_upipe.attention.schedule import build_schedule
from titan_upipe.costs.attention_comm import attention_comm_bytes
from titan_upipe.costs.tsp_comm import layer_comm_bytes, paper_layer_comm_bytes
from titan_upipe.plan import model_dims, parse_length
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


if __name__ == "__main__":
    main()
