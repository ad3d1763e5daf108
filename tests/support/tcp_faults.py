"""Loopback TCP servers that misbehave on purpose, for the etcd client's failover and deadline tests.

- `ReplyDroppingProxy`: forwards each request to a real etcd member, waits until etcd has answered,
  then resets the client's connection instead of passing the answer on (a reply lost on the way
  back: the request was applied, the client cannot know).
- `TricklingServer`: reads an HTTP request and answers a valid-looking reply one byte per
  `interval` seconds (every read of a per-read timeout succeeds; only a total deadline ends it).

Both run daemon threads, bounded by `close()` (the fixtures call it), never outlive the test.
"""

from __future__ import annotations

import socket
import struct
import threading


class _Server:
    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.open.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        with self.lock:
            for s in self.open:
                try:
                    s.close()
                except OSError:
                    pass


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0): the peer sees a reset, not an orderly end."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


def _read_request(conn: socket.socket, timeout: float = 10.0) -> bytes:
    """One HTTP request (headers and a Content-Length body), or b"" when the peer went away."""
    conn.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return b""
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        while len(body) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return b""
            body += chunk
    except (OSError, ValueError):
        return b""
    return head + b"\r\n\r\n" + body


class ReplyDroppingProxy(_Server):
    """Requests pass to `upstream`; each answer is read from etcd and then the client is reset."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.requests = 0  # requests passed on to etcd
        self.answered = 0  # answers etcd gave that the client never got
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        while not self.stop.is_set():
            request = _read_request(conn)
            if not request:
                conn.close()
                return
            with socket.create_connection(self.upstream, timeout=10) as up:
                up.sendall(request)
                with self.lock:
                    self.requests += 1
                try:
                    answer = up.recv(65536)  # etcd has answered: the request was applied (or refused)
                except OSError:
                    answer = b""
            if answer:
                with self.lock:
                    self.answered += 1
            _reset(conn)  # the reply is lost on its way back
            return


class TricklingServer(_Server):
    """Answers every request with a valid-looking HTTP reply, one byte per `interval` seconds."""

    BODY = b'{"header":{"revision":"1"},"kvs":[],"count":"0","succeeded":true}'

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.requests = 0
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        if not _read_request(conn):
            conn.close()
            return
        with self.lock:
            self.requests += 1
        reply = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
            len(self.BODY),
            self.BODY,
        )
        try:
            for i in range(len(reply)):
                conn.sendall(reply[i : i + 1])
                if self.stop.wait(self.interval):
                    return
        except OSError:
            return
