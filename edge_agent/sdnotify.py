"""systemd integration: ``sd_notify`` messages and a watchdog that pings only on real progress.

The unit (``firmware/systemd/edge-agent.service``) is ``Type=notify`` with ``WatchdogSec=``.
A ping from a timer alone would prove only that the event loop turns; :func:`watchdog_loop`
pings only while every pipeline stage keeps moving windows, so a stuck stage, a wedged thread
or a blocked loop all end in a restart. :class:`Notifier` is the socket (a no-op outside
systemd), :class:`ProgressWatch` the pure decision.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import NoReturn

log = logging.getLogger(__name__)

#: ``STATUS=`` text is cut to this many characters: ``systemctl status`` shows one line, and
#: systemd drops a whole datagram larger than its receive buffer (4 KiB, PIPE_BUF).
STATUS_MAX_CHARS = 400

_DIGITS = re.compile(r"[0-9]+")


class Notifier:
    """Sends ``sd_notify`` datagrams to systemd; every method is a no-op when disabled.

    ``address`` is what ``sendto`` takes: a filesystem path, or ``"\\0name"`` for the abstract
    namespace; ``None`` disables the notifier (not run by systemd). Build it with
    :meth:`from_env`. Sending never raises and never blocks: a failure is counted in
    ``failures`` and logged at WARNING the first time only (the agent must keep running
    if systemd's socket goes away; systemd will notice the silence on its own).
    """

    def __init__(self, address: str | None) -> None:
        self._address = address
        self._sock: socket.socket | None = None
        self.sent = 0
        self.failures = 0
        self._warned = False
        if address is None:
            return
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError as exc:
            log.warning("sd_notify: cannot create a socket (%s); not notifying systemd", exc)
            return
        # Non-blocking: if systemd is slow to drain its queue a notification is lost and
        # counted, rather than stalling the event loop that sends it.
        sock.setblocking(False)
        self._sock = sock

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Notifier:
        """The notifier for ``$NOTIFY_SOCKET``: a path, or ``@name`` (abstract namespace).

        Unset or empty: disabled. Any other form (systemd also knows ``vsock:``) is
        disabled with a warning: a gateway's agent talks to its own systemd only.
        """
        raw = environ.get("NOTIFY_SOCKET", "")
        if not raw:
            return cls(None)
        if raw.startswith("@") and len(raw) > 1:
            return cls("\0" + raw[1:])
        if raw.startswith("/"):
            return cls(raw)
        log.warning(
            "NOTIFY_SOCKET=%r is neither an absolute path nor @name; not notifying systemd", raw
        )
        return cls(None)

    @property
    def enabled(self) -> bool:
        """True while there is a socket to send to (run by systemd and not closed)."""
        return self._sock is not None

    @property
    def address(self) -> str | None:
        """Where datagrams go (``"\\0name"`` for an abstract socket), or None."""
        return self._address

    def send(self, *lines: str) -> bool:
        """Send ``lines`` (``KEY=VALUE`` each) as one datagram; True if it was sent.

        A newline inside a line would start a new assignment systemd would obey, so it is
        replaced by a space.
        """
        sock = self._sock
        if sock is None or self._address is None or not lines:
            return False
        payload = "\n".join(line.replace("\n", " ") for line in lines).encode(errors="replace")
        try:
            sock.sendto(payload, self._address)
        except OSError as exc:
            self.failures += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "sd_notify to %r failed (%s); further failures are only counted",
                    self._address,
                    exc,
                )
            else:
                log.debug("sd_notify to %r failed again (%s)", self._address, exc)
            return False
        self.sent += 1
        return True

    def ready(self, status: str | None = None) -> bool:
        """``READY=1`` (and ``STATUS=``): start-up is over; systemd's watchdog starts now."""
        if status is None:
            return self.send("READY=1")
        return self.send("READY=1", _status_line(status))

    def status(self, text: str) -> bool:
        """``STATUS=text``: the line ``systemctl status`` shows."""
        return self.send(_status_line(text))

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the keep-alive ping. Send it only when the agent makes progress."""
        return self.send("WATCHDOG=1")

    def stopping(self) -> bool:
        """``STOPPING=1``: shutdown has begun (send it when SIGTERM arrives)."""
        return self.send("STOPPING=1")

    def reloading(self) -> bool:
        """``RELOADING=1``: a reload began; send :meth:`ready` when the new config serves.

        ``MONOTONIC_USEC=`` goes with it: under ``Type=notify-reload`` (systemd >= 253) it
        tells systemd the reload began after its reload signal; older versions ignore it.
        """
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def close(self) -> None:
        """Close the socket; later calls are no-ops returning False."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Notifier:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        return f"Notifier({self._address!r}, {state}, sent={self.sent}, failures={self.failures})"


def _status_line(text: str) -> str:
    if len(text) > STATUS_MAX_CHARS:
        text = text[: STATUS_MAX_CHARS - 3] + "..."
    return f"STATUS={text}"


def watchdog_interval_s(
    environ: Mapping[str, str] = os.environ, pid: int | None = None
) -> float | None:
    """How often to ping systemd's watchdog, in seconds, or None when it is off for us.

    Half of ``$WATCHDOG_USEC`` (what ``sd_watchdog_enabled(3)`` advises: one late ping is
    then not yet fatal). None when ``WATCHDOG_USEC`` is unset, or ``WATCHDOG_PID`` names
    another process (``pid``, default ``os.getpid()`` at call time, not at import: the
    variable is inherited across fork). Malformed values give None and a warning.
    """
    raw = environ.get("WATCHDOG_USEC", "")
    if not raw:
        return None
    # int() would also accept " 10", "1_000" and non-ASCII digits; systemd writes none.
    if not _DIGITS.fullmatch(raw) or int(raw) == 0:
        log.warning("WATCHDOG_USEC=%r: expected a positive integer; watchdog not used", raw)
        return None
    owner = environ.get("WATCHDOG_PID", "")
    if owner:
        if not _DIGITS.fullmatch(owner):
            log.warning("WATCHDOG_PID=%r: expected a process id; watchdog not used", owner)
            return None
        me = os.getpid() if pid is None else pid
        if int(owner) != me:
            log.debug("WATCHDOG_PID=%s is not us (%d); watchdog not used", owner, me)
            return None
    return int(raw) / 2 / 1_000_000


class ProgressWatch:
    """Decides whether the pipeline made progress: pure, no clock of its own, no I/O.

    ``stages`` names the counters to watch (one per stage, each counting the windows it
    has handled). :meth:`check` says "ping" only when every stage's counter changed since
    the last check that said "ping"; a stage that moved during a failed check stays
    counted, so a slow stage only has to move once per ping, not once per check.

    Windows flow even when the field buses are silent (perception emits stale windows on the
    clock), so a counter that stops really means a stage stopped.
    """

    def __init__(self, stages: Sequence[str]) -> None:
        if not stages:
            raise ValueError("ProgressWatch needs at least one stage to watch")
        if len(set(stages)) != len(stages):
            raise ValueError(f"duplicate stage names: {list(stages)}")
        self.stages: tuple[str, ...] = tuple(stages)
        self._last: dict[str, int | None] = {}
        self._moved_at: dict[str, float] = {}
        self._advanced: set[str] = set()
        self._primed = False

    def check(self, counters: Mapping[str, int], now_s: float) -> tuple[bool, str]:
        """``(True, "")`` when every stage advanced since the last ``True``; else
        ``(False, reason)``, the reason naming each stalled stage, e.g.
        ``"reasoning stalled: no progress for 2.1 s (counter 1234)"``.

        The first call only records the counters and returns ``(False, "")``: nothing to
        compare with yet, which is not a stall. A counter lower than before is a reset
        (a restarted component counts from zero) and counts as progress. A stage missing
        from ``counters`` counts as stalled: the watchdog must not vouch for what it
        cannot see.
        """
        if not self._primed:
            self._primed = True
            for stage in self.stages:
                self._last[stage] = counters.get(stage)
                self._moved_at[stage] = now_s
            return False, ""
        for stage in self.stages:
            value = counters.get(stage)
            if value is not None and value != self._last[stage]:
                self._advanced.add(stage)
                self._moved_at[stage] = now_s
            self._last[stage] = value
        stalled = [s for s in self.stages if s not in self._advanced]
        if not stalled:
            self._advanced.clear()
            return True, ""
        return False, "; ".join(self._reason(s, now_s) for s in stalled)

    def _reason(self, stage: str, now_s: float) -> str:
        value = self._last[stage]
        if value is None:
            return f"{stage} stalled: no counter"
        idle = now_s - self._moved_at[stage]
        return f"{stage} stalled: no progress for {idle:.1f} s (counter {value})"


async def watchdog_loop(
    notifier: Notifier,
    counters: Callable[[], Mapping[str, int]],
    stages: Sequence[str],
    interval_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> NoReturn:
    """Every ``interval_s``, ping systemd's watchdog if every stage advanced; never returns.

    On the first failed check of a stall it logs a WARNING and sends ``STATUS=<reason>``
    (once per stall: ``systemctl status`` then says why the agent is about to be killed);
    when progress resumes it sends ``WATCHDOG=1`` with ``STATUS=running``. ``counters`` is
    called on the loop each interval and must be cheap. ``interval_s`` must exceed the
    period of the slowest counter (a window every ``hop / rate_hz`` seconds), or a healthy
    agent looks stalled between two windows. Cancel the task to stop it.
    """
    if not interval_s > 0:  # also refuses NaN
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    watch = ProgressWatch(stages)
    watch.check(counters(), clock())
    stalled = False
    while True:
        # A fixed sleep after each check, not a fixed schedule: a check that came late
        # (the loop was busy) must not be followed by one so soon that no window could
        # have arrived in between, which would read as a stall.
        await asyncio.sleep(interval_s)
        ok, reason = watch.check(counters(), clock())
        if ok:
            if stalled:
                stalled = False
                log.info("watchdog: every stage advances again; pinging systemd")
                notifier.send("WATCHDOG=1", "STATUS=running")
            else:
                notifier.watchdog()
        elif not stalled:
            stalled = True
            log.warning(
                "watchdog: %s; withholding the systemd watchdog ping (systemd restarts the "
                "agent if this lasts past WatchdogSec)",
                reason,
            )
            notifier.status(reason)
