"""Reading a fresh optimizer's state must not step it: torch's `get_state_dict` initialises an
optimizer with no state by stepping it at lr 0, which sets AdamW's step count to 1, so a job under
gpuguard (which reads the state at activation, for its digest and its copy in memory) would train
unlike the same job without it. Replicated state undoes that and records the optimizer fresh."""

from __future__ import annotations

import copy

import torch

from gpuguard.recovery.runtime.rank_state import ReplicatedState, TrainObjects


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


def test_reading_a_fresh_adamw_leaves_it_fresh_and_training_unchanged():
    plain = _train(*_pair(), steps=5)
    model, opt = _pair()
    state = ReplicatedState(TrainObjects(model=model, optimizer=opt))
    read = state.state_dict()
    assert not opt.state and read["optim"]["state"] == {}
    assert torch.equal(_train(model, opt, steps=5), plain)


def test_a_fresh_state_restores_to_a_fresh_optimizer_after_training():
    """Rolling back to the initial state (in place before the first commit) leaves no moments behind."""
    model, opt = _pair()
    state = ReplicatedState(TrainObjects(model=model, optimizer=opt))
    initial = copy.deepcopy(state.state_dict())  # the runtime keeps a copy (clone_state), not views
    _train(model, opt, steps=3)
    assert opt.state
    state.apply(initial)
    assert not opt.state
    assert torch.equal(_train(model, opt, steps=5), _train(*_pair(), steps=5))
