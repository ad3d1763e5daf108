"""etcd URLs and endpoint lists, and an etcd3gw client that fails over between a cluster's members.

    etcd://HOST:PORT[,HOST:PORT...]/PREFIX      the ledger (and the coordination next to it)
    HOST[:PORT][,HOST[:PORT]...]                a rendezvous endpoint (--rdzv-endpoint)

Why one place: the ledger, the in-place coordination, the leases and the rendezvous all name the
same etcd cluster. With one endpoint, losing that member stops every worker (each fences itself);
with the cluster's members listed, a call that could not reach one member goes to the next.

Failover is only for calls that provably never reached a member (connection refused or reset, a
connect timeout): a call that reached etcd and then timed out may have been applied, so it is not
sent again (the caller's deadline and its compare-and-swap decide what happened).

Lazy imports (start-up time): etcd3gw and requests, only when a client is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from gpuguard.foundation.errors import UsageError

DEFAULT_PORT = 2379
DEFAULT_PREFIX = "/gpuguard"
API_PATH = "/v3/"


@dataclass(frozen=True)
class EtcdUrl:
    """A parsed `etcd://` URL: the members to try, in order, and the key prefix."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str

    @property
    def netloc(self) -> str:
        return ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)

    def __str__(self) -> str:
        return f"etcd://{self.netloc}{self.prefix}"


def split_endpoints(text: str, default_port: int = DEFAULT_PORT) -> list[tuple[str, int]]:
    """`host[:port][,host[:port]...]` (IPv6 in brackets, an `http://` scheme tolerated) as (host, port)s."""
    out: list[tuple[str, int]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part.startswith(("http://", "https://")):
            part = part.split("://", 1)[1].rstrip("/")
        host, port = part, default_port
        try:
            if part.startswith("["):
                host, _, rest = part[1:].partition("]")
                if rest.startswith(":"):
                    port = int(rest[1:])
                elif rest:
                    raise ValueError
            elif part.count(":") == 1:
                host, raw = part.split(":")
                port = int(raw)
        except ValueError:
            raise ValueError(f"bad etcd endpoint {part!r}: host:port") from None
        if not host or not 0 < port < 65536:
            raise ValueError(f"bad etcd endpoint {part!r}: host:port")
        out.append((host, port))
    if not out:
        raise ValueError("no etcd host named (host:port[,host:port...])")
    return out


def parse_etcd_url(url: str) -> EtcdUrl:
    """`etcd://h1:2379,h2:2379/prefix` (or `http://host:port/prefix`); a usage error when malformed."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("etcd", "http"):
        raise UsageError(f"ledger URL {url!r}: want etcd://host:port[,host:port...]/prefix")
    netloc, slash, path = rest.partition("/")
    try:
        endpoints = split_endpoints(netloc, default_port=0)  # 0: a host without its port is refused
    except ValueError as exc:
        raise UsageError(f"ledger URL {url!r} needs a host and a port: etcd://host:port/prefix ({exc})") from None
    prefix = "/" + unquote(path).strip("/") if slash and path.strip("/") else DEFAULT_PREFIX
    return EtcdUrl(tuple(endpoints), prefix)


def failover_client(endpoints: tuple[tuple[str, int], ...], *, timeout: float, protocol: str = "http") -> Any:
    """An `etcd3gw.Etcd3Client` on the first member that moves to the next one when a call could
    not reach its member (see the module docstring). Never routed through an HTTP proxy."""
    import requests
    from etcd3gw import exceptions as etcd_ex
    from etcd3gw.client import Etcd3Client

    class FailoverClient(Etcd3Client):
        def __init__(self) -> None:
            host, port = endpoints[0]
            super().__init__(host=host, port=port, protocol=protocol, timeout=timeout, api_path=API_PATH)
            self.session.trust_env = False
            self._endpoints = endpoints
            self._at = 0

        def post(self, url: str, *args: Any, json: Any = None, **kwargs: Any) -> Any:
            tail = url[len(self.base_url) :] if url.startswith(self.base_url) else None
            for tried in range(len(self._endpoints)):
                try:
                    return super().post(url, *args, json=json, **kwargs)
                except (etcd_ex.ConnectionFailedError, etcd_ex.ConnectionTimeoutError) as exc:
                    never_sent = isinstance(exc, etcd_ex.ConnectionFailedError) or isinstance(
                        exc.__context__, requests.exceptions.ConnectTimeout
                    )
                    if tail is None or not never_sent or tried == len(self._endpoints) - 1:
                        raise
                    self._at = (self._at + 1) % len(self._endpoints)
                    self.host, self.port = self._endpoints[self._at]
                    url = self.base_url + tail
            raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    return FailoverClient()
