"""The zombie oracle (issue 23): a stale incarnation of generation G tries every sink once G+1 is active.

One definition for the test (`tests/recovery/runtime/test_zombie_oracle.py`) and the bench
(`bench/hosts.py`, on namespace hosts, as a process of its own):

    outcome = haunt(job_dir, ledger_url, rank=2, generation=1, snapshot_root=root, rounds=2)
    python -m gpuguard.examples.zombie --job-dir D --ledger URL --rank R --generation G [--rounds N]

The stale incarnation is rank R's member of G's certificate: its identity comes from the chain, its
credentials (the signing key) from the job dir, as a process of G left running would hold them. It
holds a live lease (fencing, not expiry, is what must stop it) and, `rounds` times, does what its code
does (docs/fencing.md, sink by sink):
- `frontier`: raises G's frontier record, and writes it as it leaves a check made before G+1 activated;
- `certificate`: activates a certificate of its own (G+1 again, from G);
- `report` and `refusal`: its report of G, a refusal of G (the in-place switch's etcd keys);
- `join`: the admission check joining G+1 runs first;
- `snapshot`: publishes a snapshot of G (through the writer's `still_current` check, and one that
  slipped past it: the check-then-rename race), newer than anything on disk;
- `heartbeat`: datagrams to a member of the active generation (stamped G, stamped as the active
  generation, and a member of both's beat of G replayed, where one is: in place, not on a restart),
  judged by `PeerHeartbeat.accept`, the rule every receiver applies. The receiver is built here from the active certificate (rank 0, the job's
  heartbeat key), not a live member's socket: a member's counters cannot be read from outside.

Each attempt is `refused` (the sink said no, or ignored it) or not, and `visible` when what a reader
of the active generation reads changed across it: the chain, the frontier records of G and of the
active generation, G's reports and refusal, the snapshot a restore would choose (newest first, the
chain's branch check applied); for `join`, being admitted; for `heartbeat`, being counted. The
reader is a connection of its own, not the zombie's. The ledger's `fenced` log grows (that is the
audit of refused frontier writes, read by nobody that acts) and so do the snapshot directories on
disk (a refused state stays as evidence): neither is a reader's view.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpuguard.foundation.errors import GpuguardError
from gpuguard.foundation.inplace_files import Report
from gpuguard.generation.certificate import issue
from gpuguard.generation.ledger_open import open_ledger
from gpuguard.generation.records import Certificate, Frontier, Member
from gpuguard.recovery.runtime import heartbeat as hb
from gpuguard.recovery.runtime.activation import branch_problem
from gpuguard.recovery.runtime.admission import admitted_certificate
from gpuguard.recovery.runtime.coordination_etcd import EtcdCoordination
from gpuguard.recovery.runtime.lease import LeaseTiming
from gpuguard.recovery.runtime.refusals import ActivationRefused
from gpuguard.recovery.snapshots.store import list_snapshots, save_snapshot, select_restorable

SINKS = ("frontier", "certificate", "report", "refusal", "join", "snapshot", "heartbeat")
MAX_ROUNDS = 20  # every loop bounded: a caller asking for more gets this many
ZOMBIE_LEASE_TTL_S = 30.0  # longer than the oracle runs: its lease is alive throughout


@dataclass(frozen=True)
class SinkTally:
    """One sink's attempts: how many, how many refused or ignored, how many a reader saw; why refused."""

    sink: str
    attempts: int = 0
    refused: int = 0
    visible: int = 0
    reasons: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "attempts": self.attempts,
            "refused": self.refused,
            "visible": self.visible,
            "reasons": list(self.reasons),
        }


