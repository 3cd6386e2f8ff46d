"""Whether the simulator's Modbus TCP port can be bound, asked before pymodbus binds it.

pymodbus turns a bind failure into a logged warning and a ``RuntimeError`` without the
errno ("Could not start listen, please check address"); binding a socket of our own first,
with the ``SO_REUSEADDR`` its server uses, tells a port in use from anything else.
"""

from __future__ import annotations

import errno
import socket

from drivers.errors import PortInUse


def check_bindable(host: str, port: int) -> None:
    """Raise :class:`PortInUse` if another socket listens on ``host:port``.

    Port 0 (any free port) and a host that does not resolve pass: the server's own bind
    then reports what is wrong.
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(host, port) from None
