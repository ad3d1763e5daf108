"""Read a live torchrun job's rendezvous state, torch-free, force exactly one new round, bind rounds.

Why: the rendezvous `round` is the job's own generation counter, readable from outside in well under
a millisecond, and the only safe lever to make a healthy agent re-rendezvous is a transient
`wait_list` entry (a signal to the agent either shuts everything down or orphans the workers). The
entry must vanish with the round change, else every new round sees it again: a restart storm. We
inject a participant agent's own descriptor, which that agent removes itself when it joins.

The state is `base64(pickle(_RendezvousState))` under `torch.rendezvous.<run_id>` (on etcd sealed
with the job's rendezvous secret: `signed_state`). It is decoded with a restricted unpickler that
maps torch's two classes to local stubs and refuses everything else, in a forked worker with a
deadline (`load_state`), its fields' types checked, and written back by a pickler that names
torch's classes without importing torch.

Both backends hold that state: torch's `c10d` (a TCPStore on an agent, read with `tcpstore`) and
gpuguard's (`rdzv_etcd`, on etcd v3, read with `rendezvous_etcd`, whose client has the TCPStore
client's `get`/`compare_set`/`set`), so reading, the trigger and the bindings are one code path.

Round bindings: the restart path's coordinator, once it has activated generation G in round R,
records `{generation, digest, job_id, time}` under `gpuguard/rdzv-round/<run id>/<R>` next to the
state (etcd: `<prefix>/<run id>/rounds/<R>`, on the run's lease). torch reads only its own keys. A
round with no such key is "not yet certified".
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import pickle
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from gpuguard.collectors.torchrun import torchrun_agents
from gpuguard.foundation.errors import DataError, NoInputError, RefusedError, UnavailableError, UsageError, one_line
from gpuguard.foundation.jobdir import read_incarnations
from gpuguard.foundation.unpickle import admit, brief
from gpuguard.foundation.workers import restricted_loads_within
from gpuguard.recovery.rendezvous.etcd_keys import ROUND_KEY, TRIGGER_KEY, EtcdRendezvousClient, parse_conf
from gpuguard.recovery.rendezvous.tcpstore import StoreClient, parse_endpoint

TORCH_MODULE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
NULL_SENTINEL = b"Y2FuaW1hZGFt"  # torch's "no state yet"
LEASE_PREFIX = TRIGGER_KEY
ROUND_PREFIX = ROUND_KEY
ROUND_SCHEMA = "gpuguard.rdzv-round/1"
BACKENDS = ("c10d", "gpuguard")
ETCD_PORT = 2379


@dataclass(eq=True, order=True, frozen=True)
class NodeDesc:
    """Stub of torch's `_NodeDesc` (same fields, same hash and order)."""

    addr: str
    pid: int
    local_id: int

    def __repr__(self) -> str:
        return f"{self.addr}_{self.pid}_{self.local_id}"


class RendezvousState:
    """Stub of torch's `_RendezvousState`: attributes only, filled by the unpickler."""

    round: int
    complete: bool
    deadline: datetime | None
    closed: bool
    participants: dict[NodeDesc, int]
    wait_list: set[NodeDesc]
    redundancy_list: set[NodeDesc]
    last_heartbeats: dict[NodeDesc, datetime]

    def __init__(self) -> None:
        self.round = 0
        self.complete = False
        self.deadline = None
        self.closed = False
        self.participants = {}
        self.wait_list = set()
        self.redundancy_list = set()
        self.last_heartbeats = {}

    def to_json(self, now: datetime | None = None) -> dict[str, Any]:
        now = now or datetime.now(timezone.utc)
        return {
            "round": self.round,
            "complete": self.complete,
            "closed": self.closed,
            "deadline": self.deadline.isoformat() if self.deadline else None,
            "participants": {repr(n): r for n, r in sorted(self.participants.items())},
            "wait_list": sorted(repr(n) for n in self.wait_list),
            "redundancy_list": sorted(repr(n) for n in self.redundancy_list),
            "last_heartbeat_age_s": {
                repr(n): round((now - t).total_seconds(), 3) for n, t in sorted(self.last_heartbeats.items())
            },
        }


