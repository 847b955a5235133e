"""[optimizer] state_on_host: HostStateAdamW equals torch.optim.AdamW bit for bit (plain tensors and
FSDP2 DTensor shards), its checkpoints load into either class, the moments live in host tensors
and the step's device transient is the two work buffers (measured with the live-tensor tracker);
the planner moves exactly the moments from the device peak to the host line."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from titan_upipe.optim.host_adamw import HostStateAdamW, host_state_bytes, work_buffer_bytes
from titan_upipe.toolkit.memory_tracker import LiveTensorTracker

IMPLEMENTATIONS = ("for-loop", "foreach", "fused")


def _kwargs(impl: str) -> dict:
    return dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=impl == "foreach",
                fused=impl == "fused")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 32))


def _train(model, optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 64, generator=gen)).square().mean().backward()
        if step == steps // 2:  # a scheduler's change of the learning rate
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * 0.5
        optimizer.step()


def _states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    return sa.keys() == sb.keys() and all(
        sa[i].keys() == sb[i].keys() and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]) for i in sa)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_equals_torch_adamw_bitwise(impl):
    reference, model = _model(), _model()
    expected = torch.optim.AdamW(reference.parameters(), **_kwargs(impl))
    optimizer = HostStateAdamW(model.parameters(), **_kwargs(impl))
    _train(reference, expected, 6)
    _train(model, optimizer, 6)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters(), strict=True))
    assert _states_equal(expected, optimizer)
    # and the parameters moved: the comparison is not of two untouched models
    assert not torch.equal(next(model.parameters()), next(_model().parameters()))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_checkpoints_load_into_either_class(impl):
    """A state dict of either class, loaded into the other, continues bit for bit."""
    model, other = _model(), _model()
    host = HostStateAdamW(model.parameters(), **_kwargs(impl))
    plain = torch.optim.AdamW(other.parameters(), **_kwargs(impl))
    _train(model, host, 3)
    _train(other, plain, 3)
    model_b, other_b = copy.deepcopy(model), copy.deepcopy(other)
    host_b = torch.optim.AdamW(model_b.parameters(), **_kwargs(impl))  # host state -> plain AdamW
    # deep copies: a checkpoint's tensors are its own (torch's load keeps tensors it can use as they are)
    host_b.load_state_dict(copy.deepcopy(host.state_dict()))
    plain_b = HostStateAdamW(other_b.parameters(), **_kwargs(impl))  # plain AdamW -> host state
    plain_b.load_state_dict(copy.deepcopy(plain.state_dict()))
    for m, o in ((model, host), (model_b, host_b), (other, plain), (other_b, plain_b)):
        _train(m, o, 3, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model_b.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), other_b.parameters(), strict=True))
    assert _states_equal(host, host_b) and _states_equal(plain, plain_b)
    # the loaded moments are in host memory (on CPU the hook that moves them there has nothing to move)
    loaded = plain_b.state[next(other_b.parameters())]["exp_avg"]
    assert loaded.device.type == "cpu"


def _strided_params(layout: str) -> list[torch.nn.Parameter]:
    """Parameters whose memory order is not their logical order (plus a contiguous one beside)."""
    torch.manual_seed(0)
    if layout == "transposed":
        strided = torch.randn(4, 5).t()  # (5, 4), strides (1, 5)
    else:  # a conv weight in channels-last
        strided = torch.randn(3, 4, 2, 5).to(memory_format=torch.channels_last)
    assert not strided.is_contiguous()
    return [torch.nn.Parameter(strided), torch.nn.Parameter(torch.randn(6))]


def _train_params(params, optimizer, steps: int, seed: int) -> None:
    """Gradients from autograd, so each has its parameter's strides (AccumulateGrad's layout)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        sum((p * torch.randn(p.shape, generator=gen)).square().sum() for p in params).backward()
        optimizer.step()




