"""The in-process simulator: ranks as coroutines, collectives matched by order, faults at boundaries.

Each rank runs the training program of `model` as a generator that yields what it waits for: a
collective (matched with the other members' next collective *by order*, as NCCL and gloo do: they
do not know which step a buffer belongs to) or a site (the commit record, the checkpoint write)
where the strategy acts. A fault is injected once, in generation 1, at the schedule's site of step
F: ranks `ahead` get past it, the victim is caught before it, the others fail at their next
collective (restart-all's agent kills everyone at once). The strategy then forms the next
generation; the old generation's late completions are delivered after the new one has run a step.

The simulator tracks the truth the strategies cannot see: which step and generation produced every
gradient a rank applied, and which files were written late by an old generation. The oracle
judges from that truth.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpuguard.generation.records import Incarnation
from gpuguard.transitions import model as m
from gpuguard.transitions.oracle import Applied, Effect, RankOutcome, RunOutcome
from gpuguard.transitions.schedules import Schedule


class CommError(Exception):
    """A collective failed: a peer died or the communicator was aborted."""


@dataclass(frozen=True)
class Collective:
    tag: str  # "collective0" | "collective1"
    step: int
    payload: tuple[int, ...]


@dataclass(frozen=True)
class Site:
    name: str  # "commit" | "checkpoint"
    step: int


@dataclass(frozen=True)
class Result:
    """A collective's output as delivered, with its provenance (which steps, which generation)."""

    values: tuple[int, ...]
    steps: tuple[int, ...]
    generation: int


@dataclass(frozen=True)
class Late:
    """An operation of an old generation that completes after the next one started."""

    kind: str  # gradient | commit-record | ledger-activation | checkpoint-shard
    rank: int
    incarnation_id: str
    generation: int
    step: int
    tag: str = ""
    result: Result | None = None
    state: m.TrainState | None = None


@dataclass(eq=False)
class Proc:
    rank: int
    incarnation: Incarnation
    generation: int
    world: int
    state: m.TrainState
    base_step: int
    history: list[Applied] = field(default_factory=list)
    alive: bool = True
    program: Generator[Any, Any, None] | None = None
    waiting: Any = None
    done: bool = False
    failed: bool = False  # its program ended with a collective error
    data: dict[str, Any] = field(default_factory=dict)  # the strategy's per-process runtime state


_counter = [0]


def new_incarnation(rank: int, host: str = "sim") -> Incarnation:
    """A fresh process identity (unique id; rank numbers are reused, ids never)."""
    _counter[0] += 1
    return Incarnation(
        f"{host}-r{rank}-{os.getpid()}-{_counter[0]}",
        f"{host}-node{rank}",
        10_000 + _counter[0],
        1_700_000_000.0 + _counter[0],
    )