_ALLOWED: dict[tuple[str, str], Any] = {
    (TORCH_MODULE, "_NodeDesc"): NodeDesc,
    (TORCH_MODULE, "_RendezvousState"): RendezvousState,
    ("datetime", "datetime"): datetime,
    ("datetime", "timezone"): timezone,
    ("datetime", "timedelta"): timedelta,
}
_TORCH_NAMES = {NodeDesc: (TORCH_MODULE, "_NodeDesc"), RendezvousState: (TORCH_MODULE, "_RendezvousState")}


_PurePickler: Any = pickle._Pickler  # noqa: SLF001 - the pure-Python pickler: save_global is overridable (typeshed lists none of its save hooks)


class _TorchNamePickler(_PurePickler):
    def save_global(self, obj: Any, name: str | None = None) -> None:
        target = _TORCH_NAMES.get(obj)
        if target is None:
            super().save_global(obj, name)
            return
        self.save(target[0])
        self.save(target[1])
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def decode_state(raw: bytes) -> RendezvousState | None:
    """The store value (base64 pickle) → state; None for torch's "no state" sentinel."""
    if raw == NULL_SENTINEL:
        return None
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise DataError("rendezvous state is not base64") from None
    return load_state(data)


def load_state(data: bytes) -> RendezvousState:
    """A pickled `_RendezvousState` → our stub, or one `DataError` (65).

    Untrusted bytes: the restricted unpickler (torch's two classes and datetimes only), in a forked
    worker killed at its deadline (`foundation.workers`: a shared-reference dict key is hashed
    without end inside the C load, which nothing in this process could interrupt; a Ctrl-C here
    ends the wait at once), then every field's type is checked, so nothing later (the JSON, the
    trigger's compare-and-set) meets a value of the wrong shape."""
    try:
        state = restricted_loads_within(data, admit(_ALLOWED), what="rendezvous state")
    except Exception as exc:  # any malformed pickle, a refused global, a load past its deadline
        why = "".join(c if c.isprintable() else " " for c in one_line(exc))
        raise DataError(f"rendezvous state cannot be decoded: {why}") from None
    problem = _shape_problem(state)
    if problem:
        raise DataError(f"rendezvous state is not a _RendezvousState: {problem}")
    return state


def _is_node(value: Any) -> bool:
    return (
        isinstance(value, NodeDesc)
        and type(getattr(value, "addr", None)) is str
        and type(getattr(value, "pid", None)) is int
        and type(getattr(value, "local_id", None)) is int
    )


def _shape_problem(state: Any) -> str | None:
    """What is wrong with a loaded state's shape (None: every field has torch's type)."""
    if not isinstance(state, RendezvousState):
        return f"it is {brief(state)}"
    fields = getattr(state, "__dict__", {})
    checks: list[tuple[str, Callable[[Any], bool]]] = [
        ("round", lambda v: type(v) is int and v >= 0),
        ("complete", lambda v: type(v) is bool),
        ("closed", lambda v: type(v) is bool),
        ("deadline", lambda v: v is None or type(v) is datetime),
        ("participants", lambda v: type(v) is dict and all(_is_node(n) and type(r) is int for n, r in v.items())),
        ("wait_list", lambda v: type(v) is set and all(map(_is_node, v))),
        ("redundancy_list", lambda v: type(v) is set and all(map(_is_node, v))),
        (
            "last_heartbeats",
            lambda v: type(v) is dict and all(_is_node(n) and type(t) is datetime for n, t in v.items()),
        ),
    ]
    for name, ok in checks:
        if name not in fields:
            return f"no field {name!r}"
        if not ok(fields[name]):
            return f"field {name!r} holds {brief(fields[name])} of the wrong type"
    return None


def encode_state(state: RendezvousState) -> bytes:
    """State → the store value torch's agent reads (pickle naming torch's classes, base64)."""
    buf = io.BytesIO()
    _TorchNamePickler(buf, protocol=4).dump(state)
    return base64.b64encode(buf.getvalue())


