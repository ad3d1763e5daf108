"""Only the sockets opened while a group formed are shut at teardown, and their peers wake at once."""

from __future__ import annotations

import os
import socket
import threading
import time

from gpuguard.recovery.runtime.group_sockets import Opened


def _pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname(), timeout=5)
    server, _ = listener.accept()
    return client, server


def test_a_peer_blocked_on_a_tracked_socket_reads_end_of_stream_and_others_are_untouched():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        before_c, before_s = _pair(listener)  # the rendezvous store, etcd, the user's own: not ours
        opened = Opened()
        ours_c, ours_s = opened.track(lambda: _pair(listener))
        # `track` remembered exactly the two ends opened meanwhile (this process holds both)
        assert opened.inodes == {f"socket:[{os.fstat(s.fileno()).st_ino}]" for s in (ours_c, ours_s)}
        got: list[bytes] = []
        woke = threading.Event()

        def blocked_peer() -> None:  # a peer waiting for data that will never come
            ours_s.settimeout(10)
            got.append(ours_s.recv(16))
            woke.set()

        t = threading.Thread(target=blocked_peer)
        t.start()
        time.sleep(0.1)
        t0 = time.monotonic()
        assert opened.shut() >= 1
        assert woke.wait(5) and time.monotonic() - t0 < 1.0
        assert got == [b""]  # end-of-stream, not a timeout
        t.join()
        assert opened.inodes == set()  # forgotten: a later shut touches nothing
        # the socket that existed before still carries data both ways
        before_c.sendall(b"ping")
        assert before_s.recv(4) == b"ping"
        before_s.sendall(b"pong")
        assert before_c.recv(4) == b"pong"
        for s in (before_c, before_s, ours_c, ours_s):
            s.close()


def test_bytes_sent_before_the_shut_still_arrive_whole():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        opened = Opened()
        a, b = opened.track(lambda: _pair(listener))
        a.sendall(b"x" * 100_000)  # in flight when the write side closes
        opened.shut()
        b.settimeout(5)
        data = b""
        while chunk := b.recv(65536):
            data += chunk
        assert data == b"x" * 100_000
        a.close()
        b.close()
