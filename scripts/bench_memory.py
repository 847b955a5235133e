"""Peak memory and time of each memory transform against the module it replaces.

Memory: live tensor bytes created during forward + backward (``LiveTensorTracker``; on CUDA
also ``torch.cuda.max_memory_allocated``), inputs and parameters excluded. Time: median of
``--repeats`` forward+backward passes. Writes a markdown table (stdout, and ``--out`` if given).

    python scripts/bench_memory.py                      # CPU, defaults below
    python scripts/bench_memory.py --device cuda --seq 65536 --dim 4096 --vocab 128256
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_upipe.attention.projection import RotaryKind, rotate, rotate_  # noqa: E402
from titan_upipe.toolkit.memory_tracker import LiveTensorTracker, mib  # noqa: E402
from titan_upipe.torchtitan_0_2.model_classes import register_model_classes  # noqa: E402
from titan_upipe.transforms.fused_ce import FusedCrossEntropyHead  # noqa: E402
from titan_upipe.transforms.offload import OFFLOAD_STATS, apply_offloaded_ac  # noqa: E402
from titan_upipe.transforms.rope import inverse_frequencies, table_for_positions  # noqa: E402
from titan_upipe.transforms.tiled_mlp import TiledFeedForward  # noqa: E402
from titan_upipe.transforms.tiled_rmsnorm import TiledRMSNorm  # noqa: E402


def measure(step, device: str, repeats: int) -> tuple[int, float]:
    """(peak bytes, median seconds) of ``step()``, which runs forward and backward."""
    step()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with LiveTensorTracker() as mem:
            step()
        peak = mem.peak_bytes
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return peak, statistics.median(times)


def fwd_bwd(module, *inputs, loss=None):
    def step():
        xs = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        out = module(*xs)
        (loss(out) if loss else out.float().sum()).backward()
        module.zero_grad(set_to_none=True)
    return step


def llama3_model(args, device, dtype):
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    margs = TransformerModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 128 or 1,
                                 n_kv_heads=max(1, args.dim // 512), vocab_size=args.vocab,
                                 multiple_of=256, max_seq_len=args.seq)
    with torch.device(device):
        model = Transformer(margs)
        with torch.no_grad():
            model.init_weights()
    freqs_cis = model.freqs_cis  # complex: keep it out of the dtype cast
    model = model.to(dtype)
    model.freqs_cis = freqs_cis
    return model, margs


def run(args) -> list[tuple[str, str, int, int, float, float]]:
    device, dtype = args.device, getattr(torch, args.dtype)
    torch.manual_seed(0)
    model, margs = llama3_model(args, device, dtype)
    block = model.layers["0"]
    x = torch.randn(1, args.seq, args.dim, device=device, dtype=dtype)
    rows = []

    def add(name, removes, plain_step, new_step):
        p_peak, p_time = measure(plain_step, device, args.repeats)
        n_peak, n_time = measure(new_step, device, args.repeats)
        rows.append((name, removes, p_peak, n_peak, p_time, n_time))

    ff = block.feed_forward
    add("tiled_mlp", f"SwiGLU intermediates (tile {args.dim} tokens)",
        fwd_bwd(ff, x), fwd_bwd(TiledFeedForward(ff, 0), x))
    norm = block.ffn_norm
    add("tiled_rmsnorm", "full-size fp32 temporaries", fwd_bwd(norm, x), fwd_bwd(TiledRMSNorm(norm, 0), x))

    head_dim, heads = margs.dim // margs.n_heads, margs.n_heads
    q = torch.randn(1, args.seq, heads, head_dim, device=device, dtype=torch.bfloat16)  # RoPE matters in bf16
    positions = torch.arange(args.seq, device=device).unsqueeze(0)
    full_table = model.freqs_cis  # [seq, D/2] complex64, TorchTitan's buffer
    inv = inverse_frequencies(RotaryKind.COMPLEX, head_dim, margs.rope_theta, margs.rope_scaling_args).to(device)

    def rope_stock():
        rotate(q, full_table, positions, RotaryKind.COMPLEX)

    def rope_fused():
        table = table_for_positions(inv, RotaryKind.COMPLEX, positions[0])
        rotate_(q.clone(), table, torch.arange(args.seq, device=device).unsqueeze(0), RotaryKind.COMPLEX)

    p_peak, p_time = measure(rope_stock, device, args.repeats)
    n_peak, n_time = measure(rope_fused, device, args.repeats)
    q_bytes = q.numel() * q.element_size()
    rows.append(("fused_rope (bf16 Q of all heads, fwd)", "fp32 copies of Q/K (the clone of Q is counted)",
                 p_peak, n_peak - q_bytes, p_time, n_time))
    table_bytes = full_table.numel() * full_table.element_size()
    rows.append(("fused_rope (model buffer)", f"full-length table ({args.seq} rows) -> D/2 inverse freqs",
                 table_bytes, inv.numel() * 4, 0.0, 0.0))

    labels = torch.randint(0, args.vocab, (1, args.seq), device=device)
    hidden = torch.randn(1, args.seq, args.dim, device=device, dtype=dtype)
    head = model.output
    fused = FusedCrossEntropyHead(copy.deepcopy(head).to("meta"), 0, "torch")
    fused.weight = head.weight

    def ce_stock():
        h = hidden.detach().requires_grad_(True)
        F.cross_entropy(head(h).flatten(0, 1).float(), labels.flatten(), reduction="sum").backward()
        head.zero_grad(set_to_none=True)

    def ce_fused():
        h = hidden.detach().requires_grad_(True)
        fused(h, labels).backward()
        fused.zero_grad(set_to_none=True)

    add("fused_ce", f"[S, V] logits + fp32 copy + log-softmax (V = {args.vocab})", ce_stock, ce_fused)

    tokens = torch.randint(0, args.vocab, (1, args.seq), device=device)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    full_ac = copy.deepcopy(model)
    for name, b in list(full_ac.layers.named_children()):
        full_ac.layers.register_module(name, checkpoint_wrapper(b))
    offloaded = copy.deepcopy(model)
    apply_offloaded_ac(offloaded, pin_memory=device == "cuda")

    def between(m) -> tuple[int, int]:
        """Device bytes alive between forward and backward, and offloaded host bytes."""
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            out = m(tokens)
            torch.cuda.synchronize()
            alive, host = torch.cuda.memory_allocated() - base, OFFLOAD_STATS.host_bytes
            alive -= out.numel() * out.element_size()  # the logits, not an activation
        else:
            with LiveTensorTracker() as mem:
                out = m(tokens)
                alive, host = mem.current_bytes, OFFLOAD_STATS.host_bytes
            alive -= out.numel() * out.element_size()  # the logits, not an activation
            if host:
                alive -= host  # on CPU the host copies are counted by the tracker too
        out.float().sum().backward()
        return alive, host

    (ac_alive, _), (off_alive, off_host) = between(full_ac), between(offloaded)
    rows.append((f"offloaded AC ({args.layers} blocks, between fwd and bwd)",
                 f"block inputs on the compute device (host: {mib(off_host):.1f} MiB)",
                 ac_alive, off_alive, 0.0, 0.0))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    register_model_classes()  # the core converts registered model families only (TorchTitan's Llama3, Qwen3)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = run(args)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    lines = [
        f"Device: {args.device} ({device_name}), torch {torch.__version__}, {datetime.date.today()}, "
        f"dtype {args.dtype}, S = {args.seq}, d = {args.dim}, V = {args.vocab}",
        f"Command: `python {' '.join(sys.argv)}`",
        "",
        "| transform | removes | plain peak (MiB) | transformed peak (MiB) | ratio | plain time (ms) | transformed time (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, removes, p_peak, n_peak, p_time, n_time in rows:
        ratio = n_peak / p_peak if p_peak else float("nan")
        times = (f"{1e3 * p_time:.1f} | {1e3 * n_time:.1f}" if p_time else "- | -")
        lines.append(f"| {name} | {removes} | {mib(p_peak):.2f} | {mib(n_peak):.3f} | {ratio:.3f} | {times} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