@dataclass(frozen=True)
class Outcome:
    """What the stale incarnation tried and what became of it."""

    rank: int
    incarnation: str
    generation: int  # the zombie's
    active: int  # the generation active when it started
    rounds: int
    tallies: tuple[SinkTally, ...]
    changed: tuple[str, ...] = ()  # parts of the reader's view that differ from before the first attempt
    where: str = ""
    baseline: dict[str, Any] = field(default_factory=dict)  # what the reader saw first (summary)

    @property
    def attempts(self) -> int:
        return sum(t.attempts for t in self.tallies)

    @property
    def refused(self) -> int:
        return sum(t.refused for t in self.tallies)

    @property
    def visible(self) -> int:
        return sum(t.visible for t in self.tallies)

    def sink(self, name: str) -> SinkTally:
        return next(t for t in self.tallies if t.sink == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "incarnation": self.incarnation,
            "generation": self.generation,
            "active": self.active,
            "rounds": self.rounds,
            "where": self.where,
            "attempts": self.attempts,
            "refused": self.refused,
            "visible": self.visible,
            "changed": list(self.changed),
            "baseline": self.baseline,
            "sinks": {t.sink: t.to_dict() for t in self.tallies},
        }


@dataclass
class _Counter:
    tallies: dict[str, SinkTally] = field(default_factory=lambda: {s: SinkTally(s) for s in SINKS})

    def add(self, sink: str, refused: bool, visible: bool, reason: str = "") -> None:
        t = self.tallies[sink]
        reasons = t.reasons if not refused or not reason or reason in t.reasons else (*t.reasons, reason)
        self.tallies[sink] = SinkTally(
            sink, t.attempts + 1, t.refused + int(refused), t.visible + int(visible), reasons[:8]
        )


def reader_view(ledger: Any, coord: EtcdCoordination, snapshot_root: Path, generation: int) -> dict[str, Any]:
    """What anything after the switch reads (a restore, the next activation, a member of the active
    generation): the chain, the frontier records, generation `generation`'s coordination keys, and
    the snapshot a restore would choose."""
    history = ledger.history()
    active = history[-1]
    frontiers = {c.generation: c.frontier.step for c in history}

    def check(info: Any) -> str | None:
        return branch_problem(info.generation, info.step, frontiers, active.generation)

    chosen = select_restorable(snapshot_root, None, check=check).chosen
    return {
        "chain": [c.digest() for c in history],
        "frontier_stale": _frontier_doc(ledger, generation),
        "frontier_active": _frontier_doc(ledger, active.generation),
        "reports": sorted(
            (r, rep.incarnation_id, rep.committed_step) for r, rep in coord.read_reports(generation).items()
        ),
        "refusal": coord.refusal(generation),
        "restore": None if chosen is None else (chosen.step, chosen.generation, chosen.manifest_digest),
    }


def summary(view: dict[str, Any]) -> dict[str, Any]:
    """A reader's view in a few numbers: so a row shows what there was to disturb."""
    return {
        "chain": len(view["chain"]),
        "frontier_stale": None if view["frontier_stale"] is None else view["frontier_stale"][0],
        "frontier_active": None if view["frontier_active"] is None else view["frontier_active"][0],
        "reports": len(view["reports"]),
        "refusal": view["refusal"] is not None,
        "restore": None if view["restore"] is None else list(view["restore"][:2]),
    }


def _frontier_doc(ledger: Any, generation: int) -> Any:
    rec = ledger.frontier_record(generation)
    return None if rec is None else (rec.step, rec.by, rec.evidence)


def _member(cert: Certificate, rank: int) -> Member:
    member = next((m for m in cert.members if m.rank == rank), None)
    if member is None:
        raise GpuguardError(f"generation {cert.generation} has no member of rank {rank}")
    return member


@contextmanager
def _closing(*things: Any) -> Iterator[None]:
    try:
        yield
    finally:
        for t in things:
            try:
                t.close()
            except Exception:  # noqa: BLE001 - closing after the measurement: nothing left to protect
                pass


