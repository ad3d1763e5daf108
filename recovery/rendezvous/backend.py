"""torchrun's `gpuguard` rendezvous backend: torch's dynamic rendezvous with its state on etcd v3.

    torchrun --rdzv-backend=gpuguard --rdzv-endpoint=HOST:PORT[,HOST:PORT...] --rdzv-id=JOB \\
             --rdzv-conf=key_prefix=/gpuguard/rdzv,read_timeout=10,lease_ttl=600 ...

Why: with torch's `c10d` backend the rendezvous state lives in a TCPStore hosted by one agent, so
losing that host stops every other agent; torch's `etcd-v2` backend needs etcd's v2 API (gone in
etcd 3.6) and puts every run's store under one prefix. Here etcd is the only stateful part.

Registered in the `torchrun.handlers` entry-point group (pyproject.toml). torch 2.13 loads that
group with `entry_point.load()()` and registers the *result* as the handler creator, so
`create_handler` answers both calls: with no argument it returns itself, with `RendezvousParameters`
it returns the handler.

The backend (`EtcdRendezvousBackend`) keeps torch's pickled state, sealed (`signed_state`: a MAC
under the job's rendezvous secret, then `base64(pickle)`), under `<prefix>/<run id>/state`; the fencing token is
the key's etcd `mod_revision` and `set_state` is one transaction that compares it. The agents'
store is `etcd_store.EtcdStore` under `<prefix>/<run id>/store/`. Two more keys of the run are not
the agents': `rounds/<R>` (the generation activated in round R, written by the runtime's
coordinator) and `trigger` (the lease of `gpu-recover rendezvous`), both through the torch-free
`recovery.rendezvous.etcd_keys`.

Waiting on the state (issue 23): torch's join loop (`_DistributedRendezvousOpExecutor.run`)
sleeps 1 s between two state polls whenever it waits for other nodes (its SYNC action), and its
state holder serves a read younger than 1 s from a cache; on a re-rendezvous that costs up to 1 s per
wait. This handler runs torch's loop with that pause replaced (`_WatchingOpExecutor`): the agent
blocks on a watch of `<prefix>/<run id>/state` (etcd's `/v3/watch`, `EtcdClient.watch`) from the
revision after the state it holds (the store revision of its last read, so a write between the
read and the watch counts), and re-reads as soon as the key changes, or after the same 1 s when
nothing changed. The wait is never longer than torch's pause (the join loop's deadlines and
keep-alives fall as before), ends early only on a real change (a re-read moves past it: no busy
loop), opens one connection that it closes before returning (no thread), and a failed or ended
watch is torch's plain pause. Nothing in etcd changes: the same key, the same sealed value
(`signed_state`), the same compare-and-set; agents with and without the watch interoperate. Cost:
a waiting agent reads the state once per write of it (every participant's heartbeat while it waits,
N / keep_alive_interval a second) where torch reads it once a second.

The workers' store: torch 2.13 by default has the rank-0 agent host a TCPStore for the workers
(`TORCH_DISABLE_SHARE_RDZV_TCP_STORE` unset), which dies with that agent, and the other agents keep
pointing their workers at it in later rounds (their bootstrap info is cached). This handler never
shares: `use_agent_store` is False and torch's opt-out is set while it rendezvous (only then:
other handlers and child processes never see it), so in every round the rank-0 agent picks
a free port, publishes MASTER_ADDR/MASTER_PORT through the etcd store, and global rank 0 (a worker
on that host) hosts the workers' TCPStore; it lives exactly as long as that round's workers, and
the next round publishes a new one. Workers keep plain `init_process_group()` (a store on etcd
would force every training script to import gpuguard; `EtcdStore.connect` is there for one that
wants it).

Keys expire: every key of a run is attached to one etcd lease (`etcd_store.RunLease`) that every
live agent refreshes, so the keys go `lease_ttl` seconds after the last agent stopped. When the
last member of the closed rendezvous shuts down, it revokes the lease and leaves only the closed
state, on a lease of `closed_ttl` seconds (an agent arriving late sees "closed" instead of starting
a fresh run under the same id).

`--rdzv-conf` keys (besides torch's own: join_timeout, last_call_timeout, close_timeout,
heartbeat_timeout, keep_alive_interval, keep_alive_max_attempt):
  key_prefix     etcd key prefix (default /gpuguard/rdzv); the run id is %-quoted below it
  read_timeout   seconds for each etcd request, connect included (default 10): an unreachable etcd
                 fails the agent with RendezvousConnectionError within read_timeout per endpoint
  store_timeout  seconds a store get/wait blocks before DistStoreError (default 60)
  lease_ttl      seconds the run's keys outlive the last live agent (default 600, >= 3 x
                 keep_alive_interval: live agents refresh the lease on their heartbeats)
  closed_ttl     seconds the closed state stays after a clean end (default 60; 0 removes it too)
  last_call_early  1 (default): a re-rendezvous completes as soon as every agent known to be alive
                 has joined, not at the end of last_call_timeout (`last_call`); 0: torch's last call
  protocol       http or https (default http)
  ca_cert, ssl_cert, ssl_cert_key   TLS files (https): the CA bundle, the client certificate and key
  secret_file    the rendezvous secret (`signed_state`; default: $GPUGUARD_JOB_DIR/generation.key).
                 Required: without a secret the backend refuses to start (one line).

The state is signed (`signed_state`): `get_state` refuses a value that is not sealed with the
job's rendezvous secret before torch unpickles anything, and loads a sealed one with the restricted
unpickler in a forked worker under a deadline first (a planted pickle or a shared-reference DAG
never reaches torch's `pickle.loads`). A refusal is one log line and `RendezvousStateError`.
Every etcd call has a total deadline of read_timeout (all members together) and goes to the next
member only when it provably never reached one (`foundation.etcd`).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any
from urllib.parse import quote

from torch.distributed import Store
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousSettings,
    RendezvousTimeout,
    Token,
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
)
from torch.distributed.elastic.rendezvous.utils import _delay as _torch_delay

from gpuguard.foundation.errors import GpuguardError
from gpuguard.foundation.etcd import (
    KV,
    EtcdRequestFailed,
    EtcdUnavailable,
    compare,
    parse_endpoints,
    prefix_end,
    put_op,
    range_kvs,
    range_op,
)
from gpuguard.recovery.rendezvous.etcd_keys import RunLease, run_prefix, tls_from_conf
from gpuguard.recovery.rendezvous.etcd_store import EtcdConnection, EtcdStore
from gpuguard.recovery.rendezvous.last_call import EarlyLastCall
from gpuguard.recovery.rendezvous.signed_state import (
    SECRET_FILE_CONF,
    ForeignState,
    mac_of,
    require_secret,
    seal,
    unseal_state,
)
from gpuguard.recovery.rendezvous.state import load_state

log = logging.getLogger(__name__)

BACKEND_NAME = "gpuguard"
NO_SHARE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
DEFAULTS: dict[str, Any] = {
    "key_prefix": "/gpuguard/rdzv",
    "read_timeout": 10.0,
    "store_timeout": 60.0,
    "lease_ttl": 600,
    "closed_ttl": 60,
    "protocol": "http",
}
PRUNE_SPAN = 8  # rounds pruned at most per completed round (contiguous rounds need one each)
KEEP_BINDINGS = 64  # newest `rounds/<R>` bindings kept (what `gpu-recover rendezvous --state` shows)


class EtcdRendezvousBackend(RendezvousBackend):
    """torch's `RendezvousBackend` on etcd v3: compare-and-set on the state key's mod_revision,
    every state sealed with the job's rendezvous secret (`seal_key`, from `signed_state`)."""

    VALIDATED_KEPT = 16  # MACs of states already validated (the agents re-read the same state often)

    def __init__(
        self, conn: EtcdConnection, run_id: str, key_prefix: str, lease: RunLease | None = None, *, seal_key: bytes
    ) -> None:
        self.conn = conn
        self.run_id = run_id
        self.base = run_prefix(key_prefix, run_id)
        self.key = self.base + b"state"
        self.lease = lease if lease is not None else RunLease(conn, self.base + b"lease", DEFAULTS["lease_ttl"])
        self.seal_key = seal_key
        self._validated: OrderedDict[bytes, None] = OrderedDict()
        self._refused: OrderedDict[bytes, None] = OrderedDict()
        self._read_at: tuple[int, int] = (0, 0)  # (the state's mod_revision, the store revision it was read at)

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def guard(self, what: str, fn: Any, *args: Any) -> Any:
        """`fn(*args)`; an etcd failure becomes torch's RendezvousConnectionError naming `what`."""
        try:
            return fn(*args)
        except (EtcdUnavailable, EtcdRequestFailed) as exc:
            raise RendezvousConnectionError(f"rendezvous {self.run_id!r} ({what}): {exc}") from exc

    def _refuse(self, value: bytes, why: str) -> RendezvousStateError:
        """The error for a refused value, logged once per value (torch reads it again as it shuts down)."""
        msg = f"gpuguard rendezvous {self.run_id!r}: refused the state at {self.key.decode(errors='replace')}: {why}"
        digest = hashlib.sha256(value).digest()
        if digest not in self._refused:
            self._refused[digest] = None
            while len(self._refused) > self.VALIDATED_KEPT:
                self._refused.popitem(last=False)
            log.error("%s", msg)
        return RendezvousStateError(msg)

    def _remember(self, mac: bytes) -> None:
        self._validated[mac] = None
        while len(self._validated) > self.VALIDATED_KEPT:
            self._validated.popitem(last=False)

    def _decode(self, kv: KV) -> tuple[bytes, Token]:
        """The pickle torch may load: sealed with our secret, and loaded once by the restricted
        unpickler under a deadline (in a forked worker) unless this very state was already."""
        try:
            state = unseal_state(self.seal_key, self.key, kv.value)
        except ForeignState as exc:
            raise self._refuse(kv.value, f"{exc} (never unpickled)") from None
        mac = mac_of(kv.value)
        if mac not in self._validated:
            try:
                load_state(state)
            except GpuguardError as exc:
                raise self._refuse(kv.value, str(exc)) from None
            self._remember(mac)
        return state, kv.mod_revision

    def get_state(self) -> tuple[bytes, Token] | None:
        got = self.guard("get_state", self.conn.range, self.key, "rendezvous get_state")
        kvs = range_kvs(got)
        if not kvs:
            return None
        self._read_at = (kvs[0].mod_revision, _revision_of(got))
        return self._decode(kvs[0])

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token is None:
            cmp = compare(self.key, "CREATE", 0)
        elif isinstance(token, int) and not isinstance(token, bool) and token > 0:
            cmp = compare(self.key, "MOD", token)
        else:  # not a token of ours: it cannot match
            current = self.get_state()
            return None if current is None else (*current, False)
        value = seal(self.seal_key, self.key, base64.b64encode(state))

        def go(lease: int) -> dict[str, Any]:
            return self.conn.txn("rendezvous set_state", [cmp], [put_op(self.key, value, lease)], [range_op(self.key)])

        got = self.guard("set_state", self.lease.attached, go)
        if got.get("succeeded"):
            self._remember(mac_of(value))  # torch's own state: nothing to validate
            revision = int(got["header"]["revision"])
            self._read_at = (revision, revision)
            return state, revision, True
        kvs = range_kvs(got["responses"][0]) if got.get("responses") else []
        if not kvs:
            return None
        self._read_at = (kvs[0].mod_revision, _revision_of(got))
        return (*self._decode(kvs[0]), False)

    def wait_for_change(self, token: Token | None, seconds: float) -> bool:
        """Torch's pause between two state polls (its SYNC action), ended early by a change: block
        on a watch of the state key from the revision after the state `token` names, at most
        `seconds`. True as soon as the key changed (an event after that state: re-read it now);
        False after `seconds` (nothing changed, etcd ended the watch, or the watch failed: the next
        read then reports a gone etcd). Never longer than `seconds`, never a busy loop: only a real
        change of the key ends the wait early, and the re-read moves the revision past it."""
        end = time.monotonic() + seconds
        if isinstance(token, int) and not isinstance(token, bool) and token > 0:
            mod_revision, read_at = self._read_at
            start = max(token, read_at if mod_revision == token else 0) + 1  # after the newest revision known unchanged
            if self.conn.watch(self.key, start, seconds) == "changed":
                return True
        left = end - time.monotonic()
        if left > 0:
            time.sleep(left)
        return False

    def prune_rounds(self, current: int) -> int:
        """Delete what the rounds before `current - 1` left in etcd: their agents' store keys
        (`store/torch.rendezvous.<run>.<r>/...`, 2 + 2 x agents per round) and, past the newest
        KEEP_BINDINGS, their `rounds/<r>` bindings. Without it a long elastic run grows by every
        round it ever had. Bounded: at most PRUNE_SPAN rounds per call (each completed round prunes
        its predecessors, so the span only matters after a gap). Returns the keys deleted."""
        deleted = 0
        for r in range(max(0, current - 1 - PRUNE_SPAN), current - 1):
            prefix = self.base + f"store/torch.rendezvous.{self.run_id}.{r}/".encode()
            deleted += self._delete_range(prefix, prefix_end(prefix))
        for r in range(max(0, current - KEEP_BINDINGS - PRUNE_SPAN), max(0, current - KEEP_BINDINGS)):
            key = self.base + f"rounds/{r}".encode()
            deleted += self._delete_range(key, None)
        return deleted

    def _delete_range(self, key: bytes, range_end: bytes | None) -> int:
        return int(self.guard("prune", lambda: self.conn.delete(key, "rendezvous prune", range_end=range_end)))

    def depart(self, node: str, members: set[str], closed_ttl: int) -> bool:
        """Record that `node` has shut down; the last of `members` to do so removes the run's keys.

        The closed state is kept on a short lease of its own (`closed_ttl`), then the run lease is
        revoked: the store keys, the departures and the lease key go with it. True when it cleaned.
        """
        marks = self.base + b"departed/"
        self.guard(
            "depart",
            self.lease.attached,
            lambda lease: self.conn.txn(
                "rendezvous depart", [], [put_op(marks + quote(node, safe="").encode(), b"1", lease)]
            ),
        )
        got = self.guard("depart", lambda: self.conn.range(marks, "rendezvous departures", prefix=True, keys_only=True))
        gone = {kv.key[len(marks) :].decode(errors="replace") for kv in range_kvs(got)}
        if not {quote(m, safe="") for m in members} <= gone:
            return False
        kvs = range_kvs(self.guard("depart", self.conn.range, self.key, "rendezvous state"))
        if kvs and closed_ttl > 0:
            short = self.guard("depart", self.conn.grant, closed_ttl, "closed-state lease")
            self.guard(
                "depart",
                self.conn.txn,
                "rendezvous keep closed state",
                [compare(self.key, "MOD", kvs[0].mod_revision)],
                [put_op(self.key, kvs[0].value, short)],
            )
        self.guard("depart", self.lease.revoke)
        return True


