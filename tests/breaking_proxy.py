"""A loopback TCP proxy that breaks connections the way networks and peers do: for fault tests."""
from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

BREAK_AFTER_BYTES = 1 << 20


class BreakingProxy:
    """A loopback TCP proxy in front of a receiver. Its first `broken` connections break once
    more than `after_bytes` went upstream: "reset" closes both sockets with a TCP reset (a
    crashed peer), "freeze" stops forwarding either way but keeps the sockets open (a hung peer
    or a network partition: nothing tells the sender). Later connections pass through."""

    def __init__(self, upstream: str, mode: str, after_bytes: int = BREAK_AFTER_BYTES, broken: int = 1):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.mode, self.after_bytes, self.broken = mode, after_bytes, broken
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.broken_at: float | None = None
        self._sockets: list[socket.socket] = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            breaks = self.connections < self.broken
            self.connections += 1
            upstream = socket.create_connection(self.upstream)
            self._sockets += [client, upstream]
            state = {"up": 0, "broken": False}
            for src, dst, upward in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, state, breaks, upward), daemon=True).start()

    def _pump(self, src, dst, state, breaks, upward) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                if breaks and upward and not state["broken"] and state["up"] + len(data) > self.after_bytes:
                    state["broken"] = True
                    self.broken_at = time.monotonic()
                    if self.mode == "reset":
                        for sock in (src, dst):
                            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                            # The other pump blocks in recv() on one of them, and Linux closes a
                            # socket (the reset) only once no call uses it: wake that pump first.
                            with contextlib.suppress(OSError):
                                sock.shutdown(socket.SHUT_RDWR)
                            sock.close()
                        return
                if state["broken"]:
                    self._closed.wait()  # freeze: not a byte either way, sockets left open
                    return
                if upward:
                    state["up"] += len(data)
                dst.sendall(data)
        except OSError:
            return

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
        self.listener.close()
        for sock in self._sockets:
            try:
                sock.close()
            except OSError:
                pass
