"""Check a training config before launching it: ``python -m titan_upipe.validate X.toml --world-size N``.

Parses the TOML (plus any ``--section.key value`` overrides) exactly as the trainer
does, runs every job-level check that ``titan_upipe.train`` runs before starting process
groups, and prints either the resolved layout (mode, degrees, U, tokens per rank) or every
problem found, each naming the setting and its valid choices (a fix for degrees that do not fit
is shown only after it passed the same checks). The device checked for is the one the job trains
on: ``--device``, else ``TITAN_UPIPE_DEVICE``, else this machine's GPU, else, on a machine without
one (a login node), a GPU for a bf16/fp16 job and the CPU for a float32 one; the launch's memory
guard (``torchtitan_0_2.memory_guard``) judges the job for that device (a GPU of ``PLAN_GPU_GIB`` where this machine
has none; on the CPU, ``--host-mem`` or the free host memory). It also checks the job's files
(``titan_upipe.torchtitan_0_2.job_assets``: tokenizer, dataset, weights, checkpoints) and, for offloaded
activations and async checkpoints, that a node's host memory holds them (the planner's
figure against ``--host-mem`` or this machine's available memory); ``--no-assets`` skips both,
to check a recipe's layout away from its data. Exit code 0 when the job can run, 1 when it
cannot, 2 on usage errors. Needs no GPU and starts no processes.
"""

from __future__ import annotations

import copy
import sys

from titan_upipe.errors import ConfigError
from titan_upipe.plan.machine import PLAN_GPU_GIB, MachineMemory
from titan_upipe.spec.job_spec import JobSpec
from titan_upipe.tools.layout_summary import LayoutSummary, available_host_memory, validate_parser
from titan_upipe.tools.layout_summary import target_device as device_for
from titan_upipe.torchtitan_0_2 import checks, job_assets
from titan_upipe.torchtitan_0_2 import memory_guard as guard
from titan_upipe.torchtitan_0_2.config import (
    ActivationCheckpointOffload,
    plugin_fields,
)
from titan_upipe.torchtitan_0_2.cp_inputs import document_layout_text
from titan_upipe.torchtitan_0_2.flavors import flavor_args
from titan_upipe.torchtitan_0_2.job_plan import (
    async_checkpoint_staging_bytes,
    machine_memory_here,
    plan_from_job_config,
    size_keep_attention_of_job,
)
from titan_upipe.torchtitan_0_2.job_spec import job_spec, writes_async_checkpoints
from titan_upipe.torchtitan_0_2.load_job import parse_job
from titan_upipe.torchtitan_common import cpu_runtime

GIB = 1024**3


def document_layout_summary(spec: JobSpec) -> str | None:
    """How a ring lays packed documents out (None: no ring, or no packed documents)."""
    if spec.layout.ring_degree < 2 or not spec.documents:
        return None
    return document_layout_text(spec)


def keep_attention_text(job_config, world_size: int, host_mem_bytes: int | None) -> str | None:
    """Which blocks keep their attention: the config's plan, or ``auto`` as the launch would size it on
    a GPU of ``PLAN_GPU_GIB`` (this machine's when it has one) and ``host_mem_bytes`` per node."""
    where, _ = checks.keep_attention.keep_setting(job_config)
    if where == "off":
        return None
    n_layers = flavor_args(job_config, update=False).n_layers
    if not checks.keep_attention.needs_planner(job_config):
        return checks.keep_attention.keep_attention_plan(job_config).describe(n_layers)
    here = machine_memory_here(world_size)
    gpu = here.gpu_bytes if here.device == "cuda" else PLAN_GPU_GIB * GIB
    device = "cpu" if job_config.training.mixed_precision_param == "float32" else "cuda"  # as the planner reads it
    machine = MachineMemory(gpu, float(host_mem_bytes or here.host_bytes), min(world_size, 8), device)
    try:
        plan = size_keep_attention_of_job(copy.copy(job_config), world_size, machine)
    except ValueError:  # a setting the planner does not model: the launch says so
        return f"{where}: sized at launch"
    return (f"{where}, sized at launch for the GPU and host there; on {gpu / GIB:.0f} GiB GPUs with "
            f"{machine.host_bytes / GIB:.0f} GiB of host memory per node: {plan.describe(n_layers)}")


def target_device(job_config, named: str | None) -> tuple[str, str]:
    """(the device type the job trains on, why): ``layout_summary.target_device`` of the job's
    parameter dtype."""
    return device_for(job_config.training.mixed_precision_param, named)


def _world_size_from_config(parallelism) -> int | None:
    shard = parallelism.data_parallel_shard_degree
    return None if shard == -1 else shard * checks.degrees_besides_shard(parallelism)


def find_problems(job_config, world_size: int) -> list[str]:
    """Every problem the job-level checks find (not only the first), each once, a layout that does
    not fit with the fixes that pass them all (``checks.job_problems``)."""
    return checks.job_problems(job_config, world_size)


def asset_problems(job_config) -> list[str]:
    """Every problem the asset checks find."""
    problems: list[str] = []
    for check in job_assets.ASSET_CHECKS:
        try:
            check(job_config)
        except ConfigError as err:
            problems.append(str(err))
    return problems


