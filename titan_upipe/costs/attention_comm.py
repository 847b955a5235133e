"""Communication bytes of one converted attention call, from its head schedule (pure arithmetic).

The all-to-all/point-to-point counterpart of ``memory_model``: what one CP rank sends per
layer and pass, for the rank emulator's modeled communication time
(``wire bytes / bandwidth``). Notation: C the Ulysses degree (``schedule.cp_degree``), R the
ring degree, L = S/CP the tokens of this rank, B the batch, D the head dim, ``es`` the
element size in bytes; every all-to-all buffer is ``[C, L, B, h, D]`` (h heads per
destination rank), and of its send bytes (C-1)/C leave the rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_upipe.spec.head_schedule import HeadSchedule


@dataclass(frozen=True)
class CommBytes:
    """Bytes one rank sends in one converted attention call (one layer), per pass."""

    a2a_forward: int = 0
    """All-to-all send-buffer bytes of the forward (including the chunk the rank keeps)."""
    a2a_backward: int = 0
    p2p_forward: int = 0
    """Ring attention point-to-point bytes (K/V blocks) of the forward."""
    p2p_backward: int = 0
    """Ring backward: K/V blocks again plus the fp32 dK/dV blocks that travel back."""
    ulysses_degree: int = 1

    def a2a_wire(self, a2a_bytes: float) -> float:
        """Of an all-to-all's send bytes, those that leave the rank ((C-1)/C of them)."""
        c = self.ulysses_degree
        return a2a_bytes * (c - 1) / c

    def per_step(self, n_layers: int, recompute_fraction: float, kept_layers: int = 0,
                 upipe: bool = False) -> dict[str, float]:
        """Send bytes of one training step: forward, its recomputation under activation
        checkpointing (``recompute_fraction`` of the layers), backward. ``kept_layers`` of the
        recomputed layers keep their attention (``attention.keep``): their recomputation sends no
        ring bytes (the kernel is not run) and, for UPipe (whose kept recomputation runs no stage),
        no all-to-all bytes either; Ulysses/USP still exchange Q, K, V and the output."""
        recomputed = n_layers * recompute_fraction
        a2a = (n_layers * (self.a2a_forward + self.a2a_backward)
               + (recomputed - (kept_layers if upipe else 0)) * self.a2a_forward)
        p2p = n_layers * (self.p2p_forward + self.p2p_backward) + (recomputed - kept_layers) * self.p2p_forward
        return {"a2a_bytes": a2a, "a2a_wire_bytes": self.a2a_wire(a2a), "p2p_bytes": p2p}


def attention_comm_bytes(schedule: HeadSchedule, mode: str, ring_degree: int, batch: int, local_len: int, head_dim: int,
                         elem_size: int, ulysses_rank: int = 0) -> CommBytes:
    """Bytes exchanged by one converted attention call, from its head schedule.

    ``schedule``: the module's :class:`~titan_upipe.attention.HeadSchedule` (its
    ``cp_degree`` is the Ulysses degree C); ``local_len`` the tokens of this rank (L = S/CP).
    Every all-to-all buffer is ``[C, L, B, h, D]`` (h heads per destination rank).

    * Ulysses (``ulysses``/``usp``; ``ring`` has C = 1 and no all-to-all): Q, K, V and the
      output forward; their gradients backward. K/V carry each destination's KV heads
      (replicated when C > KV).
    * UPipe, per stage: Q and the output forward, plus K and V when the stage starts a new
      KV group; backward: Q (recomputed), output, dOutput, dQ, plus per KV group K and V
      again and dK, dV back.
    * Ring (``ring_degree`` R > 1; zigzag, ``ring.py``): per ring call the packed K/V block
      ``[2, B, h_kv, S/R, D]`` makes R-1 hops forward and R-1 backward, and the fp32 dK/dV
      block R hops. Ulysses/USP make one ring call per layer, UPipe one per stage.
    """
    c = schedule.cp_degree
    b, seq, d, es = batch, local_len, head_dim, elem_size
    a2a_f = a2a_b = 0
    ring_calls: list[int] = []  # K/V heads of each ring call
    if mode == "upipe":
        hq = schedule.query_heads_per_rank
        for stage in schedule.stages:
            q_bytes = c * seq * b * hq * d * es
            a2a_f += 2 * q_bytes
            a2a_b += 4 * q_bytes
            if stage.sends_kv:
                kv_bytes = c * seq * b * len(stage.kv_heads_per_rank[0]) * d * es
                a2a_f += 2 * kv_bytes
                a2a_b += 4 * kv_bytes
            index = stage.local_kv_index(ulysses_rank, schedule.n_rep)
            ring_calls.append(hq if index is not None else len(stage.kv_heads_per_rank[ulysses_rank]))
    else:
        (stage,) = schedule.stages
        if c > 1:
            q_bytes = seq * b * schedule.n_heads * d * es
            kv_bytes = seq * b * sum(len(run) for run in stage.kv_heads_per_rank) * d * es
            a2a_f = a2a_b = 2 * q_bytes + 2 * kv_bytes
        ring_calls.append(len(stage.kv_heads_per_rank[ulysses_rank]))
    p2p_f = p2p_b = 0
    if ring_degree > 1:
        ring_seq = seq * c  # tokens of the ring-local sequence after the Ulysses all-to-all
        for h_kv in ring_calls:
            block = 2 * b * h_kv * ring_seq * d
            p2p_f += (ring_degree - 1) * block * es
            p2p_b += (ring_degree - 1) * block * es + ring_degree * block * 4
    return CommBytes(a2a_f, a2a_b, p2p_f, p2p_b, c)


def recompute_fraction(ac_config) -> float:
    """Fraction of the layers whose forward runs again in backward under the AC config.
    Selective per-op AC is counted as recomputing the attention (its collectives and the
    UPipe/Ulysses autograd functions are not in TorchTitan's save list)."""
    mode = ac_config.mode
    if mode == "none":
        return 0.0
    if mode == "selective":
        option = str(ac_config.selective_ac_option)
        return 1.0 / int(option) if option.isdigit() and int(option) > 0 else 1.0
    return 1.0