# --- finding the rendezvous ------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """Where a run's rendezvous lives: a c10d TCPStore (host, port) or etcd (`etcd`, the endpoint list)."""

    host: str
    port: int
    run_id: str
    agent_pid: int | None = None
    source: str = "options"
    backend: str = "c10d"
    etcd: str = ""  # gpuguard backend: the whole --rdzv-endpoint (host:port[,host:port...])
    conf: tuple[tuple[str, str], ...] = ()  # gpuguard backend: the agent's --rdzv-conf
    job_dir: str = ""  # gpuguard backend: where the rendezvous secret may come from (its generation.key)

    @property
    def key(self) -> str:
        return f"torch.rendezvous.{self.run_id}"

    def where(self) -> str:
        return f"etcd {self.etcd}" if self.backend == "gpuguard" else f"{self.host}:{self.port}"

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "run_id": self.run_id,
            "agent_pid": self.agent_pid,
            "source": self.source,
            "backend": self.backend,
        }
        if self.backend == "gpuguard":
            doc["endpoints"] = self.etcd
            doc["key_prefix"] = dict(self.conf).get("key_prefix", "/gpuguard/rdzv")
        return doc


def endpoint_of(
    endpoint: str,
    run_id: str,
    *,
    backend: str | None = None,
    conf: str | None = None,
    agent_pid: int | None = None,
    source: str = "options",
) -> Endpoint:
    """An `Endpoint` from torchrun's options (--rdzv-endpoint, --rdzv-id, --rdzv-backend, --rdzv-conf)."""
    backend = (backend or "c10d").strip().lower()
    if backend not in BACKENDS:
        raise UsageError(f"rendezvous backend {backend!r} is not supported here: {' or '.join(BACKENDS)}")
    if backend == "c10d":
        host, port = parse_endpoint(endpoint)
        return Endpoint(host, port, run_id, agent_pid, source)
    first = endpoint.split(",")[0].strip()
    host, port = parse_endpoint(first.split("://", 1)[-1].rstrip("/"), default_port=ETCD_PORT)
    pairs = tuple(sorted(parse_conf(conf).items()))
    return Endpoint(host, port, run_id, agent_pid, source, "gpuguard", endpoint.strip(), pairs)


def find_endpoint(
    *,
    endpoint: str | None = None,
    run_id: str | None = None,
    job_dir: Path | None = None,
    agent_pid: int | None = None,
    backend: str | None = None,
    conf: str | None = None,
) -> Endpoint:
    """Where the rendezvous lives: from the options, else from the live agent's command line.

    The agent is the one recorded in the job dir's incarnations (its `agent_pid`), or the only
    torchrun agent on this host. With `--rdzv-endpoint`, a live agent started with that endpoint
    and run id names what the options leave out: the backend and its --rdzv-conf (the etcd key
    prefix, TLS files). Without one, a list of several endpoints is etcd (gpuguard), one is c10d.
    """
    if endpoint:
        if backend is None or conf is None:
            for _pid, _argv, opts in torchrun_agents():
                same = opts.get("rdzv_endpoint") == endpoint and opts.get("rdzv_id", "none") == (run_id or "none")
                if same and (backend is None or backend == opts.get("rdzv_backend")):
                    backend, conf = opts.get("rdzv_backend"), conf if conf is not None else opts.get("rdzv_conf")
                    break
        if backend is None:
            backend = "gpuguard" if "," in endpoint else "c10d"
        ep = endpoint_of(endpoint, run_id or "none", backend=backend, conf=conf, agent_pid=agent_pid)
        return replace(ep, job_dir=str(job_dir)) if job_dir is not None else ep
    agents = torchrun_agents()
    if agent_pid is None and job_dir is not None:
        agent_pid, recorded_run_id = _agent_from_job_dir(job_dir)
        run_id = run_id or recorded_run_id
    if agent_pid is not None:
        agents = [a for a in agents if a[0] == agent_pid]
    agents = [a for a in agents if a[2].get("rdzv_endpoint") or a[2].get("standalone")]
    if run_id:
        agents = [a for a in agents if a[2].get("rdzv_id", "none") == run_id or a[2].get("standalone")]
    if not agents:
        raise NoInputError("no live torchrun agent found: pass --rdzv-endpoint HOST:PORT and --run-id")
    if len(agents) > 1:
        pids = ", ".join(str(a[0]) for a in agents)
        raise UsageError(f"several torchrun agents ({pids}): pass --rdzv-endpoint/--run-id or --job-dir")
    pid, _argv, opts = agents[0]
    if opts.get("standalone"):
        raise UsageError(f"torchrun agent {pid} runs --standalone (random endpoint): pass --rdzv-endpoint/--run-id")
    ep = endpoint_of(
        opts["rdzv_endpoint"],
        opts.get("rdzv_id", "none"),
        backend=backend or opts.get("rdzv_backend"),
        conf=conf if conf is not None else opts.get("rdzv_conf"),
        agent_pid=pid,
        source="agent-cmdline",
    )
    return replace(ep, job_dir=str(job_dir)) if job_dir is not None else ep


