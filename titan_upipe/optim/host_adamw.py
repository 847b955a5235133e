"""AdamW whose moments live in host memory: ``[optimizer] state_on_host = true``.

Per parameter shard ``p`` (``n`` fp32 elements on this rank, a DTensor's local shard under FSDP2)
AdamW keeps ``exp_avg`` and ``exp_avg_sq``, ``8 n`` bytes. ``HostStateAdamW`` keeps them in host
memory (pinned when the parameter is on CUDA) and runs the step one parameter at a time:

    m_dev[:n] <- m_host;  v_dev[:n] <- v_host          (host -> device)
    torch.optim.adam.adam([p], [g], [m_dev], [v_dev], ...)   (torch's own AdamW update)
    m_host <- m_dev[:n];  v_host <- v_dev[:n]          (device -> host)

so the device holds, besides parameters and gradients, two work buffers of ``max_p n`` elements
each (``2 x 4 max_p n`` bytes: Llama3-8B over 8 ranks, the embedding shard, 0.49 GiB) instead of
``8 sum_p n`` bytes (7.48 GiB). The update is torch's AdamW function with the group's settings on
the same tensors' values, elementwise, so parameters and state equal ``torch.optim.AdamW``'s with
the same ``foreach``/``fused`` setting bit for bit (``tests/test_host_adamw.py``; the moments and
work buffers have AdamW's strides for the parameter, which the fused kernel's memory-order walk
needs for a transposed or channels-last parameter). Copies run on
the current stream, in order, and the step ends with a synchronize: the host state is complete
when ``step`` returns (a checkpoint reads it). At 16 bytes moved per element, an 8B model's
1.0 G elements per rank move in about 0.7 s over a 25 GB/s link, against steps of minutes at
millions of tokens.

The class is a ``torch.optim.AdamW``: its ``state_dict`` (and DCP's ``get_optimizer_state_dict``)
has AdamW's keys and values, so checkpoints load into either class; ``load_state_dict`` copies the
moments straight into host memory (torch's would copy them to each parameter's device first, all at
once).
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

__all__ = ["HostStateAdamW", "host_state_bytes", "work_buffer_bytes"]

MOMENTS = ("exp_avg", "exp_avg_sq")
AMSGRAD_MOMENTS = (*MOMENTS, "max_exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _state_strides(local: torch.Tensor) -> tuple[int, ...]:
    """The strides ``torch.optim.AdamW`` gives a parameter's moments: ``zeros_like(p,
    memory_format=torch.preserve_format)`` keeps a dense parameter's (transposed, channels-last),
    and is contiguous for any other. Host state and work buffers both take them: the fused kernel
    walks the parameter, gradient and moments in memory order, so their strides must agree."""
    return torch.empty_like(local, device="meta", memory_format=torch.preserve_format).stride()


def _host_like(p: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
    """A host tensor shaped like ``p`` with AdamW's moment strides (its local shard, wrapped as a
    DTensor with ``p``'s mesh and placements when ``p`` is one), pinned when ``p`` is on CUDA;
    zeros, or a copy of ``value``."""
    local = _local(p)
    host = torch.empty_strided(local.size(), _state_strides(local), dtype=local.dtype, device="cpu",
                               pin_memory=local.device.type == "cuda")
    if value is None:
        host.zero_()
    else:
        host.copy_(_local(value))
    if isinstance(p, DTensor):
        return DTensor.from_local(host, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return host


class HostStateAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with ``exp_avg``/``exp_avg_sq`` (and ``max_exp_avg_sq``) in host
    memory, streamed through two device work buffers per step (module docstring)."""

    def __init__(self, params, *args, **kwargs) -> None:
        super().__init__(params, *args, **kwargs)
        for group in self.param_groups:
            if group["capturable"] or group["differentiable"]:
                raise ValueError("HostStateAdamW: capturable and differentiable are not supported "
                                 "(the moments are copied between host and device every step)")
        self.peak_work_buffer_bytes = 0
        """Bytes of the device work buffers of the last step (the transient the planner adds)."""

    def _moment_keys(self, group: dict) -> tuple[str, ...]:
        return AMSGRAD_MOMENTS if group["amsgrad"] else MOMENTS

    def _init_state(self, group: dict, p: torch.Tensor) -> dict:
        state = self.state[p]
        if len(state) == 0:
            # step: where torch.optim.AdamW puts it (device for fused, else a host scalar)
            fused = bool(group["fused"])
            state["step"] = (torch.zeros((), dtype=torch.float32, device=_local(p).device) if fused
                             else torch.tensor(0.0, dtype=torch.float32))
            for key in self._moment_keys(group):
                state[key] = _host_like(p)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.AdamW``'s load, each moment copied straight into host memory. Torch's own load
        first copies every state tensor to its parameter's device (all the moments on the device at once,
        ``8 n`` bytes per parameter shard: the memory this class keeps off the device), so the moments are
        set aside from ``state_dict`` and only the rest (``step``) goes through torch's load."""
        # (not strict: torch's load below refuses groups that do not match, in its own words)
        params = dict(zip(itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"]),
                          itertools.chain.from_iterable(g["params"] for g in self.param_groups), strict=False))
        states = {key: dict(value) if key in params else value for key, value in state_dict["state"].items()}
        moments = {key: {name: states[key].pop(name) for name in AMSGRAD_MOMENTS if name in states[key]}
                   for key in states if key in params}
        super().load_state_dict({**state_dict, "state": states})
        for key, values in moments.items():
            for name, value in values.items():
                self.state[params[key]][name] = _host_like(params[key], value)

    def _work_buffers(self, params: list[torch.Tensor], count: int) -> dict[tuple, list[torch.Tensor]]:
        """``count`` flat buffers per (device, dtype), each as long as the largest local shard."""
        sizes: dict[tuple, int] = {}
        for p in params:
            local = _local(p)
            key = (local.device, local.dtype)
            sizes[key] = max(sizes.get(key, 0), local.numel())
        buffers = {key: [torch.empty(n, dtype=key[1], device=key[0]) for _ in range(count)]
                   for key, n in sizes.items()}
        self.peak_work_buffer_bytes = sum(b.numel() * b.element_size() for bs in buffers.values() for b in bs)
        return buffers

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("HostStateAdamW does not support sparse gradients")
            keys = self._moment_keys(group)
            buffers = self._work_buffers(params, len(keys))
            beta1, beta2 = group["betas"]
            for p in params:
                state = self._init_state(group, p)
                local = _local(p)
                # the moments' strides (a contiguous view of a strided parameter would pair each
                # element with another's moments in the fused kernel's memory-order walk)
                strides = _state_strides(local)
                work = [buf[: local.numel()].as_strided(local.shape, strides)
                        for buf in buffers[(local.device, local.dtype)]]
                for buf, key in zip(work, keys, strict=True):
                    buf.copy_(_local(state[key]), non_blocking=True)
                moments = dict(zip(keys, work, strict=True))
                adam([local], [_local(p.grad)], [moments["exp_avg"]], [moments["exp_avg_sq"]],
                     [moments["max_exp_avg_sq"]] if group["amsgrad"] else [], [state["step"]],
                     amsgrad=group["amsgrad"], has_complex=torch.is_complex(local), beta1=beta1, beta2=beta2,
                     lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                     maximize=group["maximize"], foreach=group["foreach"], capturable=False,
                     differentiable=False, fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
                     found_inf=getattr(self, "found_inf", None), decoupled_weight_decay=True)
                for buf, key in zip(work, keys, strict=True):
                    _local(state[key]).copy_(buf, non_blocking=True)
            for device, _ in buffers:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # the host moments are complete when step returns
            del buffers
        return loss


def host_state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(host bytes, device bytes) of an optimizer's floating-point state tensors (local shards)."""
    host = device = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                local = _local(value)
                size = local.numel() * local.element_size()
                if local.device.type == "cpu":
                    host += size
                else:
                    device += size
    return host, device


def work_buffer_bytes(numels: list[int], element_size: int = 4, moments: int = 2) -> int:
    """The step's device work buffers: ``moments`` buffers of the largest local shard."""
    return moments * max(numels, default=0) * element_size
