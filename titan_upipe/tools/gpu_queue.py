"""The GPU queue: what ``python -m titan_upipe.gpu_suite --next`` measures next.

Whoever gets a GPU machine makes progress by repeating one command: ``--next`` runs, within
``--budget-s``, the highest-priority measurements that no report shows yet. The reports folders
(``docs/benchmarks/gpu/``, committed, and the call's ``--out``) are the queue's state: an item is
done when a report holds its results; nothing else is remembered.

===  ===================================================  =========================================
#    item                                                 done when a report holds
===  ===================================================  =========================================
1    ``speed`` 1M, warm, with the fastest backend:        Ulysses and UPipe at the length, run with
     Ulysses and UPipe with full activation               the backend ``auto`` now picks there,
     checkpointing; the ``kernels`` stage's               each result warm (``warm_step``: the
     ``kept_attention`` check (its CUDA streams, 20 s);   emulator's ``warm`` and at least 2 timed
     then both with ``keep_attention = "auto"``           steps), with the keep override or
     (``--select keep_attention``; one call each)         without; the check: its result
2    ``attention`` at 1M                                  every candidate backend reported there
3    ``memory`` Llama3-8B UPipe 3M, then 4M (one a call)  that run (measured, or out of memory)
4    ``speed`` 128K, warm (one call), then 2M Ulysses,    as item 1, full activation checkpointing
     then 2M UPipe (one call each: together they take
     longer than a 10-minute call)
5    ``kernels``: contracts (cudnn, flash_attn4, sdpa),   a ``contract`` result (checked, or skipped
     varlen, Liger, offload streams, bf16 parity;         with why) for each of those backends;
     ``attention`` at 128K (both done by the H200         every candidate backend reported there
     reports of 2026-11-27)
6    ``memory`` Llama3-8B UPipe 5M; Qwen3-32B UPipe C=8   that run
     on one node, 2.5M (``upipe_8gpu_2_5m.toml``, 2
     blocks, every input offloaded; issue 34);
     Qwen3-32B UPipe-in-USP 1M-4M
7    ``tsp`` Llama3-8B 128K, 1M, 2M                       that run, warm (its step time)
8    ``attention`` at 2M                                  every candidate backend reported at 2M
9    ``ring_documents`` 128K, then 1M (one call each):    each (R, balance) at the length timed, or
     packed documents on a ring of R = 8 and 16,          out of memory (not a skip for want of a
     ``document_balance`` zigzag and documents            varlen kernel, nor an error)
     (issue 35)
===  ===================================================  =========================================

Speed is measured warm (issue 41): a step's time after the first, whose kernel compilation and
first-use allocations it leaves out; a cold single-step speed report (the H200's first run, of
November 27, 2026, kept in ``docs/benchmarks/gpu/superseded/``) leaves its item pending. Items 1-4
come first (issue 41): UPipe against Ulysses in steady state, with and without the attention
kept, the kernel ranking at 1M, UPipe's memory at 3M and 4M; the kernels and the 128K kernel
ranking have their reports and stay in the queue, done.

An item whose estimate does not fit what is left of the call is passed over for the next one
that does (a 6M memory run needs a machine without the 10-minute limit); an attention item needs
only its first case to fit, since the stage keeps what an earlier call timed (the 2M kernel
ranking takes more than one call). An item that ran and is still not done (it failed, or was
killed at the deadline) is not retried in the same call.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from titan_upipe.tools.gpu_attention import DENSE_LENGTHS, case_key, plan_cases
from titan_upipe.tools.gpu_ring_documents import BALANCES, RING_LENGTHS, RINGS


def case_key_of(case) -> tuple:
    return case.backend, case.shape.name, case.length, case.kind


KERNEL_BACKENDS = ("cudnn", "flash_attn4", "sdpa")
"""Backends whose contract the kernels item needs a verdict on."""
KEEP_ATTENTION = ("--activation_checkpoint.keep_attention", "auto")
FULL_RECOMPUTE = ("--activation_checkpoint.keep_attention", "off")
"""Every other emulator run's override: the recipes keep attention where it fits (``auto``), the
suite's memory, TSP and plain speed runs measure full recomputation (the paper's setting, the
longest-context one)."""
"""The override of the speed stage's keep_attention runs (their attention outputs kept, not
recomputed in backward, where the memory allows)."""
KEEP_ATTENTION_WORD = "keep_attention"
"""The word that names those runs and, in ``--select``, selects them (``gpu_suite.selected``)."""
MIN_TIMED_STEPS = 2
"""Timed steps after the warm-up that make a speed measurement (the speed stage runs 3, 1 untimed)."""


@dataclass(frozen=True)
class QueueItem:
    name: str
    argv: tuple[str, ...]
    """The ``gpu_suite`` arguments of the call that measures it (``--budget-s`` and ``--out`` added)."""
    estimate_s: float
    done: Callable[[list[dict]], bool]
    start_s: float | None = None
    """What the call needs to make progress, where less than ``estimate_s``: the attention stage's
    first case (it keeps what an earlier call timed and times the rest while they fit)."""

    @property
    def needs_s(self) -> float:
        return self.estimate_s if self.start_s is None else self.start_s


def load_reports(folders: list[Path]) -> list[dict]:
    """Every stage report (``<stage>*.json``) in ``folders``."""
    reports = []
    for folder in folders:
        for path in sorted(Path(folder).glob("*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(data, dict) and "stage" in data and "results" in data:
                reports.append(data)
    return reports


def _results(reports: list[dict], stage: str) -> list[tuple[dict, dict]]:
    """(report environment, result) of every result of ``stage``."""
    return [(r["environment"], result) for r in reports if r["stage"] == stage for result in r["results"]]


def kernels_done(reports: list[dict]) -> bool:
    seen = {result.get("case", "").split()[0] for _, result in _results(reports, "kernels")
            if result.get("check") == "contract" and result.get("case")}
    return set(KERNEL_BACKENDS) <= seen


def check_done(check: str) -> Callable[[list[dict]], bool]:
    """A kernels report with a result of ``check`` (passed or failed: the report says which)."""
    def done(reports: list[dict]) -> bool:
        return any(result.get("check") == check for _, result in _results(reports, "kernels"))
    return done


def attention_done(lengths: tuple[str, ...], backends: tuple[str, ...]) -> Callable[[list[dict]], bool]:
    """Every backend either reported unusable or failing its contract, or with a result (timed,
    out of memory, or an error) for every case the stage plans for it at ``lengths``."""
    planned = {b: {case_key_of(c) for c in plan_cases("cuda", [b], {x: DENSE_LENGTHS[x] for x in lengths})}
               for b in backends}

    def done(reports: list[dict]) -> bool:
        results = [r for _, r in _results(reports, "attention")]
        unusable = {r["backend"] for r in results if r.get("skipped") or (not r.get("ok", True) and "shape" not in r)}
        measured = {case_key(r) for r in results if "shape" in r}
        return all(b in unusable or planned[b] <= measured for b in backends)
    return done


def run_done(name: str, warm: bool = False) -> Callable[[list[dict]], bool]:
    """An emulator run named ``name`` measured (with ``warm``, warm: ``warm_step``) or out of memory
    (a crash is not done)."""
    def done(reports: list[dict]) -> bool:
        return any(r.get("name") == name and ((warm_step(r.get("measurement")) if warm else r.get("measurement"))
                                              or r.get("oom"))
                   for report in reports for r in report["results"])
    return done


def warm_step(measurement: dict | None) -> bool:
    """A speed measurement of steps after a warm-up: the emulator says ``warm`` and timed at least
    ``MIN_TIMED_STEPS`` steps (``step_times_s``). A cold single step (first-use kernel compilation
    and allocations inside it) is not."""
    return bool(measurement and measurement.get("warm")
                and len(measurement.get("step_times_s") or ()) >= MIN_TIMED_STEPS)


def kept_attention(result: dict) -> bool:
    """Whether a run ran with ``KEEP_ATTENTION`` (its command holds the override; a run whose
    command sets keep_attention to nothing, or to off, recomputed its attention)."""
    argv = list(result.get("argv") or ())
    flag = KEEP_ATTENTION[0]
    return flag in argv and argv.index(flag) + 1 < len(argv) and argv[argv.index(flag) + 1] == KEEP_ATTENTION[1]


def speed_done(length: str, backend: str | None, keep: bool = False,
               methods: tuple[str, ...] = ("ulysses", "upipe")) -> Callable[[list[dict]], bool]:
    """``methods`` at ``length``, each warm (``warm_step``), in speed reports whose calls ran
    ``backend``, with ``KEEP_ATTENTION`` where ``keep`` and without it otherwise."""
    def done(reports: list[dict]) -> bool:
        ran = {r["method"] for env, r in _results(reports, "speed")
               if r.get("length") == length and warm_step(r.get("measurement")) and kept_attention(r) == keep
               and env.get("attention_backend") == backend}
        return backend is not None and set(methods) <= ran
    return done


def ring_documents_done(length: str) -> Callable[[list[dict]], bool]:
    """Every ring size and balance of the ring_documents stage at ``length`` timed (its per-rank
    milliseconds reported and its pair self-check passed) or out of memory. A skip (no varlen kernel
    on that machine), a failed self-check or an error leaves it pending for a later call."""
    wanted = {(ring, balance) for ring in RINGS for balance in BALANCES}

    def done(reports: list[dict]) -> bool:
        got = {(r.get("ring"), r.get("balance")) for _, r in _results(reports, "ring_documents")
               if r.get("length") == length and ((r.get("ok") and "rank_ms" in r) or r.get("oom"))}
        return wanted <= got
    return done


def build_queue(estimate: Callable[[str, tuple[str, ...], str | None], float], fastest: str | None,
                backends: tuple[str, ...],
                start: Callable[[str, tuple[str, ...]], float | None] | None = None) -> list[QueueItem]:
    """The items in priority order (module docstring). ``estimate(stage, lengths, select)``: the
    suite's time estimate of that call; ``fastest``: the backend ``auto`` picks on this GPU now;
    ``start(stage, lengths)``: what a call that resumes needs to make progress (None: all of it)."""
    def item(name: str, stage: str, lengths: tuple[str, ...] = (), select: str | None = None,
             done: Callable[[list[dict]], bool] | None = None) -> QueueItem:
        argv = ("--stage", stage, *(("--lengths", ",".join(lengths)) if lengths else ()),
                *(("--select", select) if select else ()))
        return QueueItem(name, argv, estimate(stage, lengths, select), done, start(stage, lengths) if start else None)

    def speed(length: str, method: str | None = None) -> QueueItem:
        if method is None:  # both methods in one call: the report holds their ratio
            return item(f"speed {length} ({fastest})", "speed", (length,), done=speed_done(length, fastest))
        return item(f"speed {length} {method} ({fastest})", "speed", (length,), f"llama3_8b {method}",
                    speed_done(length, fastest, methods=(method,)))

    def memory(name: str, length: str, select: str) -> QueueItem:
        return item(f"memory {name} {length}", "memory", (length,), select, run_done(f"{name} {length}"))

    items = [speed("1M"),
             # kept attention's CUDA streams checked (20 s) before its speed is measured
             item("kernels kept_attention", "kernels", select="kept_attention", done=check_done("kept_attention")),
             item(f"speed 1M {KEEP_ATTENTION_WORD} ({fastest})", "speed", ("1M",), KEEP_ATTENTION_WORD,
                  speed_done("1M", fastest, keep=True))]
    items.append(item("attention 1M", "attention", ("1M",), done=attention_done(("1M",), backends)))
    items += [memory("llama3_8b upipe", x, "llama3_8b upipe") for x in ("3M", "4M")]
    # 2M: one method a call, their warm runs together being longer than a 10-minute call
    items += [speed("128K"), speed("2M", "ulysses"), speed("2M", "upipe")]
    items.append(item("kernels", "kernels", done=kernels_done))
    items.append(item("attention 128K", "attention", ("128K",), done=attention_done(("128K",), backends)))
    items.append(memory("llama3_8b upipe", "5M", "llama3_8b upipe"))
    items.append(memory("qwen3_32b upipe_8gpu", "2.5M", "qwen3_32b upipe_8gpu"))
    items += [memory("qwen3_32b upipe_usp", x, "qwen3_32b upipe_usp") for x in ("1M", "2M", "3M", "4M")]
    items += [item(f"tsp llama3_8b {x}", "tsp", (x,), done=run_done(f"llama3_8b tsp {x}", warm=True))
              for x in ("128K", "1M", "2M")]
    items.append(item("attention 2M", "attention", ("2M",), done=attention_done(("2M",), backends)))
    items += [item(f"ring_documents {x}", "ring_documents", (x,), done=ring_documents_done(x)) for x in RING_LENGTHS]
    return items


def pending(items: list[QueueItem], reports: list[dict]) -> list[QueueItem]:
    return [i for i in items if not i.done(reports)]


def next_item(items: list[QueueItem], reports: list[dict], remaining_s: float,
              attempted: set[str]) -> QueueItem | None:
    """The highest-priority pending item not yet attempted in this call whose progress fits
    ``remaining_s`` (``QueueItem.needs_s``)."""
    for item in pending(items, reports):
        if item.name not in attempted and item.needs_s <= remaining_s:
            return item
    return None