def open_client(ep: Endpoint, timeout: float = 5.0) -> Any:
    """A connected client of the rendezvous store (TCPStore or etcd), a context manager."""
    if ep.backend == "gpuguard":
        return EtcdRendezvousClient(ep.etcd, ep.run_id, dict(ep.conf), timeout, job_dir=ep.job_dir or None)
    return StoreClient(ep.host, ep.port, timeout)


def _agent_from_job_dir(job_dir: Path) -> tuple[int | None, str | None]:
    """The newest recorded incarnation's agent pid and run id."""

    records = read_incarnations(job_dir)  # oldest file first
    if not records:
        return None, None
    return records[-1].agent_pid, records[-1].run_id


# --- reading -----------------------------------------------------------------------------------


def read_state(client: Any, run_id: str) -> tuple[RendezvousState | None, bytes | None]:
    """(state, token): the token is the raw store value, the fencing token for compare_set."""
    raw = client.get(f"torch.rendezvous.{run_id}")
    if raw is None:
        return None, None
    return decode_state(raw), raw


def read(ep: Endpoint, timeout: float = 5.0) -> RendezvousState:
    return read_with_rounds(ep, timeout, rounds=0)[0]


def read_with_rounds(
    ep: Endpoint, timeout: float = 5.0, rounds: int = 16
) -> tuple[RendezvousState, list[dict[str, Any]]]:
    """The state and the bindings of its last `rounds` rounds, newest first (`read_bindings`)."""
    with open_client(ep, timeout) as client:
        state, _ = read_state(client, ep.run_id)
        if state is None:
            raise NoInputError(f"no rendezvous state for run id {ep.run_id!r} at {ep.where()} (wrong --run-id?)")
        bound = read_bindings(client, ep.run_id, state.round, rounds) if rounds else []
    return state, bound


# --- rounds bound to generations ---------------------------------------------------------------


def round_key(run_id: str, round_: int) -> str:
    return f"{ROUND_PREFIX}{run_id}/{int(round_)}"


def binding_value(round_: int, generation: int, digest: str, job_id: str = "") -> bytes:
    doc = {
        "schema": ROUND_SCHEMA,
        "round": int(round_),
        "generation": int(generation),
        "digest": digest,
        "job_id": job_id,
        "time": time.time(),
    }
    return json.dumps(doc, sort_keys=True).encode()


def parse_binding(round_: int, raw: bytes | None) -> dict[str, Any]:
    """One round's binding as shown: {round, generation, digest, job_id, time}, or "not yet certified"."""
    if raw:
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("generation"), int) and isinstance(doc.get("digest"), str):
            return {
                "round": round_,
                "status": "certified",
                "generation": doc["generation"],
                "digest": doc["digest"],
                "job_id": doc.get("job_id", ""),
                "time": doc.get("time"),
            }
        return {"round": round_, "status": "unreadable", "generation": None, "digest": None}
    return {"round": round_, "status": "not yet certified", "generation": None, "digest": None}


def read_bindings(client: Any, run_id: str, upto: int, count: int = 16) -> list[dict[str, Any]]:
    """The bindings of rounds `upto`, `upto - 1`, ... (at most `count`), newest first."""
    rounds = range(int(upto), max(-1, int(upto) - count), -1)
    return [parse_binding(r, client.get(round_key(run_id, r))) for r in rounds]


def bind_round(ep: Endpoint, round_: int, generation: int, digest: str, job_id: str = "", timeout: float = 5.0) -> None:
    """Record that generation `generation` (certificate `digest`) was activated in round `round_`."""
    with open_client(ep, timeout) as client:
        client.set(round_key(ep.run_id, round_), binding_value(round_, generation, digest, job_id))