def haunt(
    job_dir: str | Path,
    url: str,
    *,
    rank: int,
    generation: int,
    snapshot_root: str | Path | None = None,
    rounds: int = 1,
    key: bytes | None = None,
    where: str = "",
) -> Outcome:
    """Run the oracle (module docstring): rank `rank`'s incarnation of `generation`, `rounds` rounds."""
    rounds = max(1, min(rounds, MAX_ROUNDS))
    root = Path(snapshot_root if snapshot_root is not None else job_dir)
    zl = open_ledger(job_dir, url, key=key)  # the zombie's connection, its credentials
    reader = open_ledger(job_dir, url, key=key)  # a reader of the active generation
    zc, rc = EtcdCoordination.from_url(url), EtcdCoordination.from_url(url)
    with _closing(zl, reader, zc, rc):
        if zl.key is None:
            raise GpuguardError(f"{job_dir}: no signing key: the stale incarnation's credentials are missing")
        stale = reader.get(generation)
        active = reader.require_active()
        if active.generation <= generation:
            raise GpuguardError(f"generation {active.generation} is active: {generation} is not stale yet")
        z = _member(stale, rank).incarnation
        # the receiver of the beats: the active generation's rank 0, watching its ring predecessor
        watched = hb.ring(0, len(active.members))[1][0] if len(active.members) > 1 else 0
        both = {m.incarnation.id for m in stale.members}
        survivor = next(
            (m.incarnation.id for m in active.members if m.rank == watched and m.incarnation.id in both), None
        )
        counter = _Counter()
        first = reader_view(reader, rc, root, generation)

        def attempt(sink: str, act: Callable[[], tuple[bool, str]], seen_if_taken: bool = False) -> None:
            """One attempt; visible when the reader's view changed across it, or (a join, a beat) when
            taking it is itself the effect."""
            before = reader_view(reader, rc, root, generation)
            refused, reason = act()
            changed = reader_view(reader, rc, root, generation) != before
            counter.add(sink, refused, changed or (seen_if_taken and not refused), reason)

        zc.hold_lease(z.id, {"rank": rank}, LeaseTiming(ZOMBIE_LEASE_TTL_S), lambda why: None)
        hb_key = hb.derive_key(zl.key)
        det = hb.PeerHeartbeat(
            hb.open_socket("127.0.0.1"),
            key=hb_key,
            job_id=active.job_id,
            generation=active.generation,
            rank=0,
            incarnation_id=_member(active, 0).incarnation.id,
            peers={m.rank: hb.Peer(m.rank, m.incarnation.id, ("127.0.0.1", 9)) for m in active.members},
            config=hb.HeartbeatConfig(0.1, 5),
            on_suspect=lambda r, s: None,
        )
        with _closing(det):
            for n in range(rounds):
                step = 10**6 + n  # past any real step: if a write landed, a reader would see it
                _round(zl, zc, det, attempt, stale, active, z, (watched, survivor), root, step, hb_key)
        last = reader_view(reader, rc, root, generation)
        return Outcome(
            rank,
            z.id,
            generation,
            active.generation,
            rounds,
            tuple(counter.tallies[s] for s in SINKS),
            tuple(k for k in first if first[k] != last[k]),
            where,
            summary(first),
        )


