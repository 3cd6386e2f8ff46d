"""The example agent config, made runnable by a test: fresh state folder, free ports."""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from edge_agent.config import AgentConfig, parse_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example_text() -> str:
    """The example config with its state (memory store) in a fresh temporary folder."""
    state = tempfile.mkdtemp(prefix="edge-agent-state-")
    return (
        (EXAMPLES / "agent.toml")
        .read_text()
        .replace('state_dir = "../var/demo-gw-01"', f'state_dir = "{state}"')
        .replace("port = 8080", "port = 0")
    )


def example_config_text(port: int, channel: str) -> str:
    """The example config's text reading the simulator's Modbus server on ``port`` and its
    virtual CAN ``channel``, status every 0.5 s (parse it with ``base_dir=EXAMPLES``)."""
    text = example_text()
    text = text.replace("port = 15020", f"port = {port}").replace(
        'channel = "edgefleet-demo"', f'channel = "{channel}"'
    )
    return text.replace("stats_interval_s = 2.0", "stats_interval_s = 0.5")


def example_config(port: int, channel: str) -> AgentConfig:
    """:func:`example_config_text`, parsed."""
    return parse_config(example_config_text(port, channel), base_dir=EXAMPLES)


class Datagrams:
    """A real ``NOTIFY_SOCKET``: collects (monotonic time, message) from a thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._recv, daemon=True)
        self._thread.start()

    def _recv(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def wait_for(self, line: str, timeout: float) -> float:
        """Monotonic time of the first datagram holding ``line``; fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            for t, msg in list(self.messages):
                if line in msg.splitlines():
                    return t
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        raise AssertionError(f"no {line!r} within {timeout} s; got {self.messages}")

    def times_of(self, line: str, since: float = 0.0, until: float = float("inf")) -> list[float]:
        return [t for t, m in list(self.messages) if line in m.splitlines() and since <= t < until]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


class Lines:
    """A child's text stream read from a thread, so a test can wait for a log line while
    the child runs and still have the whole text once it has exited."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float) -> str:
        """The first line holding ``text``; fails after ``timeout`` with the last lines."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if text in line:
                    return line
            time.sleep(0.02)
        raise AssertionError(f"no {text!r} within {timeout} s; last lines: {self.lines[-20:]}")

    def text(self, timeout: float = 10.0) -> str:
        """Everything, once the stream has ended (the child exited)."""
        self._thread.join(timeout)
        return "".join(self.lines)


@contextmanager
def notify_socket(tmp_path: Path) -> Iterator[Datagrams]:
    d = Datagrams(tmp_path / "notify.sock")
    try:
        yield d
    finally:
        d.close()