def test_a_load_never_sends_the_moments_to_the_parameters_device(monkeypatch):
    """Torch's ``load_state_dict`` copies each state tensor to its parameter's device
    (``Optimizer._process_value_according_to_param_policy``): all the moments on the device at once. The
    moments bypass it, straight into host tensors, with the saved values; ``step`` goes through it."""
    model = _model()
    saved = HostStateAdamW(model.parameters(), **_kwargs("foreach"))
    _train(model, saved, 2)
    cast_keys = []
    torch_cast = torch.optim.Optimizer._process_value_according_to_param_policy

    def recording_cast(param, value, param_id, param_groups, key=None):
        cast_keys.append(key)
        return torch_cast(param, value, param_id, param_groups, key)

    monkeypatch.setattr(torch.optim.Optimizer, "_process_value_according_to_param_policy",
                        staticmethod(recording_cast))
    loaded = HostStateAdamW(copy.deepcopy(model).parameters(), **_kwargs("foreach"))
    loaded.load_state_dict(copy.deepcopy(saved.state_dict()))
    assert cast_keys and set(cast_keys) == {"step"}
    assert _states_equal(saved, loaded)
    assert host_state_bytes(loaded) == host_state_bytes(saved) and host_state_bytes(loaded)[0] > 0
    monkeypatch.undo()  # and the same load into torch's AdamW does send them through it
    cast_keys.clear()
    monkeypatch.setattr(torch.optim.Optimizer, "_process_value_according_to_param_policy",
                        staticmethod(recording_cast))
    torch.optim.AdamW(copy.deepcopy(model).parameters(), **_kwargs("foreach")).load_state_dict(
        copy.deepcopy(saved.state_dict()))
    assert set(cast_keys) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_strided_parameters_equal_torch_adamw_and_checkpoints_move_both_ways(impl, layout):
    """A non-contiguous parameter: 3 steps bit-equal to torch.optim.AdamW (parameters, moments and
    their strides), then each state dict loaded into the other class continues bit for bit for 2 more
    steps. The fused kernel walks memory: moments viewed contiguously beside a transposed parameter
    were a permutation of torch's, and a checkpoint moved to torch's AdamW resumed with them."""
    host_params, torch_params = _strided_params(layout), _strided_params(layout)
    host = HostStateAdamW(host_params, **_kwargs(impl))
    plain = torch.optim.AdamW(torch_params, **_kwargs(impl))
    _train_params(host_params, host, 3, seed=1)
    _train_params(torch_params, plain, 3, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(host_params, torch_params, strict=True))
    assert _states_equal(host, plain)
    for a, b in zip(host_params, torch_params, strict=True):
        assert all(host.state[a][k].stride() == plain.state[b][k].stride() == a.stride()
                   for k in ("exp_avg", "exp_avg_sq"))
    # host state -> torch AdamW, torch state -> host state; every run continues 2 steps
    host_to_torch_params = [torch.nn.Parameter(p.detach().clone(memory_format=torch.preserve_format))
                            for p in host_params]
    torch_to_host_params = [torch.nn.Parameter(p.detach().clone(memory_format=torch.preserve_format))
                            for p in torch_params]
    host_to_torch = torch.optim.AdamW(host_to_torch_params, **_kwargs(impl))
    host_to_torch.load_state_dict(copy.deepcopy(host.state_dict()))
    torch_to_host = HostStateAdamW(torch_to_host_params, **_kwargs(impl))
    torch_to_host.load_state_dict(copy.deepcopy(plain.state_dict()))
    runs = ((host_params, host), (host_to_torch_params, host_to_torch), (torch_params, plain),
            (torch_to_host_params, torch_to_host))
    for params, optimizer in runs:
        _train_params(params, optimizer, 2, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(host_params, host_to_torch_params, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(torch_params, torch_to_host_params, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(host_params, torch_params, strict=True))
    assert _states_equal(host, host_to_torch) and _states_equal(plain, torch_to_host)


@pytest.mark.parametrize("impl,temporaries", [("fused", 0), ("foreach", 1), ("for-loop", 2)])
def test_moments_on_host_and_the_step_transient_is_the_work_buffers(impl, temporaries):
    """Measured: a steady-state step allocates the two work buffers of the largest parameter
    (``8 n_max`` bytes) plus the update's own temporaries of one parameter (foreach: sqrt(v),
    ``4 n_max``; the for-loop: sqrt(v) and its quotient, ``8 n_max``), where torch's foreach
    AdamW allocates ``4 sum n``; the moments are ``8 sum n`` bytes of host tensors of their own."""
    model = _model()
    optimizer = HostStateAdamW(model.parameters(), **_kwargs(impl))
    _train(model, optimizer, 2)
    numels = [p.numel() for p in model.parameters()]
    n_max = max(numels)
    assert n_max == 128 * 64
    with LiveTensorTracker() as mem:
        optimizer.step()
    assert mem.peak_bytes == 2 * 4 * n_max + temporaries * 4 * n_max
    assert mem.current_bytes == 0  # nothing stays allocated after the step
    assert optimizer.peak_work_buffer_bytes == work_buffer_bytes(numels) == 2 * 4 * n_max
    assert host_state_bytes(optimizer) == (8 * sum(numels), 0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    moments = {optimizer.state[p][k].untyped_storage().data_ptr() for p in model.parameters()
               for k in ("exp_avg", "exp_avg_sq")}
    assert len(moments) == 2 * len(numels) and not moments & (params | grads)


def test_torch_foreach_adamw_transient_is_one_shard_of_everything():
    """The planner's ADAMW_TEMP (without the switch): foreach AdamW's sqrt(v) over all parameters."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), **_kwargs("foreach"))
    _train(model, optimizer, 2)
    with LiveTensorTracker() as mem:
        optimizer.step()
    assert mem.peak_bytes == 4 * sum(p.numel() for p in model.parameters())


def test_refuses_capturable():
    with pytest.raises(ValueError, match="capturable"):
        HostStateAdamW(_model().parameters(), capturable=True)


# ---- FSDP2 DTensor shards and TorchTitan's optimizer container (2 gloo ranks)

def _fsdp_run(rank: int, world: int, mesh, impl: str) -> list[str]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torchtitan.components.optimizer import OptimizersContainer

    problems: list[str] = []

    def sharded() -> torch.nn.Module:
        model = _model()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def train(model, container, steps: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed + rank)  # each rank its own batch: gradients reduce
        for _ in range(steps):
            container.zero_grad()
            model(torch.randn(4, 64, generator=gen)).square().mean().backward()
            container.step()

    kwargs = {k: v for k, v in _kwargs(impl).items()}
    ref_model, model = sharded(), sharded()
    ref = OptimizersContainer([ref_model], torch.optim.AdamW, kwargs)
    host = OptimizersContainer([model], HostStateAdamW, kwargs)
    train(ref_model, ref, 4, 1)
    train(model, host, 4, 1)
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        if not torch.equal(a.full_tensor(), b.full_tensor()):
            problems.append("parameters differ after 4 steps")
    for p in model.parameters():
        m = host.optimizers[0].state[p]["exp_avg"]
        if not (isinstance(m, DTensor) and m.placements == p.placements and m.to_local().shape == p.to_local().shape):
            problems.append("a moment is not a DTensor shard like its parameter")
    # TorchTitan's checkpoint path: the container's (DCP) state dict, loaded into fresh containers
    state = host.state_dict()
    ref_state = ref.state_dict()
    if state.keys() != ref_state.keys() or any(
            torch.is_tensor(v) and not torch.equal(v.full_tensor() if isinstance(v, DTensor) else v,
                                                   ref_state[k].full_tensor() if isinstance(ref_state[k], DTensor)
                                                   else ref_state[k]) for k, v in state.items()):
        problems.append("the DCP state dicts differ")
    resumed_model, resumed_plain_model = sharded(), sharded()
    for src, dst in ((model, resumed_model), (model, resumed_plain_model)):
        for a, b in zip(src.parameters(), dst.parameters(), strict=True):
            b.data.copy_(a.data)
    resumed = OptimizersContainer([resumed_model], HostStateAdamW, kwargs)
    resumed.load_state_dict(copy.deepcopy(state))  # a checkpoint's tensors are its own
    resumed_plain = OptimizersContainer([resumed_plain_model], torch.optim.AdamW, kwargs)
    resumed_plain.load_state_dict(copy.deepcopy(state))
    for m, c in ((ref_model, ref), (resumed_model, resumed), (resumed_plain_model, resumed_plain)):
        train(m, c, 2, 7)
    for name, other in (("host-state resume", resumed_model), ("AdamW resume", resumed_plain_model)):
        if not all(torch.equal(a.full_tensor(), b.full_tensor())
                   for a, b in zip(ref_model.parameters(), other.parameters(), strict=True)):
            problems.append(f"{name} differs from the uninterrupted AdamW run")
    return problems


@pytest.mark.parametrize("impl", ["foreach", "for-loop"])
def test_fsdp2_shards_and_dcp_checkpoints(impl):
    from dist_utils import run_distributed

    for problems in run_distributed(2, _fsdp_run, impl):
        assert problems == []


# ---- the train spec and the config switch

def test_spec_builds_host_state_adamw_only_with_the_switch():
    from torchtitan.config import Optimizer as OptimizerConfig
    from torchtitan.protocols.train_spec import get_train_spec

    from titan_upipe.torchtitan_0_2.config import OptimizerHostState

    build = get_train_spec("upipe_llama3").build_optimizers_fn
    model = _model()

    class Config(OptimizerConfig, OptimizerHostState):
        pass

    config = Config(implementation="foreach")
    assert type(build([model], config, None).optimizers[0]) is torch.optim.AdamW
    config.state_on_host = True
    optimizer = build([model], config, None).optimizers[0]
    assert type(optimizer) is HostStateAdamW
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"], group["foreach"]) == (
        config.lr, (config.beta1, config.beta2), config.eps, config.weight_decay, True)


@pytest.mark.parametrize("overrides,message", [
    (("--optimizer.name", "Adam"), r"^optimizer.state_on_host = true runs AdamW only \(got optimizer.name = 'Adam'\)"),
    (("--optimizer.early_step_in_backward",), r"^optimizer.state_on_host = true does not support optimizer.early_step"),
    (("--fault_tolerance.enable",), r"^optimizer.state_on_host = true does not support fault_tolerance.enable"),
])
def test_settings_it_does_not_run_are_refused(overrides, message):
    from titan_upipe.torchtitan_0_2.checks.training import check_optimizer
    from titan_upipe.torchtitan_0_2.config import ConfigError
    from titan_upipe.torchtitan_0_2.config_parse import parse_config

    job = parse_config(["--job.config_file", "configs/debug/llama3_upipe.toml", "--optimizer.state_on_host",
                        *overrides])
    with pytest.raises(ConfigError, match=message):
        check_optimizer(job, 1)
    job.optimizer.state_on_host = "yes"
    with pytest.raises(ConfigError, match=r"^invalid optimizer.state_on_host = 'yes': valid values are true, false$"):
        check_optimizer(job, 1)


# ---- the planner

def _meta_shards(spec_name: str, flavor: str, world: int) -> list[int]:
    """Rank 0's local elements of every parameter of TorchTitan's model class built (on meta) from
    the plugin's flavor, FSDP2's dim-0 sharding: ceil(rows / W) x the rest."""
    from torchtitan.protocols.train_spec import get_train_spec

    from titan_upipe.torchtitan_0_2.flavors import model_flavors

    with torch.device("meta"):
        model = get_train_spec(spec_name).model_cls(model_flavors(spec_name)[flavor])
    return [math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for p in model.parameters()]


@pytest.mark.parametrize("model,spec,flavor,cp,ulysses,seq_len", [
    ("llama3_8b", "upipe_llama3", "8B", 8, 8, 7 << 20),
    ("qwen3_32b", "upipe_qwen3", "32B", 16, 8, 6 << 20),
])
def test_planner_moves_the_moments_to_the_host(model, spec, flavor, cp, ulysses, seq_len):
    from titan_upipe.plan.job import PlanInput
    from titan_upipe.plan.models import model_dims
    from titan_upipe.plan.step import plan
    from titan_upipe.plan.terms import Term
    from titan_upipe.spec.units import pow2_ceil

    dims = model_dims(model)
    shards = _meta_shards(spec, flavor, cp)
    assert sorted(r * c for r, c in dims.param_shapes()) == sorted(_meta_shards(spec, flavor, 1))  # TorchTitan's
    assert sorted(math.ceil(r / cp) * c for r, c in dims.param_shapes()) == sorted(shards)
    job = PlanInput(model=dims, seq_len=seq_len, cp=cp, ulysses=ulysses, mode="upipe", pin_memory=False)
    before, after = plan(job), plan(replace(job, optimizer_state_on_host=True))
    moments = 2 * math.ceil(dims.total_params / cp) * 4 + 4 * dims.param_tensors
    assert Term.ADAMW_MOMENTS.value in before.breakdown and Term.ADAMW_MOMENTS.value not in after.breakdown
    assert before.peak.where == after.peak.where
    assert before.peak_gpu_bytes - after.peak_gpu_bytes == moments
    pinned_moments = sum(2 * pow2_ceil(4 * n) for n in shards)
    assert after.host_optimizer_bytes_per_rank == pinned_moments
    assert after.host_bytes_per_rank - before.host_bytes_per_rank == pinned_moments
    step = next(m for m in after.moments if m.phase == "optimizer")
    assert step.terms[Term.ADAMW_WORK.value] == 2 * 4 * max(shards)
    assert step.terms[Term.ADAMW_TEMP_LARGEST.value] == 4 * max(shards)


def test_planner_llama3_8b_reaches_7m_with_the_switch():
    """Issue 18's Llama3-8B target on 8 x 80 GiB GPUs and 1,900 GiB of host memory (a prediction)."""
    import contextlib
    import io
    import json

    from titan_upipe.tools.plan_cli import main

    def longest(*extra: str) -> dict:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["--model", "llama3_8b", "--seq-len", "7M", "--cp", "8", "--ulysses", "8", "--gpu-mem", "80",
                         "--host-mem", "1900", "--json", *extra]) == 0
        return json.loads(out.getvalue())

    before, after = longest(), longest("--optimizer-state-on-host")
    assert before["max_seq_len_as_configured"] < 7_340_032 <= after["max_seq_len_as_configured"]
    assert after["fits"] and not before["fits"]
    # the longest fit names the switch it needs: issue 18's command, without flags, reports >= 7M
    # (the late prefetch reaches further than the moments on the host, which are host-bound)
    assert before["max_seq_len"] >= 7_340_032 and after["max_seq_len"] >= 7_340_032
    assert before["max_seq_len_settings"]["activation_checkpoint.prefetch_after_attention"] is True
    assert after["host_gib"] <= 1900 and after["peak_gpu_gib"] + 2 <= 80
