"""Peer heartbeat: notice a silent peer (a host powered off, a link down) in k x interval, not at the collective timeout.

A powered-off host sends no reset: its peers' gloo sockets stay open and a blocked collective
waits for `GPUGUARD_PG_TIMEOUT` (60 s by default). With `GPUGUARD_PEER_HEARTBEAT=<interval>[:<misses>]`
each in-place worker sends a small UDP datagram (job, generation, rank, incarnation, sequence,
HMAC-SHA256 under a key derived from the job's signing key) every `interval` seconds to the next
`FANOUT` ranks of its generation (a ring: it scales), and watches the previous ones. A watched
rank silent for `misses x interval` is suspected once: the runtime shuts this process's TCP
connections to that peer's address, so its blocked collective fails at once, and the in-place
switch runs as for a broken connection (docs/formats/peer-heartbeat.md).

Only detection depends on this; safety does not: a live rank suspected wrongly sees its
connections close, reports, and is kept or evicted by the coordinator as today (its lease and the
ledger's generation checks fence it). Every loop here is bounded, the socket is closed on stop,
and packets go only to the addresses the generation's members published.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import ipaddress
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpuguard.recovery.runtime.group_sockets import shutdown_tcp, socket_inodes

FANOUT = 2  # each rank is watched by this many successors: one lost watcher does not blind the ring
MAX_PACKET = 512  # bytes: a datagram is ~150; anything larger is not ours
MAX_BATCH = 512  # packets drained per loop turn: the beats and the check never wait behind a flood
RECV_BUFFER = 1 << 20  # asked of the kernel (it may give less): room for the peers' packets during a burst
# Linux: ancillary data with the count of datagrams the kernel dropped on this socket (a full buffer)
SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)
START_GRACE_S = 1.0  # extra silence allowed before the first packet of a peer (start-up skew)
_MAC_LEN = 32
_KEY_LABEL = b"gpuguard peer heartbeat v1"


@dataclass(frozen=True)
class HeartbeatConfig:
    """How often to beat and how many missed beats make a peer suspect."""

    interval_s: float
    misses: int = 5

    @property
    def suspect_after_s(self) -> float:
        return self.interval_s * self.misses


def parse_setting(text: str | None) -> HeartbeatConfig | None:
    """`GPUGUARD_PEER_HEARTBEAT`: '' or '0' -> off; '0.1' -> every 0.1 s, 5 misses; '0.1:8' -> 8 misses."""
    text = (text or "").strip()
    if not text or text == "0":
        return None
    interval, _, misses = text.partition(":")
    try:
        cfg = HeartbeatConfig(float(interval), int(misses) if misses else 5)
    except ValueError:
        raise ValueError(f"peer heartbeat must be <seconds>[:<misses>], not {text!r}") from None
    if not (0.005 <= cfg.interval_s <= 60.0) or not (2 <= cfg.misses <= 1000):
        raise ValueError(f"peer heartbeat {text!r}: interval 0.005..60 s, misses 2..1000")
    return cfg


@dataclass(frozen=True)
class Peer:
    """A member of the generation: its rank, incarnation and heartbeat address."""

    rank: int
    incarnation_id: str
    address: tuple[str, int]


def ring(rank: int, world: int, fanout: int = FANOUT) -> tuple[list[int], list[int]]:
    """(ranks I send to, ranks I watch): my `fanout` successors, my `fanout` predecessors."""
    n = min(max(0, fanout), world - 1)
    return [(rank + d) % world for d in range(1, n + 1)], [(rank - d) % world for d in range(1, n + 1)]


def derive_key(signing_key: bytes) -> bytes:
    """A key for heartbeats only: the signing key itself never authenticates anything but certificates."""
    return hmac.new(signing_key, _KEY_LABEL, hashlib.sha256).digest()


def encode(key: bytes, job_id: str, generation: int, rank: int, incarnation_id: str, seq: int) -> bytes:
    body = json.dumps(
        {"j": job_id, "g": generation, "r": rank, "i": incarnation_id, "s": seq}, separators=(",", ":")
    ).encode()
    return body + hmac.new(key, body, hashlib.sha256).digest()


def decode(key: bytes, packet: bytes) -> dict[str, object] | None:
    """The fields of an authentic packet, or None (too long, bad MAC, not JSON, wrong shape)."""
    if len(packet) > MAX_PACKET or len(packet) <= _MAC_LEN:
        return None
    body, mac = packet[:-_MAC_LEN], packet[-_MAC_LEN:]
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict) or set(doc) != {"j", "g", "r", "i", "s"}:
        return None
    if not all(isinstance(doc[k], int) and not isinstance(doc[k], bool) for k in ("g", "r", "s")):
        return None
    if not isinstance(doc["j"], str) or not isinstance(doc["i"], str):
        return None
    return doc


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` (SIOCGIFADDR); OSError when it has none."""
    raw = name.encode()[:15]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", raw))  # SIOCGIFADDR
    return socket.inet_ntoa(res[20:24])


