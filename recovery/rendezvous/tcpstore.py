"""A torch-free client for the c10d TCPStore wire protocol.

Why: `gpu-recover` and `gpu-doctor` must read (and, for the one-shot re-rendezvous trigger, write)
the rendezvous state of a live torchrun job without paying ~2.4 s for `import torch`. The protocol
is tiny: a one-byte query type, then length-prefixed strings (native uint64 length + bytes). Keys
are prefixed with `/`, as the C++ client does. Every socket call has a timeout, and `get` on a
missing key is answered with `None` after a `CHECK` instead of blocking like torch's client.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from gpuguard.foundation.errors import DataError, UnavailableError

# c10d::detail::QueryType (TCPStoreBackend.hpp)
VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY = range(9)
VALIDATION_MAGIC = 0x3C85F7CE
CHECK_READY, CHECK_NOT_READY = 0, 1
KEY_PREFIX = "/"
MAX_VALUE_BYTES = 64 * 1024 * 1024  # a rendezvous state is ~0.5 KiB; refuse nonsense lengths

_U64 = struct.Struct("=Q")
_I64 = struct.Struct("=q")
_U32 = struct.Struct("=I")


def parse_endpoint(endpoint: str, default_port: int = 29400) -> tuple[str, int]:
    """`host[:port]` (IPv6 in brackets) → (host, port); torchrun's default c10d port is 29400."""
    text = endpoint.strip()
    if not text:
        raise DataError("empty rendezvous endpoint")
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    if not host:
        raise DataError(f"rendezvous endpoint {endpoint!r} has no host")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise DataError(f"rendezvous endpoint {endpoint!r} has an invalid port")
    return host, int(port_text)


@dataclass
class StoreClient:
    """One validated connection to a TCPStore server. Use as a context manager."""

    host: str
    port: int
    timeout: float = 5.0
    _sock: socket.socket | None = None

    def __enter__(self) -> StoreClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except OSError as exc:
            raise UnavailableError(f"TCPStore {self.host}:{self.port}: cannot connect: {exc.strerror or exc}") from None
        sock.settimeout(self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._send(bytes([VALIDATE]) + _U32.pack(VALIDATION_MAGIC))

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    # --- queries -------------------------------------------------------------------------

    def check(self, *keys: str) -> bool:
        """True when every key exists (never blocks)."""
        msg = bytearray([CHECK]) + _U64.pack(len(keys))
        for key in keys:
            msg += _string(KEY_PREFIX + key)
        self._send(bytes(msg))
        return self._recv_exact(1)[0] == CHECK_READY

    def get(self, key: str) -> bytes | None:
        """The value of `key`, or None when it does not exist."""
        if not self.check(key):
            return None
        self._send(bytes([GET]) + _string(KEY_PREFIX + key))
        return self._recv_bytes()

    def set(self, key: str, value: bytes) -> None:
        """Set `key` to `value` (the server sends no reply to a SET)."""
        self._send(bytes([SET]) + _string(KEY_PREFIX + key) + _bytes(value))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Set `key` to `desired` if it holds `expected` (or is missing and `expected` is empty).

        Returns the value after the operation: equal to `desired` when the swap happened.
        """
        self._send(bytes([COMPARE_SET]) + _string(KEY_PREFIX + key) + _bytes(expected) + _bytes(desired))
        return self._recv_bytes()

    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the integer counter `key`; returns the new value."""
        self._send(bytes([ADD]) + _string(KEY_PREFIX + key) + _I64.pack(amount))
        return _I64.unpack(self._recv_exact(_I64.size))[0]

    def delete(self, key: str) -> bool:
        """Delete `key`; True when it existed."""
        self._send(bytes([DELETE_KEY]) + _string(KEY_PREFIX + key))
        return _I64.unpack(self._recv_exact(_I64.size))[0] > 0

    def num_keys(self) -> int:
        self._send(bytes([GETNUMKEYS]))
        return _I64.unpack(self._recv_exact(_I64.size))[0]

    # --- framing -------------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        if self._sock is None:
            raise UnavailableError(f"TCPStore {self.host}:{self.port}: not connected")
        try:
            self._sock.sendall(data)
        except OSError as exc:
            self.close()
            raise UnavailableError(f"TCPStore {self.host}:{self.port}: send failed: {_why(exc)}") from None

    def _recv_exact(self, n: int) -> bytes:
        if self._sock is None:
            raise UnavailableError(f"TCPStore {self.host}:{self.port}: not connected")
        buf = bytearray()
        try:
            while len(buf) < n:
                chunk = self._sock.recv(n - len(buf))
                if not chunk:
                    raise ConnectionResetError("connection closed by the store")
                buf += chunk
        except OSError as exc:
            self.close()
            raise UnavailableError(f"TCPStore {self.host}:{self.port}: receive failed: {_why(exc)}") from None
        return bytes(buf)

    def _recv_bytes(self) -> bytes:
        (length,) = _U64.unpack(self._recv_exact(_U64.size))
        if length > MAX_VALUE_BYTES:
            self.close()
            raise DataError(f"TCPStore {self.host}:{self.port}: value of {length} bytes is not a store value")
        return self._recv_exact(length) if length else b""


def _string(text: str) -> bytes:
    return _bytes(text.encode())


def _bytes(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def _why(exc: OSError) -> str:
    if isinstance(exc, socket.timeout):
        return "timed out"
    return exc.strerror or str(exc) or type(exc).__name__
