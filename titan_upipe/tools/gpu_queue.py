"""The GPU queue: what ``python -m titan_upipe.gpu_suite --next`` measures next.

Whoever gets a GPU machine makes progress by repeating one command: ``--next`` runs, within
``--budget-s``, the highest-priority measurements that no report shows yet. The reports folders
(``docs/benchmarks/gpu/``, committed, and the call's ``--out``) are the queue's state: an item is
done when a report holds its results; nothing else is remembered.

===  ===================================================  =========================================
#    item                                                 done when a report holds
===  ===================================================  =========================================
1    ``kernels``: contracts (cudnn, flash_attn4, sdpa),   a ``contract`` result (checked, or skipped
     varlen, Liger, offload streams, bf16 parity          with why) for each of those backends
2    ``attention`` at 128K, then 1M (one call each)       every candidate backend reported there
3    ``speed`` 128K / 1M / 2M with the fastest backend    Ulysses and UPipe at the length, run with
                                                          the backend ``auto`` now picks there
4    ``memory`` Llama3-8B UPipe 3M, 4M, 5M (one a call)   that run (measured, or out of memory)
5    ``memory`` Qwen3-32B UPipe C=8 on one node, 2.5M     that run
     (``configs/qwen3_32b/upipe_8gpu_2_5m.toml``, 2
     blocks, every input offloaded; issue 34)
6    ``memory`` Qwen3-32B UPipe-in-USP 1M-4M              that run
7    ``tsp`` Llama3-8B 128K, 1M, 2M                       that run
8    ``attention`` at 2M                                  every candidate backend reported at 2M
9    ``ring_documents`` 128K, then 1M (one call each):    each (R, balance) at the length timed, or
     packed documents on a ring of R = 8 and 16,          out of memory (not a skip for want of a
     ``document_balance`` zigzag and documents            varlen kernel, nor an error)
     (issue 35)
===  ===================================================  =========================================

An item whose estimate does not fit what is left of the call is passed over for the next one
that does (a 5M memory run needs a machine without the 10-minute limit); an item that ran and is
still not done (it failed, or was killed at the deadline) is not retried in the same call.
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


@dataclass(frozen=True)
class QueueItem:
    name: str
    argv: tuple[str, ...]
    """The ``gpu_suite`` arguments of the call that measures it (``--budget-s`` and ``--out`` added)."""
    estimate_s: float
    done: Callable[[list[dict]], bool]


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


def run_done(name: str) -> Callable[[list[dict]], bool]:
    """An emulator run named ``name`` measured or out of memory (a crash is not done)."""
    def done(reports: list[dict]) -> bool:
        return any(r.get("name") == name and (r.get("measurement") or r.get("oom"))
                   for report in reports for r in report["results"])
    return done


def speed_done(length: str, backend: str | None) -> Callable[[list[dict]], bool]:
    """Ulysses and UPipe at ``length`` in a speed report whose calls ran ``backend``."""
    def done(reports: list[dict]) -> bool:
        ran = {r["method"] for env, r in _results(reports, "speed")
               if r.get("length") == length and r.get("measurement") and env.get("attention_backend") == backend}
        return backend is not None and {"ulysses", "upipe"} <= ran
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
                backends: tuple[str, ...]) -> list[QueueItem]:
    """The items in priority order (module docstring). ``estimate(stage, lengths, select)``: the
    suite's time estimate of that call; ``fastest``: the backend ``auto`` picks on this GPU now."""
    def item(name: str, stage: str, lengths: tuple[str, ...] = (), select: str | None = None,
             done: Callable[[list[dict]], bool] | None = None) -> QueueItem:
        argv = ("--stage", stage, *(("--lengths", ",".join(lengths)) if lengths else ()),
                *(("--select", select) if select else ()))
        return QueueItem(name, argv, estimate(stage, lengths, select), done)

    items = [item("kernels", "kernels", done=kernels_done)]
    items += [item(f"attention {x}", "attention", (x,), done=attention_done((x,), backends)) for x in ("128K", "1M")]
    items += [item(f"speed {x} ({fastest})", "speed", (x,), done=speed_done(x, fastest)) for x in ("128K", "1M", "2M")]
    items += [item(f"memory llama3_8b upipe {x}", "memory", (x,), "llama3_8b upipe",
                   run_done(f"llama3_8b upipe {x}")) for x in ("3M", "4M", "5M")]
    items.append(item("memory qwen3_32b upipe_8gpu 2.5M", "memory", ("2.5M",), "qwen3_32b upipe_8gpu",
                      run_done("qwen3_32b upipe_8gpu 2.5M")))
    items += [item(f"memory qwen3_32b upipe_usp {x}", "memory", (x,), "qwen3_32b upipe_usp",
                   run_done(f"qwen3_32b upipe_usp {x}")) for x in ("1M", "2M", "3M", "4M")]
    items += [item(f"tsp llama3_8b {x}", "tsp", (x,), done=run_done(f"llama3_8b tsp {x}")) for x in ("128K", "1M", "2M")]
    items.append(item("attention 2M", "attention", ("2M",), done=attention_done(("2M",), backends)))
    items += [item(f"ring_documents {x}", "ring_documents", (x,), done=ring_documents_done(x)) for x in RING_LENGTHS]
    return items


def pending(items: list[QueueItem], reports: list[dict]) -> list[QueueItem]:
    return [i for i in items if not i.done(reports)]


def next_item(items: list[QueueItem], reports: list[dict], remaining_s: float,
              attempted: set[str]) -> QueueItem | None:
    """The highest-priority pending item not yet attempted in this call that fits ``remaining_s``."""
    for item in pending(items, reports):
        if item.name not in attempted and item.estimate_s <= remaining_s:
            return item
    return None
