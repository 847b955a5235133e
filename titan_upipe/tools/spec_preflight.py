"""``python -m titan_upipe.validate X.toml --world-size N`` where the installed TorchTitan's adapter checks a
job through its door (``load_job.checked_job``: TorchTitan 0.3).

It reads the recipe as the launch does, refuses what the launch would refuse before any process
group (the recipe's keys and values, the CP layout, what 0.3 does not host yet), judges the job's
memory with the planner for the device it trains on (``plan.fit``: a GPU of ``PLAN_GPU_GIB`` where
this machine has none; on the CPU, ``--host-mem`` or the free host memory), and prints the
resolved layout, as 0.2's validate (``tools.preflight``) does. It opens the tokenizer and the data
files as the launch does (``--no-assets``: not); the contents of checkpoints and Hugging Face weights
are 0.2's validate's alone so far. Exit code 0 when the job can run, 1 when it cannot, 2 on usage
errors.
"""

from __future__ import annotations

from titan_upipe.adapter import adapter_module
from titan_upipe.plan.fit import prepare_spec
from titan_upipe.plan.machine import PLAN_GPU_GIB, MachineMemory
from titan_upipe.spec.units import GIB
from titan_upipe.tools.layout_summary import (
    LayoutSummary,
    available_host_memory,
    target_device,
    validate_parser,
)


def memory_problem(spec, world_size: int, device: str, host_bytes: float) -> str | None:
    """The launch's verdict (``plan.fit.prepare_spec``: kept attention sized, async staging counted) for
    ``spec`` on ``device`` (``cuda``: a GPU of ``PLAN_GPU_GIB``; ``cpu``: ``host_bytes`` shared by the
    node's ranks), up to 8 ranks a node."""
    ranks = min(world_size, 8)
    machine = (MachineMemory(PLAN_GPU_GIB * GIB, host_bytes, ranks, "cuda") if device == "cuda" else
               MachineMemory(host_bytes / ranks, host_bytes, ranks, "cpu"))
    return prepare_spec(spec, machine)[1]


def summary(job, world_size: int, device_text: str) -> LayoutSummary:
    spec, layout = job.spec, job.spec.layout
    mode = None if layout.mode is None else layout.mode.value
    return LayoutSummary(
        model=job.model_name, flavor=job.flavor, world_size=world_size, n_heads=spec.model.n_heads,
        n_kv_heads=spec.model.n_kv_heads, cp_mode=mode, cp_degree=layout.cp_degree,
        ulysses_degree=layout.ulysses_degree, ring_degree=layout.ring_degree,
        heads_per_stage=layout.heads_per_stage if mode == "upipe" else None, seq_len=spec.seq_len,
        converters=job.converters, device=device_text)


def main(argv: list[str] | None = None) -> int:
    parser = validate_parser(__doc__.splitlines()[0], assets=True)
    args, overrides = parser.parse_known_args(argv)
    argv = ["--job.config_file", args.config, *overrides]
    door = adapter_module("load_job")
    try:
        job = door.checked_job(argv, args.world_size, files=not args.no_assets)
    except ValueError as err:  # ConfigError included
        print(f"{args.config}: 1 problem(s):\n  - {err}")
        return 1
    world_size = job.spec.world_size
    device, why = target_device(job.spec.param_dtype, args.device)
    host = args.host_mem * GIB if args.host_mem is not None else float(available_host_memory() or 0)
    try:
        problem = memory_problem(job.spec, world_size, device, host)
    except ValueError as err:  # an auto keep plan the planner cannot size
        problem = str(err)
    if problem:
        print(f"{args.config}: 1 problem(s) for {world_size} ranks:\n  - {problem}")
        return 1
    print(f"{args.config}: OK for {world_size} ranks")
    for line in summary(job, world_size, f"{device} ({why})").lines():
        print(f"  {line}")
    return 0
