"""The `gpuguard` strategy: certified activation through the real `gpuguard.generation` code.

Nothing here re-implements a rule: commit records and their fencing are `Ledger.record_commit`,
the frontier is `Ledger.last_committed_by_all`, the certificate is `certificate.issue` checked by
`certificate.check` and activated by the directory ledger's compare-and-swap (`Ledger.activate`),
checkpoints are described by `manifest` entries (BLAKE3 per object, owner incarnation, generation,
step) and restored only when `verify_manifest` finds them complete and valid. The one local
decision is the runtime's: a result stamped with a generation/incarnation that is not the
ledger's active member is dropped (the same test `record_commit` applies to commit records).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from gpuguard.foundation.errors import GpuguardError
from gpuguard.generation.certificate import check, issue
from gpuguard.generation.job import init_job
from gpuguard.generation.keys import load_key
from gpuguard.generation.ledger import Ledger
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.generation.manifest import (
    MANIFEST_FILE,
    Manifest,
    ObjectSpec,
    build_entries,
    load_manifest,
    verify_manifest,
    write_manifest,
)
from gpuguard.generation.records import Certificate, Frontier, Member
from gpuguard.transitions import model as m
from gpuguard.transitions.sim import Late, Proc, Sim, new_incarnation
from gpuguard.transitions.strategies import REGROUP_S, SPAWN_S, _Base

ISSUER = "gpuguard-bench"
SNAPSHOTS_KEPT = 3


def object_keys() -> list[str]:
    """Every logical object of the training state: the ownership map's domain."""
    return (
        [f"model.params.{j}" for j in range(m.N_PARAMS)]
        + [f"optim.momentum.{j}" for j in range(m.N_PARAMS)]
        + ["rng.state", "loader.position", "train.step"]
    )


def objects_of(state: m.TrainState, world: int, rank: int) -> list[tuple[str, int]]:
    """The objects `rank` writes: its slots of parameters and momentum; rank 0 also the scalars."""
    out = []
    for j in m.owned(world, rank):
        out.append((f"model.params.{j}", state.params[j]))
        mom = state.momentum[j]
        out.append((f"optim.momentum.{j}", 0 if mom is None else mom))
    if rank == 0:
        out += [("rng.state", state.rng), ("loader.position", state.data_pos), ("train.step", state.step)]
    return out