_share_lock = threading.Lock()
_share_depth = 0
_share_prior: str | None = None


@contextmanager
def _no_shared_store() -> Iterator[None]:
    """torch's documented opt-out, set only while our handlers rendezvous (refcounted, then restored).

    torch 2.13 reads it inside `next_rendezvous`; set for the whole process it would leak into
    other handlers and into every child process (a test suite's other torchrun jobs).
    """
    global _share_depth, _share_prior
    with _share_lock:
        if _share_depth == 0:
            _share_prior = os.environ.get(NO_SHARE_ENV)
            os.environ[NO_SHARE_ENV] = "1"
        _share_depth += 1
    try:
        yield
    finally:
        with _share_lock:
            _share_depth -= 1
            if _share_depth == 0:
                if _share_prior is None:
                    os.environ.pop(NO_SHARE_ENV, None)
                else:
                    os.environ[NO_SHARE_ENV] = _share_prior


class _WatchingStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder, plus the wait that ends when the state key changes (`wait_for_change`)."""

    def __init__(self, backend: EtcdRendezvousBackend, settings: RendezvousSettings) -> None:
        super().__init__(backend, settings)
        self._etcd_backend = backend

    def wait_for_change(self, seconds: float) -> None:
        """Wait for a change of the state after the one held (at most `seconds`); on a change, the
        next `sync` reads it (torch serves a read younger than 1 s from its cache otherwise)."""
        if self._etcd_backend.wait_for_change(self._token, seconds):
            self._last_sync_time = -1


class _WatchingOpExecutor(_DistributedRendezvousOpExecutor):
    """torch's rendezvous loop (`_DistributedRendezvousOpExecutor.run`, its own code object), with
    the pause of its SYNC action (`_delay(seconds=1)`, a plain sleep between two state polls)
    replaced by `_WatchingStateHolder.wait_for_change(1)`: a watch of the state key that ends at
    the first change and after the same 1 s at most. Every other step of the loop is torch's.

    The name `_delay` is resolved through a copy of torch's module globals owned by this executor,
    so no other handler, thread or module sees a change. If a torch version's loop no longer calls
    `_delay`, torch's own loop runs unchanged (the plain poll; `WATCHES_SYNC` says which).
    """

    def __init__(
        self, node: Any, state_holder: _WatchingStateHolder, settings: RendezvousSettings, last_call: EarlyLastCall
    ) -> None:
        super().__init__(node, state_holder, settings)
        self._watching_holder = state_holder
        self._torch_run = _with_delay(_DistributedRendezvousOpExecutor.run, self._sync_wait)
        self.last_call = last_call

    def run(self, state_handler: Any, *args: Any, **kwargs: Any) -> None:
        """torch's `run`, whatever its signature in this torch version, its op seen by `last_call`."""
        op = self.last_call.wrap(state_handler)
        if self._torch_run is None:
            super().run(op, *args, **kwargs)
        else:
            self._torch_run(self, op, *args, **kwargs)

    def _sync_wait(self, seconds: float | tuple[float, float]) -> None:
        if isinstance(seconds, tuple):  # a random skew, not a poll: torch's own delay
            _torch_delay(seconds)
        else:
            self._watching_holder.wait_for_change(float(seconds))


