"""etcd addresses: the ledger URL and the rendezvous endpoint list, TLS files, credentials never shown.

    etcd[s]://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT...][/PREFIX][?cacert=F&cert=F&key=F&max_request_bytes=N]
    HOST[:PORT][,HOST[:PORT]...]                                (a rendezvous --rdzv-endpoint)

Its own module because everything that names an etcd cluster parses one of these, the client
(`foundation.etcd`, which re-exports these names) and whoever only needs the members' ports
(`etcd_ports`). Credentials: `str`, `repr` and every error show `USER:***@`, a lone `NAME@` as
`***@` (the one name may be a token); `redact` does the same for any text that may hold a URL.
docs/formats/ledger.md ("etcd URLs") is the reference.

Lazy imports (start-up time): ssl, only when a TLS context is built.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import parse_qsl, quote, unquote

from gpuguard.foundation.env import ETCD_CACERT_ENV, ETCD_CERT_ENV, ETCD_KEY_ENV
from gpuguard.foundation.errors import UsageError

if TYPE_CHECKING:
    import ssl

DEFAULT_PORT = 2379
DEFAULT_PREFIX = "/gpuguard"
DEFAULT_MAX_REQUEST_BYTES = 3 << 19  # etcd's default --max-request-bytes: 1.5 MiB
URL_SCHEMES = ("etcd", "etcds", "http", "https")
URL_OPTIONS = ("cacert", "cert", "key", "max_request_bytes")


class Endpoint(NamedTuple):
    """One member's client address (a tuple: `("h", 2379)` compares equal)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def split_endpoints(text: str, default_port: int = DEFAULT_PORT) -> list[Endpoint]:
    """`host[:port][,host[:port]...]` (IPv6 in brackets, an `http(s)://` scheme tolerated); ValueError
    when malformed (`default_port=0`: a host without its port is refused)."""
    out: list[Endpoint] = []
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
        if not host or not 0 < port < 65536 or any(c in host for c in "@/?#[] "):
            raise ValueError(f"bad etcd endpoint {part!r}: host:port")
        out.append(Endpoint(host, port))
    if not out:
        raise ValueError("no etcd host named (host:port[,host:port...])")
    return out


def parse_endpoints(text: str, default_port: int = DEFAULT_PORT) -> tuple[Endpoint, ...]:
    """A rendezvous endpoint list (`--rdzv-endpoint`): `host[:port][,host[:port]...]`."""
    return tuple(split_endpoints(text, default_port))


def redact(text: str) -> str:
    """`text` with the password of a `scheme://user:password@...` (or `user:password@...`) shown as
    `***`, and a lone `token@...` as `***@...` (a name alone may be the secret).

    Conservative on text that does not parse: everything between `://` and the last `@` counts as
    credentials (a password may hold `/`, `?` or `@` unencoded), so a prefix holding `@` is shown
    redacted too rather than a password ever shown."""
    if "@" not in text:
        return text
    scheme, sep, rest = text.partition("://")
    if not sep or not scheme or not scheme[0].isalpha() or not all(c.isalnum() or c in "+.-" for c in scheme):
        scheme, sep, rest = "", "", text  # no scheme: the credentials start the text
    userinfo, _, tail = rest.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if not colon or any(c in user for c in "/?#"):
        return f"{scheme}{sep}***@{tail}"  # `token@host`: the one name may be the secret
    return f"{scheme}{sep}{user}:***@{tail}"


@dataclass(frozen=True)
class TlsFiles:
    """TLS to the members: `https`, the CA bundle that verifies them, our client certificate and key."""

    https: bool = False
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None

    def context(self) -> ssl.SSLContext | None:
        """The SSL context (None: plain http); a file that cannot be loaded is a one-line UsageError."""
        if not self.https:
            return None
        import ssl

        if self.key and not self.cert:
            raise UsageError("etcd TLS: a client key needs its certificate (cert=...)")
        try:
            ctx = ssl.create_default_context(cafile=self.cacert)
        except (OSError, ssl.SSLError) as exc:
            raise UsageError(f"etcd TLS: cannot load the CA file {self.cacert}: {_reason(exc)}") from None
        if self.cert:
            try:
                ctx.load_cert_chain(self.cert, self.key or None)
            except (OSError, ssl.SSLError) as exc:
                raise UsageError(
                    f"etcd TLS: cannot load the client certificate {self.cert} / key {self.key}: {_reason(exc)}"
                ) from None
        return ctx


