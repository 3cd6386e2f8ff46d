"""Private network namespaces for cross-process CAN over UDP multicast.

The kernel here has no SocketCAN/vcan, so processes share a bus through python-can's
``udp_multicast`` interface. Multicast sent in the host namespace would leave on the real
NIC, so every peer runs inside a throw-away namespace that has nothing but ``lo``
(with a multicast route), and refuses to start anywhere else (:func:`assert_isolated`).
Needs root (``ip netns add``). Used by the tests and by ``bench.can_ingest``.
"""

import os
import secrets
import shutil
import socket
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

#: Group base for tests and benches (administratively scoped; python-can's default
#: IPv4 group is 239.74.163.2).
GROUP_PREFIX = "239.74.163."


def netns_problem() -> str | None:
    """Why namespaces cannot be used here, or ``None`` if they can."""
    if os.geteuid() != 0:
        return "creating a network namespace needs root"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


@contextmanager
def netns(prefix: str = "efcan") -> Iterator[str]:
    """Create a namespace with only ``lo`` up and routing multicast; delete it after.

    The name is unique per call (pid + random), so concurrent runs never share one.
    Kill the processes you started in it before leaving the block.
    """
    name = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", name, "link", "set", "lo", "multicast", "on")
        _ip("-n", name, "route", "add", "224.0.0.0/4", "dev", "lo")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def in_netns(name: str, argv: Sequence[str]) -> list[str]:
    """``argv`` prefixed to run inside namespace ``name``."""
    return ["ip", "netns", "exec", name, *argv]


def _named_namespaces() -> set[int]:
    """Inodes of the namespaces ``ip netns add`` made (bind-mounted under /run/netns)."""
    try:
        entries = list(os.scandir("/run/netns"))
    except OSError:
        return set()
    return {e.stat().st_ino for e in entries}


def assert_isolated() -> None:
    """Exit unless this process is in a named namespace whose only interface is ``lo``.

    Every multicast peer calls this before it opens a socket: run by hand in the host
    namespace, it stops instead of putting CAN traffic on the plant network.
    """
    names = sorted(n for _, n in socket.if_nameindex())
    private = os.stat("/proc/self/ns/net").st_ino in _named_namespaces()
    if names != ["lo"] or not private:
        raise SystemExit(
            f"refusing to use multicast: interfaces {names}, in a named namespace: {private}; "
            "run me with `ip netns exec` in a namespace from tests.support.netns.netns()"
        )
