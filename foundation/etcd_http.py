"""One HTTP/1.1 exchange with one etcd member under a total deadline: the transport of `foundation.etcd`.

Why not `requests`: its timeouts are per socket operation and fixed when a request starts, so a
server that trickles its answer a byte at a time resets them for ever (agents with a 3 s read
timeout hung for 45-50 s); bounding that from outside takes a thread per call. Here every socket
operation (connect, TLS handshake, send, each read of the status line, the headers and the body)
gets the time left of one monotonic `Budget` as its timeout, so the whole exchange ends by the
deadline, with no thread. `http.client` parses the answer (chunked or sized; its limits on header
lines and count apply), reading through `_BudgetReader`.

Why the phases matter (the failover policy in `foundation.etcd` rests on them):
- `NeverSent`: name resolution, connect, the TLS handshake, or a send that did not complete. etcd
  acts on a request only once its whole body has arrived (Content-Length framing), so the member
  provably did not act on it: the request may go to another member.
- `NoAnswer`: anything after the last byte was handed to the kernel (a reset, a timeout, a cut or
  garbled answer). The member may have acted on it: the outcome is unknown.

Limits: name resolution (`getaddrinfo`) is the one step the budget cannot interrupt (the resolver
has its own timeouts; members named by address never resolve). An answer larger than
`max_answer` bytes is refused (`AnswerTooLarge`) as soon as its size is known, never buffered.
"""

from __future__ import annotations

import http.client
import io
import select
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any


class Budget:
    """A deadline on the monotonic clock: what one call may still spend."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self.deadline = time.monotonic() + self.seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def timeout(self, cap: float | None = None) -> float:
        """The time left as a socket timeout (`TimeoutError` once it is spent)."""
        left = self.left()
        if left <= 0:
            raise TimeoutError(f"no answer within {self.seconds:g} s")
        return left if cap is None else min(left, cap)


class NeverSent(Exception):  # noqa: N818 - an outcome, caught by the caller
    """The member did not receive the whole request (see the module docstring)."""


class NoAnswer(Exception):  # noqa: N818
    """The request was sent; its answer did not come (whole) in time: the outcome is unknown."""


class AnswerTooLarge(Exception):  # noqa: N818
    """The answer is larger than the caller's cap (sent and answered: the outcome is not unknown)."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes


class _BudgetReader(io.RawIOBase):
    """The socket's reads for `http.client`, each with the budget's time left as its timeout."""

    def __init__(self, sock: socket.socket, budget: Budget) -> None:
        super().__init__()
        self.sock, self.budget = sock, budget

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        self.sock.settimeout(self.budget.timeout())
        return self.sock.recv_into(buf)


class _BudgetSocket:
    """What `http.client.HTTPResponse` needs of a socket (`makefile`), over our budgeted reader."""

    def __init__(self, sock: socket.socket, budget: Budget) -> None:
        self.sock, self.budget = sock, budget

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_BudgetReader(self.sock, self.budget))