def _reason(exc: BaseException) -> str:
    return str(getattr(exc, "strerror", None) or getattr(exc, "reason", None) or type(exc).__name__)


@dataclass(frozen=True)
class EtcdUrl:
    """A parsed ledger URL: the members in order, the key prefix, TLS, credentials (never printed)."""

    endpoints: tuple[Endpoint, ...]
    prefix: str = DEFAULT_PREFIX
    tls: TlsFiles = TlsFiles()
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    @property
    def netloc(self) -> str:
        return ",".join(str(Endpoint(*e)) for e in self.endpoints)

    def __str__(self) -> str:
        scheme = "etcds" if self.tls.https else "etcd"
        who = ""
        if self.user is not None:  # a lone `token@` is shown as `***@`: the one name may be the secret
            who = quote(self.user, safe="") + ":***@" if self.password is not None else "***@"
        query = [(k, getattr(self.tls, k)) for k in ("cacert", "cert", "key") if getattr(self.tls, k)]
        if self.max_request_bytes != DEFAULT_MAX_REQUEST_BYTES:
            query.append(("max_request_bytes", str(self.max_request_bytes)))
        q = "?" + "&".join(f"{k}={quote(v, safe='/')}" for k, v in query) if query else ""
        return f"{scheme}://{who}{self.netloc}{quote(self.prefix, safe='/')}{q}"

    def __repr__(self) -> str:
        return f"EtcdUrl({str(self)!r})"


def parse_etcd_url(url: str, env: Mapping[str, str] | None = None) -> EtcdUrl:
    """`etcd://[user:password@]h1:2379,h2:2379/prefix[?cacert=..&cert=..&key=..]`; a UsageError when
    malformed (its message redacted). `etcds://` and `https://` (or any TLS file) mean TLS; TLS files
    not in the URL come from `GPUGUARD_ETCD_CACERT|CERT|KEY` in `env` (default: the environment)."""
    shown = redact(url)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in URL_SCHEMES:
        raise UsageError(f"ledger URL {shown!r}: want etcd://[user:password@]host:port[,host:port...]/prefix")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        hosts = netloc
    try:
        endpoints = split_endpoints(hosts, default_port=0)
    except ValueError:
        raise UsageError(f"ledger URL {shown!r}: every member needs host:port (etcd://host:port/prefix)") from None
    user = password = None
    if at:
        raw_user, colon, raw_password = userinfo.partition(":")
        user, password = unquote(raw_user), (unquote(raw_password) if colon else None)
        if not user:
            raise UsageError(f"ledger URL {shown!r}: credentials need a user name (user:password@)")
    try:
        options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    except ValueError:
        raise UsageError(f"ledger URL {shown!r}: malformed options after '?'") from None
    unknown = sorted(set(options) - set(URL_OPTIONS))
    if unknown:
        raise UsageError(f"ledger URL {shown!r}: unknown option {unknown[0]!r} (known: {', '.join(URL_OPTIONS)})")
    env = os.environ if env is None else env
    files = {
        k: options.get(k) or env.get(name) or None
        for k, name in (("cacert", ETCD_CACERT_ENV), ("cert", ETCD_CERT_ENV), ("key", ETCD_KEY_ENV))
    }
    tls = TlsFiles(scheme in ("etcds", "https") or any(files.values()), **files)
    limit = options.get("max_request_bytes", str(DEFAULT_MAX_REQUEST_BYTES))
    if not limit.isdigit() or int(limit) < 1024:
        raise UsageError(f"ledger URL {shown!r}: max_request_bytes must be an integer >= 1024")
    prefix = "/" + unquote(path).strip("/") if slash and path.strip("/") else DEFAULT_PREFIX
    return EtcdUrl(tuple(endpoints), prefix, tls, user, password, int(limit))


def is_etcd_url(url: str | None) -> bool:
    """Does this ledger URL name etcd (rather than a directory)?"""
    return bool(url) and str(url).partition("://")[0] in URL_SCHEMES and "://" in str(url)


def etcd_ports(url: str | None) -> list[int]:
    """The client ports of an etcd ledger URL's members ([] for any other URL or one that does not
    parse): connections a process must never break (the in-place peer heartbeat's exemption)."""
    if not is_etcd_url(url):
        return []
    try:
        return [e.port for e in parse_etcd_url(str(url), env={}).endpoints]
    except UsageError:
        return []
