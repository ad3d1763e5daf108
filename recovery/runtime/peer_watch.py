"""The peer heartbeat of one generation: exchange addresses, watch the ring, end the generation on silence.

`recovery.runtime.heartbeat` is the protocol (packets, the ring, the detector). This is its life in
one generation of the in-place runtime: right after a group forms, every member publishes its
heartbeat address in the group's store and reads the others' (a store, not a collective: a member
started without the setting cannot be paired with a collective it never makes); a member that
publishes no address ("-"), or none within the collective timeout, turns the detector off for the
generation on every member that sees it. When a watched peer goes silent, the suspicion is recorded
and this process's TCP connections to that peer's host are shut, so the blocked collective fails
at once and the switch runs (docs/formats/peer-heartbeat.md).

Lazy imports (start-up time): torch.distributed, only when a generation starts watching.
"""

from __future__ import annotations

import ipaddress
from datetime import timedelta

from gpuguard.foundation.errors import one_line
from gpuguard.foundation.etcd import etcd_ports
from gpuguard.recovery.runtime import heartbeat as peer_hb
from gpuguard.recovery.runtime.context import Context


class PeerWatch:
    """The detector of the current generation (at most one), and why it ended the generation."""

    def __init__(self, ctx: Context, config: peer_hb.HeartbeatConfig | None, timeout_s: float) -> None:
        self.ctx, self.config, self.timeout_s = ctx, config, timeout_s
        self.suspicion: str | None = None  # set by the detector thread: why this generation is over
        self.suspect: int | None = None  # the rank it found silent
        self._hb: peer_hb.PeerHeartbeat | None = None

    def start(self) -> str | None:
        """Start watching the generation the group just formed for (None), or say why not."""
        self.stop()
        self.suspicion, self.suspect = None, None
        ctx = self.ctx
        if self.config is None or ctx.world_size < 2 or ctx.generation is None:
            return None
        import torch.distributed as dist

        ledger = ctx.ledger()
        cert = ledger.get(ctx.generation)
        sock, why = None, None
        if ledger.key is None:
            why = "no signing key to authenticate heartbeats"
        else:
            try:
                sock = peer_hb.open_socket(peer_hb.worker_address(ctx.launch.master_addr))
            except OSError as exc:
                why = f"no heartbeat socket: {exc}"
        store = dist.PrefixStore(
            f"gpuguard-peer-heartbeat/g{ctx.generation}",
            dist.distributed_c10d._get_default_store(),  # noqa: SLF001 - torch's own accessor of the group's store
        )
        try:
            store.set(f"r{ctx.rank}", "-" if sock is None else "{} {}".format(*sock.getsockname()[:2]))
            keys = [f"r{r}" for r in range(ctx.world_size)]
            store.wait(keys, timedelta(seconds=self.timeout_s))
            published = {r: bytes(store.get(k))[:128].decode(errors="replace") for r, k in enumerate(keys)}
        except RuntimeError as exc:  # DistStoreError: a member never published, or the store is gone
            why = why or f"address exchange failed: {one_line(exc, 200)}"
            published = {}
        peers, hosts = {}, {m.rank: m.incarnation.host for m in cert.members}
        incarnations = {m.rank: m.incarnation.id for m in cert.members}
        for rank, text in published.items():
            addr, _, port = text.partition(" ")
            try:
                ip = ipaddress.ip_address(addr)
                peers[rank] = peer_hb.Peer(rank, incarnations.get(rank, ""), (str(ip), int(port)))
            except ValueError:
                why = why or f"rank {rank} publishes no heartbeat address ({text[:40]!r})"
                continue
            if ip.is_loopback and len(set(hosts.values())) > 1:
                why = why or f"rank {rank} on a multi-host job publishes loopback {ip}: set MASTER_ADDR routable"
        if why is not None or sock is None:
            if sock is not None:
                sock.close()
            return why
        self._hb = peer_hb.PeerHeartbeat(
            sock,
            key=peer_hb.derive_key(ledger.key),
            job_id=cert.job_id,
            generation=ctx.generation,
            rank=ctx.rank,
            incarnation_id=ctx.incarnation.id,
            peers=peers,
            config=self.config,
            on_suspect=self._on_suspect,
        )
        self._hb.start()
        return None

    def stop(self) -> None:
        hb, self._hb = self._hb, None
        if hb is not None:
            hb.stop()

    def _on_suspect(self, rank: int, silent_s: float) -> None:
        """(detector thread) End this generation: record why, wake the blocked collective."""
        hb = self._hb
        self.suspicion, self.suspect = f"no heartbeat from rank {rank} for {silent_s:.2f} s", rank
        if hb is None or rank not in hb.peers:
            return
        peer_ip, own_ip = hb.peers[rank].address[0], hb.sock.getsockname()[0]
        if peer_ip == own_ip:  # same host: a dead process resets its sockets itself; a frozen one times out
            self.ctx.log(f"{self.suspicion}: a peer on this host, left to the collective timeout")
            return
        n = peer_hb.break_connections(peer_ip, keep_ports=etcd_ports(self.ctx.ledger_url))
        self.ctx.log(f"{self.suspicion}: shut {n} connection(s) to {peer_ip}")
