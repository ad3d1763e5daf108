"""Three recovery strategies, each a faithful model of what people do today.

* `restart-all`: torchrun stops every worker on a failure or membership change and starts a new
  group; the training script reloads the last checkpoint (the seed recipe: rank 0 saves every k
  steps to a fixed path, written in place; with a sharded optimizer each rank saves its own
  optimizer shard). Known gaps kept: no integrity check, a partially written checkpoint set is
  loaded as it is, no fencing of writers that outlive the group.
* `communicator-only`: survivors rebuild the group (shrink / grow) and carry on with whatever
  local state they hold; a step whose collective failed is retried from the top; a new process
  loads the last checkpoint, as a freshly started worker would. No state agreement, no fencing.
* `gpuguard`: certified activation through the real `gpuguard.generation` code: incarnations,
  commit records in the ledger, a certificate issued and checked against the rules, activated by
  the directory ledger's compare-and-swap; every late result is fenced by generation and
  incarnation; checkpoints carry a manifest (BLAKE3 digests per object, owners) and are restored
  only when complete and valid; survivors restore their snapshot at the committed frontier.

Latency in the simulator is modelled from measurements of torchrun + gloo (torch 2.13, 4 workers;
docs/torchrun-hazards.md) plus the measured wall time of each strategy's own recovery work;
`--real` mode measures it end to end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuguard.transitions import model as m
from gpuguard.transitions.sim import Late, Proc, Sim, new_incarnation

# Measured with torch 2.13, gloo, 4 workers (docs/torchrun-hazards.md):
RESTART_ALL_S = 8.20  # SIGKILL of 1 of 4 workers -> first step done by all restarted ranks (median, n=8)
REGROUP_S = 0.077  # kill -> first collective in the re-formed 3-rank gloo group, survivors kept (median, n=6)
SPAWN_S = 4.45  # a new worker process: spawn, import torch, process group ready (median)


def corrupt_json_file(path: Path) -> None:
    """Flip one stored value while keeping the file parseable (bit rot, a bad write-back)."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return  # missing or already torn: nothing left to flip

    def flip(node: Any) -> bool:
        items = sorted(node.items()) if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            if k == "step":
                continue
            if isinstance(v, int) and not isinstance(v, bool):
                node[k] = v ^ 1
                return True
            if flip(v):
                return True
        return False

    if not flip(doc):
        raise ValueError(f"{path}: nothing to corrupt")
    path.write_bytes(json.dumps(doc, sort_keys=True).encode())


