"""A worker's connection to the broker as an operator sees it: up or not, why not, when to
try again and which failures to log. Pure: every method takes ``now`` (monotonic seconds).

Before the first connection every failed attempt is logged with its reason (a wrong
``--broker`` must be visible at once); after it, an outage logs its first failure and then
one line per ``REPEAT_LOG_S`` (a broker down for an hour must not write 3,600 lines), and
the reconnect says how long it was down.
"""

from __future__ import annotations

import random
import socket
import ssl
from dataclasses import dataclass

#: Jittered exponential backoff between attempts: ``uniform(0.5, 1) * min(MAX, MIN * 2^n)``.
#: Capped low on purpose: Mosquitto forgets the group's shared subscriptions over a restart,
#: and until a worker subscribes again devices get "no matching subscribers" (they keep the
#: message and retry), so the ingest must be back before the devices are (they back off
#: for up to 30 s).
RETRY_MIN_S = 0.25
RETRY_MAX_S = 2.0
#: During an outage after the first connection, at most one failure line per this period.
REPEAT_LOG_S = 30.0


def describe_connect_error(exc: BaseException | None) -> str:
    """A failed connect attempt in words: the part of the exception an operator acts on."""
    if exc is None:
        return "connection failed"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host name ({exc.strerror or exc})"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return "no answer (timed out)"
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed: {exc.reason or exc}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


@dataclass
class Link:
    """The state of one client's broker connection and its logging policy."""

    broker: str
    connected: bool = False
    #: Successful connections so far (a CONNACK with success).
    connects: int = 0
    #: Attempts that failed since the last success (or since the start).
    failures: int = 0
    #: Why the last attempt failed; None while connected.
    error: str | None = None
    down_since: float | None = None
    _quiet_until: float = 0.0

    def retry_in(self, rng: random.Random | None = None) -> float:
        """Seconds to wait before the next attempt, after ``failures`` in a row."""
        cap = min(RETRY_MAX_S, RETRY_MIN_S * 2.0 ** min(self.failures, 16))
        return (rng or random).uniform(0.5, 1.0) * cap

    def failed(self, reason: str, now: float) -> str | None:
        """An attempt failed: the line to log at WARNING, or None to stay quiet."""
        self.connected = False
        self.failures += 1
        self.error = reason
        if self.down_since is None:
            self.down_since = now
        if self.connects == 0:
            return f"cannot connect to {self.broker}: {reason} (attempt {self.failures})"
        if self.failures > 1 and now < self._quiet_until:
            return None
        self._quiet_until = now + REPEAT_LOG_S
        return (
            f"cannot reconnect to {self.broker}: {reason} (down {now - self.down_since:.0f} s, "
            f"{self.failures} attempt(s); next such line in {REPEAT_LOG_S:.0f} s at most)"
        )

    def up(self, now: float) -> str | None:
        """Connected: the line to log at INFO when this ends an outage, else None."""
        line = None
        if self.connects > 0 and self.down_since is not None:
            line = (
                f"reconnected to {self.broker} after {now - self.down_since:.1f} s "
                f"({self.failures} failed attempt(s))"
            )
        self.connected = True
        self.connects += 1
        self.failures = 0
        self.error = None
        self.down_since = None
        return line

    def lost(self, reason: str, now: float) -> None:
        """An established connection ended (the caller logs it: once per outage)."""
        if self.connected:
            self.down_since = now
        self.connected = False
        self.error = reason
