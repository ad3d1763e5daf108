"""The oracle: does a finished run map to a legal serial history of generations?

Pure: it takes what the run left behind (each rank's final state and the updates it applied
since its state was last loaded, every old-generation effect and whether it became visible, what
a restart would load now) and returns findings. A run passes only if

* every rank agrees on the step, and that is the certified (claimed) number of steps;
* each rank's updates since its last load are exactly steps base+1 .. n, once each, in order,
  each with the gradient of that same step from its own generation;
* no result of an older generation became visible after a newer one activated;
* parameters, optimizer state (every slot held by someone), RNG and data position equal the
  reference after n steps, on every rank; and the state a restart would load is a reference state.

A fast recovery with any mismatch is a failure, never noise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from gpuguard.transitions.model import N_PARAMS, TrainState, reference


@dataclass(frozen=True)
class Applied:
    """One completed step update: applied as `step` by a process of `generation`, with the
    gradient of `grad_steps` produced by `grad_generation`."""

    step: int
    generation: int
    grad_steps: tuple[int, ...]
    grad_generation: int


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    incarnation: str
    generation: int
    state: TrainState
    base_step: int  # the step of the state this rank last loaded (initial, snapshot, checkpoint, transfer)
    history: tuple[Applied, ...] = ()


@dataclass(frozen=True)
class Effect:
    """A result of generation `origin_generation` that arrived while `active_generation` was active."""

    kind: str  # gradient | optimizer-write | commit-record | checkpoint-shard
    origin_generation: int
    active_generation: int
    rank: int
    step: int
    accepted: bool  # True: it became visible (merged); False: fenced / rejected


@dataclass(frozen=True)
class RunOutcome:
    seed: int
    ranks: tuple[RankOutcome, ...]
    claimed_steps: int | None
    effects: tuple[Effect, ...] = ()
    durable: tuple[int, TrainState] | None = None  # what a restart would load now: (step, state)
    aborted: str | None = None  # the run did not complete (hang, crash loop): why


@dataclass(frozen=True)
class Finding:
    kind: str
    message: str
    rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "rank": self.rank}


@dataclass(frozen=True)
class Verdict:
    findings: tuple[Finding, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def detail(self) -> str:
        if not self.findings:
            return "legal serial history"
        more = f" (+{len(self.findings) - 1} more)" if len(self.findings) > 1 else ""
        return f"{self.findings[0].kind}: {self.findings[0].message}{more}"


@lru_cache(maxsize=4096)
def _ref(seed: int, n: int) -> TrainState:
    return reference(seed, n)


def compare_state(state: TrainState, ref: TrainState) -> list[tuple[str, str]]:
    """(kind, message) for every field of `state` that differs from `ref` (unheld momentum skipped)."""
    out: list[tuple[str, str]] = []
    bad = [j for j in range(N_PARAMS) if state.params[j] != ref.params[j]]
    if bad:
        out.append(("params-mismatch", f"parameters differ from the reference in slots {bad}"))
    bad = [j for j in range(N_PARAMS) if state.momentum[j] is not None and state.momentum[j] != ref.momentum[j]]
    if bad:
        out.append(("optimizer-state-mismatch", f"optimizer state differs from the reference in slots {bad}"))
    if state.rng != ref.rng:
        out.append(("rng-mismatch", "RNG state differs from the reference"))
    if state.data_pos != ref.data_pos:
        out.append(
            ("data-position-mismatch", f"data-loader position {state.data_pos}, the reference is at {ref.data_pos}")
        )
    return out


def _history(r: RankOutcome) -> list[Finding]:
    out: list[Finding] = []
    seen: set[int] = set()
    expected = r.base_step + 1
    last_gen = None
    for a in r.history:
        if a.step in seen or a.step <= r.base_step:
            out.append(
                Finding("step-applied-twice", f"step {a.step} applied twice (generation {a.generation})", r.rank)
            )
        elif a.step > expected:
            missing = list(range(expected, a.step))
            out.append(Finding("step-skipped", f"step(s) {missing} never applied before step {a.step}", r.rank))
        seen.add(a.step)
        expected = max(expected, a.step + 1)
        if a.grad_steps != (a.step,):
            out.append(
                Finding(
                    "wrong-gradient", f"step {a.step} applied with the gradient of step(s) {list(a.grad_steps)}", r.rank
                )
            )
        if a.grad_generation < a.generation:
            out.append(
                Finding(
                    "stale-effect-visible",
                    f"a gradient of generation {a.grad_generation} was applied in generation "
                    f"{a.generation} (step {a.step})",
                    r.rank,
                )
            )
        if last_gen is not None and a.generation < last_gen:
            out.append(Finding("generation-order", f"generation {a.generation} applied after {last_gen}", r.rank))
        last_gen = a.generation
    if r.history and r.history[-1].step != r.state.step:
        out.append(
            Finding(
                "step-applied-twice" if r.history[-1].step > r.state.step else "step-skipped",
                f"last applied step {r.history[-1].step} but the state says step {r.state.step}",
                r.rank,
            )
        )
    if not r.history and r.base_step != r.state.step:
        out.append(
            Finding(
                "step-skipped",
                f"state says step {r.state.step} but it was loaded at {r.base_step} and nothing was applied since",
                r.rank,
            )
        )
    return out


def judge(run: RunOutcome) -> Verdict:
    """Every way `run` fails to be a legal serial history (empty = it passes)."""
    f: list[Finding] = []
    if run.aborted:
        f.append(Finding("incomplete", run.aborted))
    if not run.ranks:
        f.append(Finding("incomplete", "no rank finished"))
        return Verdict(tuple(f))
    steps = sorted({r.state.step for r in run.ranks})
    if len(steps) > 1:
        where = ", ".join(f"rank {r.rank} at {r.state.step}" for r in run.ranks)
        f.append(Finding("step-disagreement", f"ranks disagree on the step: {where}"))
    if run.claimed_steps is not None and steps != [run.claimed_steps]:
        f.append(Finding("step-disagreement", f"certified {run.claimed_steps} steps but the ranks are at {steps}"))
    for r in run.ranks:
        f += _history(r)
    for e in run.effects:
        if e.accepted and e.origin_generation < e.active_generation:
            f.append(
                Finding(
                    "stale-effect-visible",
                    f"{e.kind} of step {e.step} from generation {e.origin_generation} became visible "
                    f"in generation {e.active_generation}",
                    e.rank,
                )
            )
    held: set[int] = set()
    for r in run.ranks:
        held |= {j for j, m in enumerate(r.state.momentum) if m is not None}
        for kind, msg in compare_state(r.state, _ref(run.seed, r.state.step)):
            f.append(Finding(kind, f"step {r.state.step}: {msg}", r.rank))
    lost = sorted(set(range(N_PARAMS)) - held)
    if lost:
        f.append(Finding("state-lost", f"optimizer state slots {lost} are held by no rank"))
    if run.durable is not None:
        step, state = run.durable
        for kind, msg in compare_state(state, _ref(run.seed, step)):
            f.append(Finding("durable-" + kind, f"the checkpoint a restart would load (step {step}): {msg}"))
    return Verdict(tuple(f))