def why(exc: BaseException) -> str:
    """One short reason for a failed socket operation (no multi-line library messages)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate not accepted ({exc.verify_message or 'verify failed'})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS error ({exc.reason or type(exc).__name__})"
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return "no answer in time" if "within" not in str(exc) else str(exc)
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ConnectionResetError):
        return "connection reset"
    if isinstance(exc, (BrokenPipeError, ConnectionAbortedError)):
        return "connection closed"
    if isinstance(exc, socket.gaierror):
        return "host name not resolved"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "connection closed before an answer"
    if isinstance(exc, http.client.IncompleteRead):
        return "answer cut short"
    if isinstance(exc, http.client.HTTPException):
        return f"malformed answer ({type(exc).__name__})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return type(exc).__name__


class Connection:
    """One persistent HTTP/1.1 connection to one member; one thread uses it at a time.

    `exchange` reuses the socket while the server keeps it open, and opens a new one when the
    old one was closed by the server in between (checked before sending, so a stale keep-alive
    connection costs a reconnect, not an "outcome unknown").
    """

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None) -> None:
        self.host, self.port, self.tls = host, port, tls
        self.sock: socket.socket | None = None
        self.host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None

    def _stale(self) -> bool:
        """The server closed (or wrote on) the idle connection: it must not carry a request."""
        if self.sock is None:
            return True
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def _connect(self, budget: Budget, connect_s: float) -> socket.socket:
        """A connected (and TLS-wrapped) socket within `connect_s` of the budget, else `NeverSent`."""
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise NeverSent(why(exc)) from None
        end = time.monotonic() + max(0.0, min(connect_s, budget.left()))
        last: BaseException = TimeoutError("no time left to connect")
        for k, (family, kind, proto, _, addr) in enumerate(infos):
            left = end - time.monotonic()
            if left <= 0:
                break
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(left / (len(infos) - k))
                sock.connect(addr)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.tls is not None:
                    sock.settimeout(max(0.001, end - time.monotonic()))
                    sock = self.tls.wrap_socket(sock, server_hostname=self.host)
                return sock
            except (OSError, ssl.SSLError) as exc:
                sock.close()
                last = exc
        raise NeverSent(why(last))

    def _send(self, path: str, body: bytes, headers: dict[str, str], budget: Budget, connect_s: float) -> socket.socket:
        if self._stale():
            self.close()
        if self.sock is None:
            self.sock = self._connect(budget, connect_s)
        lines = [f"POST {path} HTTP/1.1", f"Host: {self.host_header}", "Content-Type: application/json"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        lines += [f"Content-Length: {len(body)}", "", ""]
        data = "\r\n".join(lines).encode("latin-1") + body
        sock = self.sock
        try:
            sock.settimeout(budget.timeout())
            sock.sendall(data)  # one timeout for the whole send (Python >= 3.5)
        except (OSError, ssl.SSLError) as exc:
            self.close()  # some bytes may have gone, not all: the member never got a whole request
            raise NeverSent(why(exc)) from None
        return sock

    def _begin(self, sock: socket.socket, budget: Budget) -> http.client.HTTPResponse:
        resp = http.client.HTTPResponse(_BudgetSocket(sock, budget), method="POST")  # type: ignore[arg-type]
        try:
            resp.begin()
        except (OSError, ssl.SSLError, http.client.HTTPException) as exc:
            self.close()
            raise NoAnswer(why(exc)) from None
        return resp

    def exchange(
        self, path: str, body: bytes, headers: dict[str, str], budget: Budget, *, connect_s: float, max_answer: int
    ) -> Answer:
        """POST `body` to `path` and read the whole answer, within `budget`.

        Raises `NeverSent`, `NoAnswer` or `AnswerTooLarge`; the connection stays open for the next
        exchange only after an answer read to its end that the server did not mark "close".
        """
        sock = self._send(path, body, headers, budget, connect_s)
        resp = self._begin(sock, budget)
        if resp.length is not None and resp.length > max_answer:
            self.close()
            raise AnswerTooLarge(f"answer of {resp.length:,} bytes, over the {max_answer:,}-byte cap")
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                chunk = resp.read(min(1 << 16, max_answer + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > max_answer:
                    self.close()
                    raise AnswerTooLarge(f"answer over the {max_answer:,}-byte cap")
        except (OSError, ssl.SSLError, http.client.HTTPException) as exc:
            self.close()
            raise NoAnswer(why(exc)) from None
        if resp.will_close:
            self.close()
        return Answer(resp.status, b"".join(chunks))

    def stream(
        self, path: str, body: bytes, headers: dict[str, str], budget: Budget, *, connect_s: float
    ) -> tuple[int, Any]:
        """POST and return (status, a `read1(n)` callable) for a streamed answer (etcd's watch);
        the caller reads within the same budget and then calls `close()`."""
        sock = self._send(path, body, headers, budget, connect_s)
        resp = self._begin(sock, budget)
        return resp.status, resp.read1