class Sim:
    """One run of one schedule against one strategy."""

    def __init__(self, schedule: Schedule, strategy: Any, workdir: Path) -> None:
        self.schedule = schedule
        self.strategy = strategy
        self.dir = Path(workdir)
        self.generation = 1
        self.members: list[Proc] = []
        self.faulted = False
        self.late: list[Late] = []
        self.effects: list[Effect] = []
        self.aborted: str | None = None
        self.sync_ops = 0  # coordination operations beyond the training collectives
        self.sync_s = 0.0  # measured seconds spent in them
        self.recover_wall_s = 0.0
        self.resume_step: int | None = None
        self._pending_late: list[Late] = []
        self._rounds_in_gen = 0
        self.file_truth: dict[str, tuple[int, bool]] = {}

    # -- storage with truth metadata --------------------------------------------------------
    def write_bytes(
        self, path: Path, data: bytes, *, generation: int, late: bool = False, torn: bool = False, atomic: bool = False
    ) -> None:
        """Write a state file; `torn` leaves the first half only (the writer died mid-write).

        Who wrote it (generation, late or not) is kept beside, in the simulator's truth table,
        not in the file: the strategies cannot see it, the oracle can.
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        if torn:
            data = data[: len(data) // 2]
        if atomic:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        else:
            path.write_bytes(data)
        self.file_truth[str(path)] = (generation, late)

    def write_json(self, path: Path, obj: dict[str, Any], **kw: Any) -> None:
        self.write_bytes(path, json.dumps(obj, sort_keys=True).encode(), **kw)

    def note_read(self, path: Path, reader_generation: int, rank: int, step: int) -> None:
        """A file written late by an old generation and read by a newer one: an old result made visible."""
        gen, late = self.file_truth.get(str(path), (reader_generation, False))
        if late and gen < reader_generation:
            self.effects.append(Effect("checkpoint-shard", gen, reader_generation, rank, step, True))

    def read_json(self, path: Path, reader_generation: int, rank: int) -> dict[str, Any]:
        """Read a JSON state file (ValueError if torn or garbled)."""
        obj = json.loads(path.read_bytes())
        self.note_read(path, reader_generation, rank, int(obj.get("step", -1)) if isinstance(obj, dict) else -1)
        return obj

    # -- the training program ------------------------------------------------------------------
    def program(self, proc: Proc) -> Generator[Any, Any, None]:
        sch = self.schedule
        while proc.state.step < sch.steps:
            s = proc.state.step + 1
            part = m.local_gradient(proc.state, proc.world, proc.rank)
            if sch.layout == "dp":
                r0 = yield Collective("collective0", s, _mask(part, m.BUCKETS[0]))
                proc.state = m.update_slots(proc.state, r0.values, m.BUCKETS[0])
                r1 = yield Collective("collective1", s, _mask(part, m.BUCKETS[1]))
                proc.state = m.update_slots(proc.state, r1.values, m.BUCKETS[1])
                prov = (tuple(sorted(set(r0.steps) | set(r1.steps))), min(r0.generation, r1.generation))
            else:
                r0 = yield Collective("collective0", s, part)
                mine = m.owned(proc.world, proc.rank)
                proc.state = m.update_slots(proc.state, r0.values, mine)
                r1 = yield Collective("collective1", s, _mask(proc.state.params, mine))  # all-gather
                proc.state = replace(proc.state, params=r1.values)
                prov = (r0.steps, r0.generation)
            proc.state = m.finish_step(proc.state)
            proc.history.append(Applied(proc.state.step, proc.generation, prov[0], prov[1]))
            yield Site("commit", s)
            if s % sch.checkpoint_every == 0:
                yield Site("checkpoint", s)

    # -- the engine ---------------------------------------------------------------------------
    def start(self, procs: list[Proc]) -> None:
        self.members = procs
        for p in procs:
            self._spawn(p)

    def _spawn(self, p: Proc) -> None:
        p.program = self.program(p)
        p.done = p.failed = False
        self._advance(p, None)

    def _advance(self, p: Proc, value: Any, error: BaseException | None = None) -> None:
        assert p.program is not None  # _spawn gave it one before its first _advance
        try:
            p.waiting = p.program.throw(error) if error is not None else p.program.send(value)
        except StopIteration:
            p.waiting, p.done = None, True
        except CommError:
            p.waiting, p.failed = None, True

    def _stop(self, p: Proc) -> None:
        """The process stops where it is (killed, or hung for good in this generation)."""
        if p.program is not None:
            p.program.close()
        p.waiting = None
        p.alive = False

    def running(self) -> list[Proc]:
        return [p for p in self.members if p.alive and not p.done and not p.failed]

    def run(self) -> None:
        """Generation 1 up to the fault, recovery, then the next generation to the end."""
        self.strategy.setup(self)
        self._loop()
        if self.aborted or not self.faulted:
            return
        t0 = time.perf_counter()
        try:
            members = self.strategy.recover(self)
        except Exception as exc:  # noqa: BLE001 - a recovery that cannot proceed is the result
            self.aborted = f"recovery failed: {type(exc).__name__}: {exc}"
            self.recover_wall_s = time.perf_counter() - t0
            return
        self.recover_wall_s = time.perf_counter() - t0
        self.generation += 1
        self._pending_late = list(self.late)
        self._rounds_in_gen = 0
        self.start(members)
        self._loop()

    def _loop(self) -> None:
        sch = self.schedule
        while True:
            live = self.running()
            if not live:
                return
            sites = [p for p in live if isinstance(p.waiting, Site)]
            if sites:
                site = sites[0].waiting
                group = [p for p in sites if p.waiting == site]
                if not self.faulted and self.generation == 1 and site.step == sch.fault_step and site.name == sch.site:
                    self._fault_at_site(group)
                else:
                    for p in group:
                        self._do_site(p)
                continue
            # every live member waits in a collective
            if self.faulted and self.generation == 1:
                self._fail_all(live)  # the old communicator is broken: every further collective fails
                continue
            if len(live) < len([p for p in self.members if p.alive]):
                waiting = sorted(p.rank for p in live)
                self.aborted = (
                    f"rank(s) {waiting} wait forever in a collective the other ranks never join "
                    f"(the job hangs until the timeout)"
                )
                return
            # match them by order, as NCCL and gloo do
            reqs = [p.waiting for p in live]
            tag = reqs[0].tag
            steps = tuple(sorted({r.step for r in reqs}))
            result = Result(m.reduce_sum([r.payload for r in reqs]), steps, self.generation)
            if not self.faulted and self.generation == 1 and tag == sch.site and steps == (sch.fault_step,):
                self._fault_at_collective(live, result)
                continue
            if self.generation > 1 and tag == "collective0":
                self._rounds_in_gen += 1
                if self._rounds_in_gen == 2:
                    self._deliver_late()
            for p in live:
                self._advance(p, self._consume_stale(p, tag, result))

    def _fail_all(self, live: list[Proc]) -> None:
        for p in live:
            if self.strategy.kills_all_on_fault:
                self._stop(p)
            else:
                self._advance(p, None, CommError("communicator aborted"))

    def _do_site(self, p: Proc) -> None:
        site = p.waiting
        if site.name == "commit":
            self.strategy.commit(self, p, site.step)
        else:
            self.strategy.checkpoint(self, p, site.step)
        self._advance(p, None)

    # -- faults ---------------------------------------------------------------------------
    def _begin_fault(self) -> None:
        self.faulted = True
        self.strategy.on_fault(self)

    def _ahead_or_zombie(self, p: Proc, proceed: Any) -> bool:
        """A rank ahead gets past the site (restart-all's agent kills it right after); the
        rank-reuse victim hangs and keeps its unfinished work for later. True if `p` was one."""
        sch = self.schedule
        if p.rank in sch.ahead:
            proceed()
            if self.strategy.kills_all_on_fault:
                self._stop(p)
            return True
        if sch.zombie and p.rank == sch.victim:
            self.late += self._zombie_actions(p, sch.site)
            self._stop(p)
            return True
        return False

    def _fault_at_collective(self, live: list[Proc], result: Result) -> None:
        sch = self.schedule
        self._begin_fault()
        for p in live:
            if self._ahead_or_zombie(p, lambda p=p: self._advance(p, result)):  # ahead: it got the result
                continue
            if sch.victim == p.rank or self.strategy.kills_all_on_fault:
                self._stop(p)
            else:
                if p.rank in sch.late:
                    self.late.append(
                        Late(
                            "gradient",
                            p.rank,
                            p.incarnation.id,
                            self.generation,
                            sch.fault_step,
                            tag=sch.site,
                            result=result,
                        )
                    )
                self._advance(p, None, CommError("collective failed"))
        self._after_fault()

    def _fault_at_site(self, group: list[Proc]) -> None:
        sch = self.schedule
        self._begin_fault()
        for p in group:
            if self._ahead_or_zombie(p, lambda p=p: self._do_site(p)):
                continue
            if p.rank == sch.victim:
                if sch.site == "checkpoint":
                    self.strategy.checkpoint(self, p, sch.fault_step, torn=True)  # died mid-write
                self._stop(p)
            elif self.strategy.kills_all_on_fault:
                self._stop(p)
            elif p.rank in sch.late:
                kind = "commit-record" if sch.site == "commit" else "checkpoint-shard"
                self.late.append(Late(kind, p.rank, p.incarnation.id, self.generation, sch.fault_step, state=p.state))
                self._advance(p, None)  # goes on; its write is still in flight
            else:
                self._do_site(p)
        self._after_fault()

    def _zombie_actions(self, p: Proc, site: str) -> list[Late]:
        """What a hung old incarnation does when it wakes up: it finishes step F as it sees it."""
        out = []
        if site in ("collective0", "collective1", "commit"):
            out.append(Late("commit-record", p.rank, p.incarnation.id, self.generation, self.schedule.fault_step))
            # it re-reads the coordination state and claims its rank number in the generation now active
            out.append(
                Late(
                    "commit-record",
                    p.rank,
                    p.incarnation.id,
                    self.generation,
                    self.schedule.fault_step,
                    tag="claims-active",
                )
            )
        out.append(
            Late("checkpoint-shard", p.rank, p.incarnation.id, self.generation, self.schedule.fault_step, state=p.state)
        )
        return out

    def _after_fault(self) -> None:
        sch = self.schedule
        if sch.site == "commit" and sch.late:
            # the old generation's coordinator was writing the ledger too: its activation lands late
            coord = min(self.members, key=lambda q: q.rank)
            self.late.append(
                Late("ledger-activation", coord.rank, coord.incarnation.id, self.generation, sch.fault_step)
            )
        if sch.corrupt:
            self.strategy.corrupt_newest(self, sch.victim_rank)

    # -- late completions ----------------------------------------------------------------------
    def _deliver_late(self) -> None:
        for item in self._pending_late:
            if item.kind == "gradient":
                target = next((p for p in self.members if p.incarnation.id == item.incarnation_id and p.alive), None)
                if target is None:
                    continue  # the process it was meant for is gone: nothing can see it
                accepted = self.strategy.accept_late(self, target, item)
                self.effects.append(
                    Effect("gradient", item.generation, self.generation, item.rank, item.step, accepted)
                )
                if accepted:
                    target.data.setdefault("stale", {})[item.tag] = item.result
            elif item.kind in ("commit-record", "ledger-activation"):
                deliver = self.strategy.late_commit if item.kind == "commit-record" else self.strategy.late_activation
                accepted = deliver(self, item)
                if accepted is not None:  # None: this strategy keeps no such record
                    self.effects.append(
                        Effect(item.kind, item.generation, self.generation, item.rank, item.step, accepted)
                    )
            else:
                self.strategy.late_shard(self, item)
        self._pending_late = []

    def _consume_stale(self, p: Proc, tag: str, result: Result) -> Result:
        stale = p.data.get("stale", {}).pop(tag, None)
        return stale if stale is not None else result

    # -- outcome --------------------------------------------------------------------------
    def outcome(self) -> RunOutcome:
        ranks = tuple(
            RankOutcome(p.rank, p.incarnation.id, p.generation, p.state, p.base_step, tuple(p.history))
            for p in sorted(self.members, key=lambda q: q.rank)
            if p.alive
        )
        aborted = self.aborted
        if aborted is None and not self.faulted:
            aborted = "the fault was never injected (schedule did not reach its boundary)"
        if aborted is None:
            stuck = [p.rank for p in self.members if p.alive and p.failed]
            if stuck:
                aborted = f"rank(s) {stuck} ended with a collective error"
        claimed = None
        durable = None
        if aborted is None or self.faulted:
            try:
                claimed = self.strategy.claimed_steps(self)
                durable = self.strategy.durable(self)
            except Exception as exc:  # noqa: BLE001 - the strategy's own view failed: say so
                aborted = aborted or f"cannot read the strategy's state: {exc}"
        return RunOutcome(self.schedule.seed, ranks, claimed, tuple(self.effects), durable, aborted)


def _mask(values: tuple[int, ...], slots: tuple[int, ...]) -> tuple[int, ...]:
    keep = set(slots)
    return tuple(v if j in keep else 0 for j, v in enumerate(values))