def host_memory_needed(job_config, world_size: int) -> tuple[int, str]:
    """(bytes of host memory one node needs, what they are): the planner's offloaded block inputs
    plus an async checkpoint's staged state."""
    result = plan_from_job_config(job_config, world_size)
    parts = {"offloaded activations": result.host_bytes,
             "async checkpoint staging": async_checkpoint_staging_bytes(job_config, result.job)}
    what = " + ".join(f"{name} {size / GIB:.1f} GiB" for name, size in parts.items() if size)
    return sum(parts.values()), what


def host_memory_fixes(job_config, source: str) -> list[str]:
    """What lowers a node's host memory, leaving out what the config already does (advice it
    follows is never given): pageable offload buffers, more nodes, no async checkpoint staging,
    and, when ``source`` is this machine, the compute nodes' memory."""
    offload = plugin_fields(job_config.activation_checkpoint, ActivationCheckpointOffload)
    fixes = []
    if offload.cpu_offload and offload.pin_memory:
        fixes.append("set activation_checkpoint.pin_memory = false (pageable buffers are not rounded up)")
    fixes.append("use more nodes (fewer tokens and a smaller state shard per rank)")
    if writes_async_checkpoints(job_config):
        fixes.append('set checkpoint.async_mode = "disabled"')
    if source != "--host-mem":
        fixes.append("pass --host-mem GIB when validating away from the compute nodes")
    return fixes


def host_memory_problem(job_config, world_size: int, host_mem_bytes: int | None, source: str) -> str | None:
    offload = plugin_fields(job_config.activation_checkpoint, ActivationCheckpointOffload).cpu_offload
    if host_mem_bytes is None or not (offload or writes_async_checkpoints(job_config)):
        return None
    try:
        needed, what = host_memory_needed(job_config, world_size)
    except ValueError:  # a setting the planner does not model: nothing to compare
        return None
    if needed <= host_mem_bytes:
        return None
    *fixes, last = host_memory_fixes(job_config, source)
    fix = f"{', '.join(fixes)} or {last}" if fixes else last
    return (f"a node needs {needed / GIB:.1f} GiB of host memory ({what}) but {source} has {host_mem_bytes / GIB:.1f} "
            f"GiB: {fix}")


def summarize(job_config, world_size: int, host_mem_bytes: int | None = None, device: str | None = None
              ) -> LayoutSummary:
    """The resolved layout of a job the checks accepted (its ``JobSpec``)."""
    spec = job_spec(job_config, world_size)
    layout = spec.layout
    mode = None if layout.mode is None else layout.mode.value
    return LayoutSummary(
        model=job_config.model.name, flavor=job_config.model.flavor, world_size=world_size,
        n_heads=spec.model.n_heads, n_kv_heads=spec.model.n_kv_heads, cp_mode=mode, cp_degree=layout.cp_degree,
        ulysses_degree=layout.ulysses_degree, ring_degree=layout.ring_degree,
        heads_per_stage=layout.heads_per_stage if mode == "upipe" else None, seq_len=spec.seq_len,
        converters=tuple(job_config.model.converters),
        document_layout=document_layout_summary(spec),
        kept_attention=keep_attention_text(job_config, world_size, host_mem_bytes), device=device,
    )


def main(argv: list[str] | None = None) -> int:
    parser = validate_parser(__doc__.splitlines()[0], assets=True)
    args, overrides = parser.parse_known_args(argv)
    try:
        job_config = parse_job(["--job.config_file", args.config, *overrides])
    except (ConfigError, ValueError, TypeError) as err:
        print(f"{args.config}: cannot be parsed:\n  - {err}")
        return 1
    world_size = args.world_size or _world_size_from_config(job_config.parallelism)
    if world_size is None:
        parser.error("parallelism.data_parallel_shard_degree = -1 (derived from the launch): pass --world-size N")
    device, why = target_device(job_config, args.device)
    cpu_runtime.set_job_device(job_config, device)
    problems = find_problems(job_config, world_size)
    warnings = checks.config_warnings(job_config)
    host_mem, source = ((int(args.host_mem * GIB), "--host-mem") if args.host_mem is not None
                        else (available_host_memory(), "this machine"))
    if not problems and (problem := guard.memory_problem(
            job_config, world_size, guard.target_machine(job_config, world_size, host_mem, device=device))):
        problems.append(problem)  # the launch's memory guard, for the device the job trains on
    if not args.no_assets:
        problems += asset_problems(job_config)
        if not problems and (problem := host_memory_problem(job_config, world_size, host_mem, source)):
            problems.append(problem)
        warnings += job_assets.asset_warnings(job_config)
    for warning in warnings:
        print(f"{args.config}: warning: {warning}")
    if problems:
        print(f"{args.config}: {len(problems)} problem(s) for {world_size} ranks:")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print(f"{args.config}: OK for {world_size} ranks")
    for line in summarize(job_config, world_size, host_mem, f"{device} ({why})").lines():
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