# --- the one-shot trigger ----------------------------------------------------------------------


@dataclass
class TriggerResult:
    """What one `rendezvous` call did; `outcome` is triggered | coalesced | already-advanced | dry-run."""

    outcome: str
    round_before: int
    round_after: int
    injected_s: float | None = None
    removed: bool = True
    rounds_seen: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome,
            "round_before": self.round_before,
            "round_after": self.round_after,
            "round_change_s": self.injected_s,
            "wait_list_entry_gone": self.removed,
            "rounds_seen": self.rounds_seen,
            "notes": self.notes,
        }


def _lease_value(holder: str, round_: int, ttl: float) -> bytes:
    return json.dumps({"holder": holder, "round": round_, "expires": time.time() + ttl}).encode()


def _parse_lease(raw: bytes | None) -> dict[str, Any] | None:
    """A live lease {holder, round, expires}, or None (free, expired or unreadable: takeable)."""
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("round"), int):
        return None
    expires = doc.get("expires")
    if not isinstance(expires, (int, float)) or expires <= time.time():
        return None
    return doc


def trigger_once(
    ep: Endpoint,
    *,
    deadline_s: float = 30.0,
    poll_s: float = 0.005,
    settle_s: float = 1.0,
    lease_ttl_s: float = 60.0,
    expect_round: int | None = None,
    dry_run: bool = False,
    store_timeout: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
) -> TriggerResult:
    """Force exactly one new rendezvous round of a live job.

    A lease key (compare_set, with an expiry for a crashed holder) makes concurrent callers coalesce:
    the loser waits for the winner's round instead of injecting its own. The wait_list entry is
    consumed by the agent itself when it joins the new round, and withdrawn by us in a `finally` if
    the round does not change before the deadline.
    """
    holder = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
    lease_key = LEASE_PREFIX + ep.run_id
    end = time.monotonic() + deadline_s
    with open_client(ep, store_timeout) as client:
        state, token = read_state(client, ep.run_id)
        if state is None:
            raise NoInputError(f"no rendezvous state for run id {ep.run_id!r} at {ep.where()} (wrong --run-id?)")
        start_round = state.round
        if state.closed:
            raise RefusedError(f"rendezvous {ep.run_id!r} is closed: the job is shutting down")
        if expect_round is not None and start_round != expect_round:
            return TriggerResult(
                "already-advanced",
                expect_round,
                start_round,
                notes=[f"round is {start_round}, not the expected {expect_round}: a new round already happened"],
            )
        if dry_run:
            return TriggerResult(
                "dry-run", start_round, start_round, notes=["would inject one transient wait_list node"]
            )

        # 1. the lease: exactly one injector per round.
        mine = _lease_value(holder, start_round, lease_ttl_s)
        while True:
            current = client.get(lease_key) or b""
            lease = _parse_lease(current)
            if lease is not None:
                return _coalesce(client, ep, lease, start_round, end, poll_s, sleep)
            if client.compare_set(lease_key, current, mine) == mine:
                break
            if time.monotonic() > end:
                raise UnavailableError("could not take the rendezvous trigger lease before the deadline")
        try:
            return _inject_and_wait(client, ep, state, token, end, poll_s, settle_s, sleep)
        finally:
            # release; leave the key (empty) so a late loser sees "free" and the round it waited for
            for _ in range(50):
                now_val = client.get(lease_key) or b""
                if now_val != mine or client.compare_set(lease_key, mine, b"") == b"":
                    break


def _coalesce(
    client: Any,
    ep: Endpoint,
    lease: dict[str, Any],
    start_round: int,
    end: float,
    poll_s: float,
    sleep: Callable[[float], None],
) -> TriggerResult:
    """Another operator holds the lease: wait for its round instead of making a second one."""
    lease_round = lease["round"]
    seen = [start_round]
    while time.monotonic() < end:
        state, _ = read_state(client, ep.run_id)
        if state is not None and state.round > lease_round:
            if state.round != seen[-1]:
                seen.append(state.round)
            return TriggerResult(
                "coalesced",
                start_round,
                state.round,
                rounds_seen=seen,
                notes=[f"another operator ({lease.get('holder')}) triggered the round"],
            )
        raw = client.get(LEASE_PREFIX + ep.run_id)
        if not raw:  # released without a new round (it failed): report, do not inject a second one
            break
        sleep(max(poll_s, 0.02))
    raise UnavailableError(f"the concurrent trigger by {lease.get('holder')} produced no new round before the deadline")