def _with_delay(fn: Callable[..., Any], delay: Callable[..., None]) -> Callable[..., Any] | None:
    """`fn` with the global name `_delay` bound to `delay` (None if `fn` does not use that name)."""
    code = getattr(fn, "__code__", None)
    if code is None or "_delay" not in code.co_names:
        return None
    bound = types.FunctionType(code, {**fn.__globals__, "_delay": delay}, fn.__name__, fn.__defaults__, fn.__closure__)
    bound.__kwdefaults__ = fn.__kwdefaults__
    return bound


WATCHES_SYNC = "_delay" in getattr(getattr(_DistributedRendezvousOpExecutor.run, "__code__", None), "co_names", ())


class EtcdRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic handler that never hosts a store for the workers, waits on a watch of the
    state key where torch sleeps between polls, and cleans etcd at the end."""

    _gpuguard_backend: EtcdRendezvousBackend
    _gpuguard_closed_ttl: int = 60
    last_call: EarlyLastCall

    def attach(self, backend: EtcdRendezvousBackend, closed_ttl: int, last_call_early: bool = True) -> None:
        """The backend this handler prunes and departs through, and the TTL of a closed round's keys.

        Also swaps torch's state holder and loop for the watching ones (`_WatchingOpExecutor`, its
        join op ending a re-rendezvous's last call early unless `last_call_early` is off:
        `last_call`): called right after `from_backend`, before any rendezvous, so the holder
        replaced held nothing.
        """
        self._gpuguard_backend = backend
        self._gpuguard_closed_ttl = closed_ttl
        holder = _WatchingStateHolder(backend, self._settings)
        self._state_holder = holder
        self.last_call = EarlyLastCall(self._settings, last_call_early)
        self._op_executor = _WatchingOpExecutor(self._this_node, holder, self._settings, self.last_call)

    @property
    def use_agent_store(self) -> bool:
        return False  # the workers' store is hosted by their global rank 0, never by an agent

    def next_rendezvous(self) -> RendezvousInfo:
        with _no_shared_store():
            info = super().next_rendezvous()
        self.last_call.rounds_done += 1
        state = getattr(getattr(self, "_state_holder", None), "state", None)
        if info.rank == 0 and state is not None:  # one agent per round prunes what all have moved past
            try:
                self._gpuguard_backend.prune_rounds(int(state.round))
            except RendezvousError as exc:  # best effort: the run lease still removes them at the end
                log.warning("rendezvous %s: could not prune old rounds: %s", self.get_run_id(), exc)
        return info

    def shutdown(self) -> bool:
        ok = super().shutdown()
        if ok:
            try:
                self._gpuguard_depart()
            except RendezvousError as exc:  # best effort: the lease expires the keys anyway
                log.warning("rendezvous %s: leaving the keys to expire: %s", self.get_run_id(), exc)
        return ok

    def _gpuguard_depart(self) -> bool:
        state = getattr(getattr(self, "_state_holder", None), "state", None)
        node = getattr(self, "_this_node", None)
        if state is None or node is None or not getattr(state, "closed", False):
            return False
        members = {repr(n) for n in state.participants}
        members |= {repr(n) for n in getattr(state, "wait_list", ())}
        members |= {repr(n) for n in getattr(state, "redundancy_list", ())}
        members.add(repr(node))
        return self._gpuguard_backend.depart(repr(node), members, self._gpuguard_closed_ttl)


def _revision_of(answer: dict[str, Any]) -> int:
    """The store revision an etcd answer was read at (0 when its header is missing)."""
    try:
        return int(answer.get("header", {}).get("revision", 0))
    except (TypeError, ValueError, AttributeError):
        return 0


def _conf_float(params: RendezvousParameters, key: str) -> float:
    raw = params.get(key, DEFAULTS[key])
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"--rdzv-conf {key}={raw!r}: a number of seconds is needed") from None
    if value <= 0:
        raise ValueError(f"--rdzv-conf {key}={raw!r}: must be positive")
    return value


def _conf_int(params: RendezvousParameters, key: str, default: int, minimum: int) -> int:
    raw = params.get(key, default)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"--rdzv-conf {key}={raw!r}: an integer is needed") from None
    if value < minimum:
        raise ValueError(f"--rdzv-conf {key}={raw!r}: must be at least {minimum}")
    return value


def _conf_flag(params: RendezvousParameters, key: str, default: bool) -> bool:
    """torch's own reading of a yes/no option (`get_as_bool`), with this backend's one-line error."""
    try:
        value = params.get_as_bool(key, default)
    except ValueError:
        raise ValueError(f"--rdzv-conf {key}={params.get(key)!r}: 0 or 1 is needed") from None
    return bool(value)


def create_backend(params: RendezvousParameters) -> tuple[EtcdRendezvousBackend, Store]:
    """The backend and the agents' store for `params`, like torch's own `create_backend` functions.

    Reaches etcd once (the run lease) so that a wrong endpoint fails here, within read_timeout.
    """
    keep_alive = _conf_int(params, "keep_alive_interval", 5, 1)
    lease_ttl = _conf_int(params, "lease_ttl", DEFAULTS["lease_ttl"], 1)
    if lease_ttl < 3 * keep_alive:
        raise ValueError(f"--rdzv-conf lease_ttl={lease_ttl} must be at least 3 x keep_alive_interval ({keep_alive})")
    try:
        seal_key = require_secret(params.get(SECRET_FILE_CONF))
    except GpuguardError as exc:
        log.error("gpuguard rendezvous: %s", exc)  # the one line that says why the agent did not start
        raise ValueError(str(exc)) from None
    conn = EtcdConnection(
        parse_endpoints(params.endpoint or "localhost:2379"),
        timeout=_conf_float(params, "read_timeout"),
        tls=tls_from_conf(params.config),
    )
    prefix = str(params.get("key_prefix", DEFAULTS["key_prefix"]))
    base = run_prefix(prefix, params.run_id)
    lease = RunLease(conn, base + b"lease", lease_ttl)
    backend = EtcdRendezvousBackend(conn, params.run_id, prefix, lease, seal_key=seal_key)
    store = EtcdStore(
        conn, base + b"store/", lease=lease, timeout=timedelta(seconds=_conf_float(params, "store_timeout"))
    )
    backend.guard("connect", lease.id)
    return backend, store


def _timeout(params: RendezvousParameters, key: str) -> timedelta | None:
    value = params.get_as_int(f"{key}_timeout")
    return None if value is None else timedelta(seconds=value)


def create_handler(params: RendezvousParameters | None = None) -> Any:
    """torchrun's entry point: with no argument, the creator (itself); with parameters, the handler."""
    if params is None:
        return create_handler
    backend, store = create_backend(params)
    handler = EtcdRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        RendezvousTimeout(
            _timeout(params, "join"),
            _timeout(params, "last_call"),
            _timeout(params, "close"),
            _timeout(params, "heartbeat"),
        ),
        keep_alive_interval=_conf_int(params, "keep_alive_interval", 5, 1),
        keep_alive_max_attempt=_conf_int(params, "keep_alive_max_attempt", 3, 1),
    )
    handler.attach(
        backend,
        _conf_int(params, "closed_ttl", DEFAULTS["closed_ttl"], 0),
        _conf_flag(params, "last_call_early", True),
    )
    return handler
