"""What ``validate`` prints for a job that can run (its resolved layout), and the device it judges the job
for: shared by the validate of every adapter (``tools.preflight`` on 0.2, ``tools.spec_preflight``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_upipe.toolkit.cli_args import ToolParser, positive_int, positive_size
from titan_upipe.torchtitan_common import cpu_runtime


@dataclass(frozen=True)
class LayoutSummary:
    model: str
    flavor: str
    world_size: int
    n_heads: int
    n_kv_heads: int
    cp_mode: str | None
    cp_degree: int
    ulysses_degree: int
    ring_degree: int
    heads_per_stage: int | None
    seq_len: int
    converters: tuple[str, ...]
    document_layout: str | None = None
    """Packed documents on a ring: how each batch is laid out (``[upipe] document_balance``)."""
    kept_attention: str | None = None
    """``[activation_checkpoint] keep_attention``: which blocks keep their attention (``keep_attention_text``)."""
    device: str | None = None
    """The device the job was checked for, and why (``target_device``)."""

    def lines(self) -> list[str]:
        rows = [
            f"model            {self.model} / {self.flavor} ({self.n_heads} query heads, {self.n_kv_heads} KV heads)",
            f"world size       {self.world_size} (data parallel shard x CP {self.cp_degree})",
            f"converters       {', '.join(self.converters) or '(none)'}",
        ]
        if self.cp_mode:
            rows.append(f"context parallel {self.cp_mode}: ulysses {self.ulysses_degree} x ring {self.ring_degree}")
            if self.heads_per_stage:
                stages = self.n_heads // self.heads_per_stage
                rows.append(f"UPipe            U = {self.heads_per_stage} query heads per stage, {stages} stages")
        if self.document_layout:
            rows.append(f"packed documents {self.document_layout}")
        if self.kept_attention:
            rows.append(f"kept attention   {self.kept_attention}")
        rows.append(f"tokens per rank  {self.seq_len // max(self.cp_degree, 1)} of {self.seq_len}")
        if self.device:
            rows.append(f"device           {self.device}")
        return rows


DEVICES = ("cpu", "cuda")


def target_device(param_dtype: str, named: str | None) -> tuple[str, str]:
    """(the device type the job trains on, why): ``--device``; ``TITAN_UPIPE_DEVICE`` where it names
    one; this machine's GPU; else the compute nodes' as the planner reads the job (a float32 job is
    a CPU run, a bf16/fp16 one a GPU job)."""
    if named:
        return named, "--device"
    if (setting := cpu_runtime.device_setting()) in DEVICES:
        return setting, f"{cpu_runtime.DEVICE_ENV}={setting}"
    if torch.cuda.is_available():
        return "cuda", "this machine's GPU"
    dtype = param_dtype
    if dtype == "float32":
        return "cpu", "no GPU here, training.mixed_precision_param = float32; --device cuda to check a GPU run"
    return "cuda", f"training.mixed_precision_param = {dtype}: a GPU job; --device cpu to check a CPU run"


def available_host_memory() -> int | None:
    """``MemAvailable`` of this machine (bytes), where ``/proc/meminfo`` exists."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
    except OSError:
        return None
    return int(fields["MemAvailable"].split()[0]) * 1024


def validate_parser(description: str, assets: bool) -> ToolParser:
    """``python -m titan_upipe.validate``'s arguments (``assets``: with ``--no-assets``, where the files are checked)."""
    parser = ToolParser(prog="python -m titan_upipe.validate", description=description)
    parser.add_argument("config", help="the TOML file to check")
    parser.add_argument("--world-size", type=positive_int, default=None,
                        help="ranks the job will run on (default: the product of the configured degrees)")
    parser.add_argument("--host-mem", type=positive_size, default=None,
                        help="host memory of a compute node in GiB (default: this machine's available memory)")
    if assets:
        parser.add_argument("--no-assets", action="store_true",
                            help="check the layout only: skip the tokenizer, data, checkpoint and host-memory checks")
    parser.add_argument("--device", choices=DEVICES, default=None,
                        help="the device the job trains on (default: TITAN_UPIPE_DEVICE, else this machine's GPU, "
                             "else cuda for a bf16/fp16 job and cpu for a float32 one)")
    return parser