class Certified(_Base):
    name = "gpuguard"

    def __init__(self) -> None:
        super().__init__()
        self.job: Path  # setup() makes the job dir and the ledger, before any other call
        self.key = b""
        self.ledger: Ledger
        self.handles: dict[str, Ledger] = {}  # per incarnation: each process has its own view
        self.written: dict[tuple[int, int], dict[int, list[ObjectSpec]]] = {}
        self.rejected: list[str] = []

    # -- set-up -------------------------------------------------------------------------------
    def _handle(self, inc_id: str) -> Ledger:
        h = self.handles.get(inc_id)
        if h is None:
            h = self.handles[inc_id] = open_ledger(self.job, key=self.key)
        return h

    def setup(self, sim: Sim) -> None:
        self.job = sim.dir / "job"
        res = init_job(self.job, job_id=f"bench-{sim.schedule.name}")
        self.key = load_key(self.job)
        self.ledger = res.ledger
        procs = self.initial_procs(sim)
        s0 = m.initial_state(sim.schedule.seed)
        cert = issue(
            parent=res.genesis,
            job_id=res.genesis.job_id,
            members=[Member(p.rank, p.incarnation) for p in procs],
            reason="start",
            frontier=Frontier(0, s0.digest(), {"default": 0}),
            quiescence="proved",
            quiescence_evidence=("fresh job: no previous members",),
            ownership_map_version=1,
            issued_by=ISSUER,
            key=self.key,
            extra={"layout": sim.schedule.layout, "source": "initial"},
        )
        self.ledger.activate(cert)
        for p in procs:
            self._join(p, cert, p.state)
        for p in procs:
            self.checkpoint(sim, p, 0)
        sim.start(procs)

    def _join(self, p: Proc, cert: Certificate, state: m.TrainState) -> None:
        p.data["cert"] = cert
        p.data["snap"] = {state.step: state}
        self._handle(p.incarnation.id)

    # -- per step -------------------------------------------------------------------------
    def commit(self, sim: Sim, p: Proc, step: int) -> None:
        t0 = time.perf_counter()
        ok = self._handle(p.incarnation.id).record_commit(p.data["cert"].generation, step, p.rank, p.incarnation.id)
        sim.sync_ops += 1
        sim.sync_s += time.perf_counter() - t0
        if not ok:
            raise GpuguardError(f"rank {p.rank} was fenced while a member of the active generation")
        snaps = p.data["snap"]
        snaps[step] = p.state
        for old in sorted(snaps)[:-SNAPSHOTS_KEPT]:
            del snaps[old]

    def _ckpt_dir(self, sim: Sim, generation: int, step: int) -> Path:
        return sim.dir / "ckpt" / f"g{generation}-s{step}"

    def _write_shard(
        self,
        sim: Sim,
        directory: Path,
        state: m.TrainState,
        world: int,
        rank: int,
        *,
        generation: int,
        torn: bool = False,
        late: bool = False,
    ) -> list[ObjectSpec]:
        name = f"__{rank}_0.distcp"
        specs, chunks, offset = [], [], 0
        for fqn, value in objects_of(state, world, rank):
            raw = json.dumps(value).encode() + b"\n"
            specs.append(ObjectSpec(fqn, "bytes", None, None, None, None, name, offset, len(raw)))
            chunks.append(raw)
            offset += len(raw)
        sim.write_bytes(
            directory / name, b"".join(chunks), generation=generation, torn=torn, late=late, atomic=not torn
        )
        return specs

    def checkpoint(self, sim: Sim, p: Proc, step: int, torn: bool = False) -> None:
        cert = p.data["cert"]
        directory = self._ckpt_dir(sim, cert.generation, step)
        specs = self._write_shard(sim, directory, p.state, p.world, p.rank, generation=cert.generation, torn=torn)
        if torn:
            return
        done = self.written.setdefault((cert.generation, step), {})
        done[p.rank] = specs
        if len(done) == len(cert.members):  # the checkpoint barrier: rank 0 seals it with a manifest
            t0 = time.perf_counter()
            entries = build_entries(
                [s for r in sorted(done) for s in done[r]],
                directory,
                step=step,
                generation=cert.generation,
                owners=cert.ranks,
                values=False,
            )
            write_manifest(Manifest(cert.generation, step, tuple(entries), cert.ownership_map_version), directory)
            sim.sync_ops += 1
            sim.sync_s += time.perf_counter() - t0

    # -- faults and late results -------------------------------------------------------------
    def corrupt_newest(self, sim: Sim, rank: int) -> None:
        newest = self._manifests(sim)
        if not newest:
            return
        path = newest[0][2] / f"__{rank}_0.distcp"
        raw = bytearray(path.read_bytes())
        for i, b in enumerate(raw):
            if 0x31 <= b <= 0x38:  # a digit 1..8: +1 keeps the file parseable
                raw[i] = b + 1
                break
        path.write_bytes(bytes(raw))

    def accept_late(self, sim: Sim, p: Proc, item: Late) -> bool:
        """The runtime's fence: only the active generation's member on that rank may write here."""
        active = self._handle(p.incarnation.id).active()
        holder = active.ranks.get(item.rank) if active is not None else None
        return (
            active is not None
            and item.generation == active.generation
            and holder is not None
            and holder.id == item.incarnation_id
        )

    def late_commit(self, sim: Sim, item: Late) -> bool | None:
        handle = self._handle(item.incarnation_id)
        generation = item.generation
        if item.tag == "claims-active":  # same rank number, active generation, but its old incarnation
            generation = handle.require_active().generation
        return handle.record_commit(generation, item.step, item.rank, item.incarnation_id)

    def late_activation(self, sim: Sim, item: Late) -> bool | None:
        """The old coordinator's activation of its own next generation, in flight when the fault struck:
        it names the old members and the old frontier. The ledger's compare-and-swap must refuse it."""
        handle = self._handle(item.incarnation_id)
        parent = handle.get(item.generation)
        cert = issue(
            parent=parent,
            job_id=parent.job_id,
            members=parent.members,
            reason="late coordinator",
            frontier=parent.frontier,
            quiescence="proved",
            quiescence_evidence=("old coordinator",),
            ownership_map_version=parent.ownership_map_version,
            issued_by=f"{ISSUER}-late",
            key=self.key,
        )
        try:
            handle.activate(cert)
        except GpuguardError:
            return False
        return True

    def late_shard(self, sim: Sim, item: Late) -> None:
        assert item.state is not None  # every checkpoint-shard Late carries the writer's state (Sim)
        directory = self._ckpt_dir(sim, item.generation, item.step)
        self._write_shard(
            sim, directory, item.state, sim.schedule.world, item.rank, generation=item.generation, late=True
        )

    # -- restore ------------------------------------------------------------------------------
    def _manifests(self, sim: Sim, at_or_before: int | None = None) -> list[tuple[int, int, Path]]:
        """(step, generation, dir) of checkpoints that have a manifest, newest step first."""
        out = []
        for path in (sim.dir / "ckpt").glob(f"g*-s*/{MANIFEST_FILE}"):
            g, s = path.parent.name[1:].split("-s")
            if at_or_before is None or int(s) <= at_or_before:
                out.append((int(s), int(g), path.parent))
        return sorted(out, reverse=True)

    def _load_verified(self, sim: Sim, directory: Path, reader_gen: int) -> tuple[Manifest, m.TrainState] | None:
        try:
            manifest = load_manifest(directory)
        except GpuguardError as exc:
            self.rejected.append(f"{directory.name}: {exc}")
            return None
        problems = verify_manifest(manifest, directory, expected=object_keys())
        if problems:
            self.rejected.append(f"{directory.name}: {problems[0]}")
            return None
        values: dict[str, int] = {}
        for e in manifest.entries:
            path = directory / e.spec.file
            with open(path, "rb") as f:
                f.seek(e.spec.byte_offset)
                values[e.spec.fqn] = int(json.loads(f.read(e.spec.byte_length)))
            sim.note_read(path, reader_gen, e.owner_rank, manifest.step)
        state = m.TrainState(
            values["train.step"],
            tuple(values[f"model.params.{j}"] for j in range(m.N_PARAMS)),
            tuple(values[f"optim.momentum.{j}"] for j in range(m.N_PARAMS)),
            values["rng.state"],
            values["loader.position"],
        )
        return manifest, state

    def _from_survivors(self, survivors: list[Proc], step: int) -> m.TrainState | None:
        """The state at `step` from the survivors' committed snapshots, if they agree and cover it."""
        snaps = [p.data["snap"].get(step) for p in survivors]
        if not snaps or any(s is None for s in snaps):
            return None
        head = snaps[0]
        if any(
            (s.step, s.params, s.rng, s.data_pos) != (head.step, head.params, head.rng, head.data_pos) for s in snaps
        ):
            return None  # replicas disagree: not a state anyone may continue from
        mom: list[int | None] = [None] * m.N_PARAMS
        for s in snaps:
            for j, v in enumerate(s.momentum):
                if v is None:
                    continue
                if mom[j] is not None and mom[j] != v:
                    return None
                mom[j] = v
        if any(v is None for v in mom):
            return None  # an optimizer shard died with its owner
        return m.TrainState(head.step, head.params, tuple(mom), head.rng, head.data_pos)

    def recover(self, sim: Sim) -> list[Proc]:
        sch = sim.schedule
        parent = self.ledger.require_active()
        survivors = sorted((p for p in sim.members if p.alive), key=lambda p: p.rank)
        alive_ids = {p.incarnation.id for p in survivors}
        committed = self.ledger.last_committed_by_all(parent.generation)
        frontier_step = parent.frontier.step if committed is None else committed
        state = self._from_survivors(survivors, frontier_step)
        source, manifest_ok, digest = "survivor", None, ""
        if state is not None:
            digest = state.digest()
        else:
            for _step, _gen, directory in self._manifests(sim, frontier_step):
                loaded = self._load_verified(sim, directory, parent.generation + 1)
                if loaded is not None:
                    manifest, state = loaded
                    source, manifest_ok, digest = "checkpoint", True, manifest.digest
                    break
            if state is None:
                raise RuntimeError(
                    f"no complete, verified state at or before step {frontier_step} "
                    f"({'; '.join(self.rejected) or 'no checkpoint'})"
                )
        w = sch.new_world
        members: list[Proc] = []
        for new_rank, p in enumerate(survivors):
            p.rank = new_rank
            members.append(p)
        for r in range(len(members), w):
            members.append(Proc(r, new_incarnation(r), parent.generation + 1, w, state, state.step))
        evidence = []
        for old in parent.members:
            if old.incarnation.id not in alive_ids:
                how = (
                    "unreachable (not confirmed dead): its later writes are fenced by generation and incarnation"
                    if sch.zombie
                    else "exited (process gone)"
                )
                evidence.append(f"rank {old.rank} incarnation {old.incarnation.id}: {how}")
        evidence.append(
            f"in-flight work of generation {parent.generation} aborted; the new generation starts "
            f"from step {state.step} ({source}); results stamped {parent.generation} are fenced"
        )
        cert = issue(
            parent=parent,
            job_id=parent.job_id,
            members=[Member(p.rank, p.incarnation) for p in members],
            reason=sch.fault,
            frontier=Frontier(state.step, digest, {"default": 2 * state.step}),
            quiescence="rolled_back",
            quiescence_evidence=evidence,
            ownership_map_version=parent.ownership_map_version + (1 if w != len(parent.members) else 0),
            issued_by=ISSUER,
            key=self.key,
            extra={"switch": "in-place", "source": source, "layout": sch.layout, "world": w},
        )
        violations = check(cert, parent=parent, key=self.key, committed_by_all=committed, manifest_ok=manifest_ok)
        if violations:
            raise RuntimeError("certificate refused: " + "; ".join(f"{v.rule}: {v.message}" for v in violations))
        self.ledger.activate(cert, manifest_ok=manifest_ok)  # compare-and-swap; RefusedError if it lost
        for p in members:
            mine = state if sch.layout == "dp" else state.restricted(m.owned(w, p.rank))
            if p.incarnation.id not in alive_ids and state.digest() != digest and source == "survivor":
                raise RuntimeError("state transfer to a new member does not match the frontier digest")
            p.world, p.generation, p.state, p.base_step, p.history = w, cert.generation, mine, state.step, []
            p.data.pop("stale", None)
            self._join(p, cert, mine)
        sim.resume_step = state.step
        return members

    # -- the outcome ---------------------------------------------------------------------------
    def claimed_steps(self, sim: Sim) -> int | None:
        active = self.ledger.require_active()
        return self.ledger.last_committed_by_all(active.generation)

    def durable(self, sim: Sim) -> tuple[int, m.TrainState] | None:
        active = self.ledger.require_active()
        for _step, _gen, directory in self._manifests(sim):
            loaded = self._load_verified(sim, directory, active.generation + 1)
            if loaded is not None:
                return loaded[1].step, loaded[1]
        return None

    def latency_s(self, sim: Sim, joined: int) -> float:
        return REGROUP_S + (SPAWN_S if joined else 0.0) + sim.recover_wall_s