def worker_address(master_addr: str | None, env: dict[str, str] | None = None) -> str:
    """The address gloo uses: GLOO_SOCKET_IFNAME's (its first interface), else the route to MASTER_ADDR.

    Heartbeats then share gloo's link: a link that fails gloo silences them too. OSError when
    neither gives an address (the detector stays off: a guessed address could be another host's).
    """
    env = dict(os.environ) if env is None else env
    ifname = env.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        return interface_address(ifname)
    toward = master_addr or "127.0.0.1"
    family = socket.AF_INET6 if ":" in toward else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((toward, 9))  # UDP connect sends nothing; it only picks the route
        return str(s.getsockname()[0])


def open_socket(address: str) -> socket.socket:
    """A UDP socket bound on `address`, an ephemeral port, with a large receive buffer and (Linux) the
    kernel's drop counter on every datagram (`SO_RXQ_OVFL`): a receiver can tell it was deaf."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.bind((address, 0))
    except OSError:
        sock.close()
        raise
    for option, value in ((socket.SO_RCVBUF, RECV_BUFFER), (SO_RXQ_OVFL, 1)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, value)
        except OSError:
            pass  # not this kernel: the batch limit alone then marks a receiver that falls behind
    return sock


def _source(address: tuple[str, int] | tuple[str, int, int, int]) -> tuple[str, int]:
    """(plain IP, port) of a socket address, IPv4-mapped IPv6 as IPv4: one form to compare."""
    return _plain_ip(str(address[0])), int(address[1])


def _plain_ip(addr: str) -> str:
    ip = ipaddress.ip_address(addr.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def break_connections(remote_ip: str, keep_ports: Iterable[int] = ()) -> int:
    """Shut down (both ways) this process's TCP connections to `remote_ip`; how many.

    shutdown() acts on the socket, not the descriptor: done on a duplicate it makes the owner's
    pending read (gloo's) return end-of-stream at once. Connections to `keep_ports` (etcd) stay.
    """
    want, keep = _plain_ip(remote_ip), set(keep_ports)
    fds = socket_inodes().values()
    return shutdown_tcp(fds, socket.SHUT_RDWR, lambda peer: _plain_ip(peer[0]) == want and peer[1] not in keep)


class PeerHeartbeat:
    """Beat to my successors, watch my predecessors; call `on_suspect(rank, silent_s)` at most once."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        key: bytes,
        job_id: str,
        generation: int,
        rank: int,
        incarnation_id: str,
        peers: dict[int, Peer],
        config: HeartbeatConfig,
        on_suspect: Callable[[int, float], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sock, self.key, self.config = sock, key, config
        self.job_id, self.generation, self.rank, self.incarnation_id = job_id, generation, rank, incarnation_id
        self.peers, self.on_suspect, self.clock = peers, on_suspect, clock
        world = len(peers)
        send, watch = ring(rank, world)
        self.send_to = [peers[r].address for r in send if r in peers]
        self.watch = {r: peers[r].incarnation_id for r in watch if r in peers}
        self.last_seen: dict[int, float] = {}
        self.last_seq: dict[int, int] = {}
        # where the watched peers send from: anything else is dropped before any hashing (a flood is cheap)
        self.sources = {_source(peers[r].address) for r in self.watch}
        self.rejected = 0
        self.dropped = 0  # datagrams from addresses no watched peer sends from
        self.kernel_drops = 0  # datagrams the kernel dropped on this socket (its buffer was full)
        self.deaf_at: float | None = None  # the last moment this receiver could not hear everything
        self.suspected: tuple[int, float] | None = None
        self._started = clock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"gpuguard-peer-heartbeat-g{generation}", daemon=True)

    def start(self) -> None:
        self._started = self.clock()
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop beating and close the socket (bounded)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self.sock.close()

    # -- the loop --------------------------------------------------------------------------
    def _loop(self) -> None:
        interval, seq = self.config.interval_s, 0
        next_beat = self.clock()
        while not self._stop.is_set():
            now = self.clock()
            if now >= next_beat:
                seq += 1
                self._beat(seq)
                next_beat = max(next_beat + interval, now + interval / 4)
            self._receive(max(0.001, min(next_beat - self.clock(), interval)))
            self._check(self.clock())

    def _beat(self, seq: int) -> None:
        packet = encode(self.key, self.job_id, self.generation, self.rank, self.incarnation_id, seq)
        for addr in self.send_to:
            try:
                self.sock.sendto(packet, addr)
            except OSError:
                pass  # a link down: the peers notice the silence, which is the point

    def _receive(self, wait_s: float) -> None:
        """Wait up to `wait_s` for a datagram, then drain what is queued, at most MAX_BATCH: a flood
        costs a bounded amount of work per turn, and the beats and the check still run on time. A
        turn that could not drain the queue, or in which the kernel dropped datagrams, makes this
        receiver deaf for that moment: a silence then is no evidence against a peer."""
        self.sock.settimeout(wait_s)
        for n in range(MAX_BATCH):
            try:
                packet, anc, _flags, addr = self.sock.recvmsg(MAX_PACKET + 1, socket.CMSG_SPACE(4))
            except (TimeoutError, BlockingIOError, InterruptedError):
                return  # the queue is empty: everything sent to us was heard
            except OSError:
                return
            if n == 0:
                self.sock.settimeout(0.0)
            now = self.clock()
            self._count_kernel_drops(anc, now)
            if _source(addr) not in self.sources:
                self.dropped += 1
                continue
            self.accept(packet, now)
        self.deaf_at = self.clock()  # more was queued than one turn takes: behind

    def _count_kernel_drops(self, anc: list[tuple[int, int, bytes]], now: float) -> None:
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == SO_RXQ_OVFL and len(data) >= 4:
                total = struct.unpack("=I", data[:4])[0]
                if total != self.kernel_drops:
                    self.kernel_drops = total
                    self.deaf_at = now

    def accept(self, packet: bytes, now: float) -> bool:
        """Count a packet from a watched peer of this generation and incarnation, with a fresh sequence."""
        doc = decode(self.key, packet)
        if doc is None or doc["j"] != self.job_id or doc["g"] != self.generation:
            self.rejected += 1
            return False
        rank, seq = int(doc["r"]), int(doc["s"])  # type: ignore[call-overload]
        if self.watch.get(rank) != doc["i"] or seq <= self.last_seq.get(rank, 0):
            self.rejected += 1  # not watched, another incarnation, or a replay
            return False
        self.last_seq[rank], self.last_seen[rank] = seq, now
        return True

    def _check(self, now: float) -> None:
        if self.suspected is not None:
            return
        limit = self.config.suspect_after_s
        for rank in self.watch:
            seen = self.last_seen.get(rank)
            silent = now - (seen if seen is not None else self._started)
            allowed = limit if seen is not None else limit + START_GRACE_S
            if self.deaf_at is not None:  # silence counts only from the last moment this receiver heard all
                silent = min(silent, now - self.deaf_at)
            if silent > allowed:
                self.suspected = (rank, silent)
                self.on_suspect(rank, silent)
                return
