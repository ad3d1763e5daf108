"""The TCP sockets a generation's gloo groups opened, so that leaving the generation really closes them.

A gloo group closes its connections only when the C++ object is freed, and `destroy_process_group`
does not free it while anything still references it: FSDP2 keeps its mesh's groups in hooks that
the autograd engine holds from C++ (measured on torch 2.13: after a failed step and teardown, the
groups of a dropped FSDP2 model stayed alive, referenced only from closure cells nobody in Python
holds). A peer blocked on such a group waits for the group timeout, and the in-place coordinator
then kills it as a member that did not report. So the runtime notes every socket that appears while
it forms a group or builds the model (`Opened`, by socket inode: a number reused for another file is
not ours), and at teardown shuts down their write side (`shut`): a peer's pending read returns
end-of-stream at once (`shutdown()` acts on the socket, not the descriptor). Only the write side:
shutting the read side as well tore a message gloo was reading on this side (seen once: gloo's
"Received data size doesn't match expected size", std::terminate). Sockets that existed
before (the rendezvous store, etcd, the user's own) are never touched.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

MAX_FDS = 65536  # /proc/self/fd entries looked at

T = TypeVar("T")


def socket_inodes() -> dict[str, int]:
    """`socket:[inode]` -> fd of every socket this process holds (Linux; {} where /proc is absent)."""
    out: dict[str, int] = {}
    try:
        names = os.listdir("/proc/self/fd")[:MAX_FDS]
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out.setdefault(link, int(name))
    return out


class Opened:
    """The sockets opened while groups formed (`track(fn)`), shut down on `shut()`."""

    def __init__(self) -> None:
        self.inodes: set[str] = set()

    def track(self, fn: Callable[[], T]) -> T:
        """Run `fn` (a group's creation, `build()`), remembering every socket that appeared meanwhile."""
        before = set(socket_inodes())
        try:
            return fn()
        finally:
            self.inodes |= set(socket_inodes()) - before

    def shut(self) -> int:
        """Shut down the write side of every remembered TCP socket still connected; how many. Forgets them all."""
        # the write side only: the peer reads every byte sent, then end-of-stream (no torn message),
        # and gloo's own pending reads on this side are not cut mid-message
        fds = [fd for link, fd in socket_inodes().items() if link in self.inodes]
        self.inodes.clear()
        return shutdown_tcp(fds, socket.SHUT_WR)


def shutdown_tcp(fds: Iterable[int], how: int, peer_ok: Callable[[tuple[Any, ...]], bool] | None = None) -> int:
    """`shutdown(how)` on each fd that is a connected TCP socket (whose peer address `peer_ok`
    accepts, if given); how many. Done on a duplicate: the owner's descriptor stays open."""
    count = 0
    for fd in fds:
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            s = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                peer = s.getpeername()  # connected only: a listener is left to its owner
                if peer_ok is None or peer_ok(peer):
                    s.shutdown(how)
                    count += 1
        except (OSError, ValueError):
            pass  # not connected (a listener) or already shut
        finally:
            s.close()  # the duplicate only
    return count
