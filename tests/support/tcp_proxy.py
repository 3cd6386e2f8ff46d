"""A loopback TCP forwarder the test can cut: a network outage between a client and a real
server (PostgreSQL, a broker) without stopping the server, which other tests share.

``cut()`` resets every open connection and refuses new ones (accepted, then closed at once,
as a peer behind a dead link looks to a client that gets through); ``restore()`` forwards
again. Threads, not asyncio, so it serves clients in any thread or process.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import urllib.parse
from types import TracebackType
from typing import Self


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self.accepted = 0
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="tcp-proxy", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        _reset(self._listener)
        self._reset_all()
        self._thread.join(5)

    def cut(self) -> None:
        with self._lock:
            self._cut = True
        self._reset_all()

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def _reset_all(self) -> None:
        with self._lock:
            conns, self._open = self._open, set()
        for s in conns:
            _reset(s)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                cut = self._cut
            if cut:
                self.refused += 1
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                # A cut() since the check above must not miss this pair.
                if self._cut:
                    cut_meanwhile = True
                else:
                    cut_meanwhile = False
                    self._open |= {client, upstream}
            if cut_meanwhile:
                self.refused += 1
                _reset(client)
                _reset(upstream)
                continue
            self.accepted += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _reset(s)
            with self._lock:
                self._open -= {src, dst}


def via(url: str, port: int) -> str:
    """A database ``url`` with host and port replaced by the proxy's (user, database and
    query kept), and a short connect timeout so a cut link fails fast."""
    parts = urllib.parse.urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    query = parts.query + ("&" if parts.query else "") + "connect_timeout=2"
    return urllib.parse.urlunsplit((parts.scheme, f"{user}127.0.0.1:{port}", parts.path, query, ""))


def target_of(url: str) -> tuple[str, int]:
    """(host, port) a ``postgresql://`` URL points at."""
    parts = urllib.parse.urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 5432


def _reset(s: socket.socket) -> None:
    # SO_LINGER 0: close sends RST, so the peer sees a dead connection at once (not a clean
    # EOF it might take for an orderly shutdown). shutdown(SHUT_RD) first: on Linux, close()
    # does not wake a thread blocked in recv() or accept() on the socket, and the pump
    # thread would keep the connection's other side open until its peer sent again.
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        s.close()