def _round(
    zl: Any,
    zc: EtcdCoordination,
    det: hb.PeerHeartbeat,
    attempt: Callable[..., None],
    stale: Certificate,
    active: Certificate,
    z: Any,
    watched: tuple[int, str | None],
    root: Path,
    step: int,
    hb_key: bytes,
) -> None:
    g = stale.generation
    # 1. the frontier record ("every member committed through `step`"); and the same write after its
    #    check passed, before the next generation activated (the window): the transaction refuses it
    attempt("frontier", lambda: (not zl.record_frontier(g, step, z.id, "barrier"), "record_frontier refused"))

    def window() -> tuple[bool, str]:
        _, token = zl._read_frontier(g)  # noqa: SLF001 - the write as it leaves a check made too early
        ok = zl._write_frontier(g, json.dumps({"late": step}).encode() + b"\n", token)  # noqa: SLF001
        return not ok, "frontier transaction: active is not G"

    attempt("frontier", window)

    # 2. a certificate of its own: the next generation again, from G
    def certificate() -> tuple[bool, str]:
        cert = issue(
            parent=stale,
            job_id=stale.job_id,
            members=stale.members,
            reason="rank-failure",
            frontier=Frontier(active.frontier.step, "", {"default": active.frontier.step}),
            quiescence="proved",
            quiescence_evidence=("all workers exited",),
            issued_by=z.id,
            key=zl.key,
        )
        try:
            zl.activate(cert)
        except GpuguardError as e:
            return True, "compare-and-swap" if "compare-and-swap" in str(e) else str(e)[:120]
        return False, ""

    attempt("certificate", certificate)
    # 3. its report of G, and 4. a refusal of G
    late = Report(g, z_rank(stale, z.id), z.id, z.pid, z.host, step, {}, "late", 0.0)
    attempt("report", lambda: (not zc.write_report(late), "report transaction: active is not G"))
    before = zc.refusal(g)

    def refusal() -> tuple[bool, str]:
        zc.record_refusal(g, {"generation": g, "reason": "zombie", "by": z.id, "step": step})
        return zc.refusal(g) == before, "refusal transaction: active is not G"

    attempt("refusal", refusal)

    # 5. joining the active generation: the admission check comes first
    def join() -> tuple[bool, str]:
        try:
            admitted_certificate(zl, active.generation, incarnation_id=z.id)
        except ActivationRefused as e:
            return True, "does not admit" if "does not admit" in str(e) else str(e)[:120]
        return False, ""

    attempt("join", join, seen_if_taken=True)  # admitted: it would form groups with the members

    # 6. a snapshot of G: the publish check refuses it; one that slips past the check (the
    #    check-then-rename race) is refused at read, by the chain
    state = {"model": {"w": torch.ones(4)}}
    # newer than anything on disk and past the active generation's frontier: the first a reader meets
    top = max([active.frontier.step, *(s.step for s in list_snapshots(root))]) + 1
    owner = f"rank{z_rank(stale, z.id)}/{z.id}"

    def checked() -> tuple[bool, str]:
        still = lambda: zl.active().generation == g  # noqa: E731 - the writer's own still_current
        return save_snapshot(root, top, state, generation=g, owner=owner, still_current=still) is None, "still_current"

    def raced() -> tuple[bool, str]:
        info = save_snapshot(root, top + 1, state, generation=g, owner=owner)
        frontiers = {c.generation: c.frontier.step for c in zl.history()}
        problem = branch_problem(info.generation if info else g, top + 1, frontiers, active.generation)
        return problem is not None, "superseded branch" if problem else ""

    attempt("snapshot", checked)
    attempt("snapshot", raced)

    # 7. heartbeats to a member of the active generation: stamped G, stamped as the active generation,
    #    and a member of both's beat of G (delayed, or replayed)
    rank, survivor = watched
    beats = [(g, z.id), (active.generation, z.id)] + ([(g, survivor)] if survivor else [])
    for stamp, who in beats:
        packet = hb.encode(hb_key, active.job_id, stamp, rank, who, step)
        attempt(
            "heartbeat",
            lambda p=packet: (not det.accept(p, time.monotonic()), "not its generation or incarnation"),
            True,
        )


def z_rank(cert: Certificate, incarnation_id: str) -> int:
    return next(m.rank for m in cert.members if m.incarnation.id == incarnation_id)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job-dir", required=True)
    ap.add_argument("--ledger", required=True, help="etcd://host:port/prefix")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--generation", type=int, required=True)
    ap.add_argument("--snapshot-root", default=None)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--where", default="")
    args = ap.parse_args(argv)
    out = haunt(
        args.job_dir,
        args.ledger,
        rank=args.rank,
        generation=args.generation,
        snapshot_root=args.snapshot_root,
        rounds=args.rounds,
        where=args.where,
    )
    print(json.dumps(out.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