def _inject_and_wait(
    client: Any,
    ep: Endpoint,
    state: RendezvousState,
    token: bytes | None,
    end: float,
    poll_s: float,
    settle_s: float,
    sleep: Callable[[float], None],
) -> TriggerResult:
    """Put a participant agent's OWN node descriptor into `wait_list`.

    Every agent's monitor sees a waiting node and restarts its workers; the agent whose descriptor
    it is then removes it itself, inside the very state write that joins the new round
    (`_add_to_participants` drops its own node from `wait_list`). So the entry can never outlive
    the round change, whatever our timing, and no fake heartbeat is needed. (A foreign fake node
    removed "as soon as the round changes" races with the agent's back-to-back exit and join writes:
    losing that race costs a second restart.) Only if the round never changes do we take it out.
    """
    start_round = state.round
    seen = [start_round]
    if not state.complete:
        return TriggerResult(
            "already-advanced",
            start_round,
            start_round,
            rounds_seen=seen,
            notes=["a rendezvous round is already in progress"],
        )
    if not state.participants:
        raise RefusedError(f"rendezvous {ep.run_id!r} has no participants: nothing to restart")
    node = min(state.participants)
    injected_at: float | None = None
    result: TriggerResult | None = None
    try:
        while injected_at is None:
            if state.round != start_round or not state.complete:
                return TriggerResult(
                    "already-advanced", start_round, state.round, rounds_seen=[start_round, state.round]
                )
            if node not in state.participants:
                raise RefusedError(f"agent {node!r} left the rendezvous while triggering")
            state.wait_list.add(node)
            desired = encode_state(state)
            if client.compare_set(ep.key, token or b"", desired) == desired:
                injected_at = time.monotonic()
                break
            if time.monotonic() > end:
                raise UnavailableError("could not inject the wait_list entry before the deadline (state kept changing)")
            fresh, token = read_state(client, ep.run_id)
            if fresh is None:
                raise NoInputError(f"rendezvous state for {ep.run_id!r} disappeared")
            state = fresh
        while time.monotonic() < end:
            latest, token = read_state(client, ep.run_id)
            if latest is not None and latest.round != start_round:
                seen.append(latest.round)
                result = TriggerResult(
                    "triggered", start_round, latest.round, round(time.monotonic() - injected_at, 3), rounds_seen=seen
                )
                break
            sleep(poll_s)
        else:
            raise UnavailableError(f"round did not change within the deadline (stuck at {start_round}); entry removed")
    finally:
        if injected_at is not None and result is None:
            _withdraw(client, ep, node, start_round, end + 10.0)
    # The agent drops the entry when it joins; watch that, and any further round (a storm would show).
    settle_end = time.monotonic() + settle_s
    present = True
    while True:
        latest, _ = read_state(client, ep.run_id)
        if latest is None:
            present = False
        else:
            if latest.round != seen[-1]:
                seen.append(latest.round)
            present = node in latest.wait_list
        now = time.monotonic()
        if now >= settle_end and (not present or now >= end):
            break
        sleep(max(poll_s, 0.05))
    result.round_after = seen[-1]
    result.rounds_seen = seen
    result.removed = not present
    if present:
        result.notes.append(f"{node!r} still waits in round {seen[-1]}: its agent has not joined yet")
    return result


def _withdraw(client: Any, ep: Endpoint, node: NodeDesc, start_round: int, hard_end: float) -> bool:
    """Take our wait_list entry back (compare_set loop), unless a new round already consumed it."""
    while time.monotonic() < hard_end:
        state, token = read_state(client, ep.run_id)
        if state is None or state.round != start_round or node not in state.wait_list:
            return True
        state.wait_list.discard(node)
        desired = encode_state(state)
        if client.compare_set(ep.key, token or b"", desired) == desired:
            return True
    return False