class _PlainCheckpoint:
    """The checkpoint a plain training script writes: fixed paths, overwritten in place.

    dp: rank 0 writes the whole state to `ckpt/state.json`. zero1: rank 0 writes
    `ckpt/model.json` (step, parameters, RNG, data position), each rank its `optim-<r>.json`.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def write(
        self,
        sim: Sim,
        p: Proc,
        *,
        torn: bool = False,
        late: bool = False,
        state: m.TrainState | None = None,
        generation: int | None = None,
    ) -> None:
        st = state or p.state
        gen = sim.generation if generation is None else generation
        if sim.schedule.layout == "dp":
            if p.rank == 0:
                sim.write_json(self.root / "state.json", st.to_dict(), generation=gen, torn=torn, late=late)
            return
        if p.rank == 0:
            sim.write_json(
                self.root / "model.json",
                {"step": st.step, "params": list(st.params), "rng": st.rng, "data_pos": st.data_pos},
                generation=gen,
                torn=torn,
                late=late,
            )
        slots = {str(j): v for j, v in enumerate(st.momentum) if v is not None}
        sim.write_json(
            self.root / f"optim-{p.rank}.json",
            {"step": st.step, "momentum": slots},
            generation=gen,
            torn=torn,
            late=late,
        )

    def load(self, sim: Sim, reader_rank: int) -> m.TrainState:
        """What `load_step()` returns: no integrity check. ValueError/OSError if unreadable."""
        gen = sim.generation + 1
        if sim.schedule.layout == "dp":
            return m.TrainState.from_dict(sim.read_json(self.root / "state.json", gen, reader_rank))
        meta = sim.read_json(self.root / "model.json", gen, reader_rank)
        mom: list[int | None] = [None] * m.N_PARAMS
        for path in sorted(self.root.glob("optim-*.json")):
            for j, v in sim.read_json(path, gen, reader_rank)["momentum"].items():
                mom[int(j)] = int(v)
        return m.TrainState(
            int(meta["step"]), tuple(meta["params"]), tuple(mom), int(meta["rng"]), int(meta["data_pos"])
        )

    def files(self, layout: str, rank: int) -> list[Path]:
        if layout == "dp":
            return [self.root / "state.json"]
        return [self.root / f"optim-{rank}.json"]


class _Base:
    name = ""
    kills_all_on_fault = False

    def __init__(self) -> None:
        self.ckpt: _PlainCheckpoint  # made by setup(), before any other call

    def initial_procs(self, sim: Sim) -> list[Proc]:
        w = sim.schedule.world
        s0 = m.initial_state(sim.schedule.seed)
        procs = []
        for r in range(w):
            st = s0 if sim.schedule.layout == "dp" else s0.restricted(m.owned(w, r))
            procs.append(Proc(r, new_incarnation(r), 1, w, st, 0))
        return procs

    def setup(self, sim: Sim) -> None:
        self.ckpt = _PlainCheckpoint(sim.dir / "ckpt")
        procs = self.initial_procs(sim)
        for p in procs:
            self.ckpt.write(sim, p)
        sim.start(procs)

    def on_fault(self, sim: Sim) -> None:
        """The fault struck (before any rank reacted): nothing to note for a plain script."""

    def commit(self, sim: Sim, p: Proc, step: int) -> None:
        """A plain script records nothing per step."""

    def checkpoint(self, sim: Sim, p: Proc, step: int, torn: bool = False) -> None:
        self.ckpt.write(sim, p, torn=torn)

    def accept_late(self, sim: Sim, p: Proc, item: Late) -> bool:
        return True  # nothing tells an old result from a new one

    def late_commit(self, sim: Sim, item: Late) -> bool | None:
        return None  # there is no commit record to write

    def late_activation(self, sim: Sim, item: Late) -> bool | None:
        return None  # there is no ledger: the rendezvous round is torchrun's business

    def late_shard(self, sim: Sim, item: Late) -> None:
        assert item.state is not None  # every checkpoint-shard Late carries the writer's state (Sim)
        ghost = Proc(item.rank, new_incarnation(item.rank), item.generation, sim.schedule.world, item.state, 0)
        self.ckpt.write(sim, ghost, late=True, generation=item.generation)

    def corrupt_newest(self, sim: Sim, rank: int) -> None:
        for path in self.ckpt.files(sim.schedule.layout, rank):
            corrupt_json_file(path)

    def durable(self, sim: Sim) -> tuple[int, m.TrainState] | None:
        try:
            st = self.ckpt.load(sim, 0)
        except (OSError, ValueError, KeyError):
            return None
        return st.step, st

    def claimed_steps(self, sim: Sim) -> int | None:
        return None  # no certificate: the oracle takes the ranks' own step

    def latency_s(self, sim: Sim, joined: int) -> float:
        raise NotImplementedError


class RestartAll(_Base):
    name = "restart-all"
    kills_all_on_fault = True  # the agent SIGTERMs every worker within ~60 ms

    def recover(self, sim: Sim) -> list[Proc]:
        w = sim.schedule.new_world
        procs = []
        for r in range(w):
            try:
                st = self.ckpt.load(sim, r)
            except (OSError, ValueError, KeyError) as exc:
                raise RuntimeError(
                    f"checkpoint unreadable ({type(exc).__name__}): the restarted workers "
                    f"crash in load_step() until --max-restarts is exhausted"
                ) from None
            if sim.schedule.layout == "zero1":
                st = st.restricted(m.owned(w, r))
            procs.append(Proc(r, new_incarnation(r), sim.generation + 1, w, st, st.step))
        sim.resume_step = min(p.state.step for p in procs)
        return procs

    def latency_s(self, sim: Sim, joined: int) -> float:
        return RESTART_ALL_S + sim.recover_wall_s


class CommunicatorOnly(_Base):
    name = "communicator-only"

    def recover(self, sim: Sim) -> list[Proc]:
        sch = sim.schedule
        survivors = sorted((p for p in sim.members if p.alive), key=lambda p: p.rank)
        w = sch.new_world
        members = []
        for new_rank, p in enumerate(survivors):  # shrink keeps the order, compacts the numbers
            p.rank, p.world, p.generation = new_rank, w, sim.generation + 1
            members.append(p)
        taken = {p.rank for p in members}
        for r in range(w):
            if r not in taken:  # a new process: its script loads the last checkpoint
                try:
                    st = self.ckpt.load(sim, r)
                except (OSError, ValueError, KeyError):
                    st = m.initial_state(sch.seed)  # nothing readable: it starts from scratch
                if sch.layout == "zero1":
                    st = st.restricted(m.owned(w, r))
                members.append(Proc(r, new_incarnation(r), sim.generation + 1, w, st, st.step))
        members.sort(key=lambda p: p.rank)
        sim.resume_step = min(p.state.step for p in members)
        return members

    def latency_s(self, sim: Sim, joined: int) -> float:
        return REGROUP_S + (SPAWN_S if joined else 0.0) + sim.recover_wall_s


STRATEGIES = ("restart-all", "communicator-only", "gpuguard")
