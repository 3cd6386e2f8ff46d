"""A real Mosquitto broker per test, on a free loopback port, that tests can kill and restart.

The binary comes from Debian's ``mosquitto`` package (``make test`` installs it). Each broker
gets its own folder for its config, persistence file and log, so a restart keeps queued
QoS 1 messages of persistent sessions, as a broker on a real site would.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.ports import free_port


def mosquitto_binary() -> str:
    found = shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
    )
    if found is None:
        raise RuntimeError("mosquitto is not installed (Debian package `mosquitto`)")
    return found


class Mosquitto:
    """One broker process. ``extra`` is appended to the generated config (listeners, ACLs)."""

    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        extra: str = "",
        config: str | None = None,
    ) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = port if port is not None else free_port()
        self.host = "127.0.0.1"
        self.extra = extra
        self._config = config
        self.proc: subprocess.Popen[bytes] | None = None
        self.conf_path = workdir / "mosquitto.conf"
        self.log_path = workdir / "mosquitto.log"

    def config_text(self) -> str:
        if self._config is not None:
            return self._config
        # As root, mosquitto drops to the `mosquitto` user before it opens its persistence
        # file and log in our folder, and silently writes neither: keep it root.
        user = "user root\n" if os.geteuid() == 0 else ""
        return (
            user + f"listener {self.port} 127.0.0.1\n"
            "allow_anonymous true\n"
            "persistence true\n"
            f"persistence_location {self.workdir}/\n"
            "autosave_interval 1\n"
            # Replays after an outage queue many messages per client; the default (1000)
            # would drop them at the broker, which is not what these tests are about.
            "max_queued_messages 1000000\n"
            "max_inflight_messages 100\n"
            f"log_dest file {self.log_path}\n"
            "log_type error\nlog_type warning\nlog_type notice\n"
            f"{self.extra}"
        )

    def start(self, timeout: float = 10.0) -> None:
        text = self.config_text()
        self.conf_path.write_text(text)
        ports = self.listener_ports(text)
        self.proc = subprocess.Popen(
            [mosquitto_binary(), "-c", str(self.conf_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                log = self.log_path.read_text() if self.log_path.exists() else ""
                raise RuntimeError(f"mosquitto exited ({self.proc.returncode}): {err}{log}")
            waiting = [port for port in ports if not self._accepts(port)]
            if not waiting:
                return
            ports = waiting
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"mosquitto did not listen on {ports} within {timeout} s")

    def _accepts(self, port: int) -> bool:
        try:
            with socket.create_connection((self.host, port), timeout=0.2):
                return True
        except OSError:
            return False

    def listener_ports(self, text: str) -> list[int]:
        """Every ``listener PORT`` in the config: mosquitto opens them one after another, so
        a client of the second listener may be refused while the first already accepts."""
        ports = [int(m) for m in re.findall(r"^listener\s+(\d+)", text, re.MULTILINE)]
        return ports or [self.port]

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop the broker (SIGTERM saves its persistence file; SIGKILL does not)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def reload(self) -> None:
        """SIGHUP: Mosquitto reads its config, ACL, certificates and CRL again."""
        assert self.proc is not None, "the broker is not running"
        self.proc.send_signal(signal.SIGHUP)

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


@contextmanager
def mosquitto(workdir: Path, **kwargs: object) -> Iterator[Mosquitto]:
    broker = Mosquitto(workdir, **kwargs)  # type: ignore[arg-type]
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
