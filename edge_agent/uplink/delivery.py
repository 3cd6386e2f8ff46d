"""When a row may leave the outbox, when one the broker acknowledged is sent again, and
the pace rows go out at (:class:`TokenBucket`). Pure (times are given).

A broker acknowledges a message once it holds it in memory, and may lose it before it saves
it; with ``delivery = "stored"`` (or ``"auto"`` once a fleet has confirmed anything) a row
stays after its PUBACK until the fleet's ``cmd/stored`` names it, and is sent again when the
fleet confirms later ones but not it (:class:`Delivery`).

Design: ``docs/ARCHITECTURE.md``, "Uplink and fleet ingest" (*Stored, not just delivered*).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

_S = 1_000_000_000


class Delivery:
    """The delivery policy of one uplink (``mode``: ``auto``, ``stored`` or ``broker``).

    Pure (times are given). A broker acknowledges a message once it holds it in memory; it
    writes its state to disk only every ``autosave_interval``, so a broker killed in between
    loses what it acknowledged since. With ``delivery = "stored"`` (or ``"auto"`` once a fleet
    has confirmed anything) a row stays in the outbox after its PUBACK until the fleet's
    ``cmd/stored`` names it, and is sent again once it is still unconfirmed
    ``confirm_timeout_s`` after the fleet confirmed one the broker acknowledged later (the
    fleet is storing, but not this one: the broker lost it). Duplicates are the fleet's to
    drop; a fleet that is down (or behind) confirms nothing newer, and nothing is resent.
    """

    def __init__(self, mode: str, confirm_timeout_s: float, *, fleet_confirms: bool) -> None:
        if mode not in ("auto", "stored", "broker"):
            raise ValueError(f"delivery mode {mode!r}: expected auto, stored or broker")
        self.mode = mode
        self.timeout_ns = int(confirm_timeout_s * _S)
        self.fleet_confirms = fleet_confirms
        #: ``(arrival_ns, latest acked_ns confirmed so far)``, one per second at most.
        self._seen: deque[tuple[int, int]] = deque()

    @property
    def keep(self) -> bool:
        """Keep a row after its PUBACK (until the fleet confirms it)?"""
        return self.mode == "stored" or (self.mode == "auto" and self.fleet_confirms)

    def confirmed(self, now_ns: int, latest_acked_ns: int) -> None:
        """The fleet confirmed rows; the latest of them the broker acked at
        ``latest_acked_ns`` (0: none of them had been acked yet)."""
        self.fleet_confirms = True
        if latest_acked_ns <= 0:
            return
        seen = self._seen
        best = max(latest_acked_ns, seen[-1][1]) if seen else latest_acked_ns
        if seen and now_ns - seen[-1][0] < _S:
            seen[-1] = (seen[-1][0], best)
        else:
            seen.append((now_ns, best))

    def resend_before(self, now_ns: int) -> int | None:
        """Rows acked before this time and still unconfirmed are due to be sent again
        (``None``: none are). It is the latest ack the fleet confirmed at least
        ``confirm_timeout_s`` ago."""
        if not self.keep:
            return None
        seen, due = self._seen, now_ns - self.timeout_ns
        while len(seen) > 1 and seen[1][0] <= due:
            seen.popleft()
        if seen and seen[0][0] <= due:
            return seen[0][1]
        return None


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up. Time comes from ``monotonic``."""

    def __init__(self, rate: float, burst: float, monotonic: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = burst
        self._now = monotonic
        self._tokens = burst
        self._t = monotonic()

    def available(self) -> int:
        now = self._now()
        self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
        self._t = now
        return int(self._tokens)

    def spend(self, n: int) -> None:
        self._tokens -= n

    def wait_s(self) -> float:
        """Seconds until one whole token is there."""
        return max(0.0, (1.0 - self._tokens) / self.rate)


__all__ = ["Delivery", "TokenBucket"]
