"""Reading a fresh optimizer's state must not step it (issue 24): torch's `get_state_dict` creates the
state of an optimizer that has none by a step at lr 0 (`_init_optim_state`), which sets AdamW's step
count to 1, so a job under gpuguard (which reads its state at activation, for the digest and for its
copy in memory) trained unlike the same job without it. The reads record the optimizer fresh; only the
template a snapshot is loaded into (`load_template`) creates the state, which the load overwrites."""

from __future__ import annotations

import copy

import torch

from gpuguard.recovery.runtime.rank_state import ReplicatedState, TrainObjects
from gpuguard.recovery.runtime.sharded_state import ShardedState

STEPS = 5


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _pair() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _steps(opt: torch.optim.Optimizer) -> set[float]:
    return {float(s["step"]) for s in opt.state.values()}


def test_reading_a_fresh_adamw_leaves_it_fresh_and_trains_bitwise_like_a_plain_loop():
    plain_model, plain_opt = _pair()
    plain = _train(plain_model, plain_opt, STEPS)
    model, opt = _pair()
    state = ReplicatedState(TrainObjects(model=model, optimizer=opt))
    read = state.state_dict()
    state.digest()
    state.remember(0)  # what an in-place runtime does at activation
    assert not opt.state and read["optim"]["state"] == {}
    assert [g["lr"] for g in read["optim"]["param_groups"]] == [0.05]
    assert torch.equal(_train(model, opt, STEPS), plain)
    assert _steps(opt) == _steps(plain_opt) == {float(STEPS)}


def test_the_load_template_of_a_fresh_optimizer_holds_the_state_a_snapshot_fills():
    """What the reverted fix broke: a template without optimizer state made DCP load none."""
    model, opt = _pair()
    state = ReplicatedState(TrainObjects(model=model, optimizer=opt))
    template = state.load_template()
    assert set(template["optim"]["state"]) == {"weight", "bias"}
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(template["optim"]["state"]["weight"])


def test_rolling_back_to_the_initial_state_leaves_a_fresh_optimizer():
    """In place before the first commit: the remembered initial state restores an unstepped optimizer."""
    model, opt = _pair()
    state = ReplicatedState(TrainObjects(model=model, optimizer=opt))
    initial = copy.deepcopy(state.state_dict())
    _train(model, opt, 3)
    assert opt.state
    state.apply(initial)
    assert not opt.state
    assert torch.equal(_train(model, opt, STEPS), _train(*_pair(), STEPS))


def test_the_sharded_states_read_leaves_a_fresh_optimizer_fresh_and_its_template_holds_the_state():
    """`Runtime.state_dict()` / `sharded_state()` of a sharded job before its first step (a plain
    module here: `get_state_dict` reads it as it reads an FSDP2 one, without a process group)."""
    model, opt = _pair()
    state = ShardedState(TrainObjects(model=model, optimizer=opt), build=None)
    read = state.state_dict()
    assert not opt.state and read["optim"]["state"] == {}
    assert set(state.load_template()["optim"]["state"]) == {"weight", "bias"}
