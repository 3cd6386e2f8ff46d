"""The outbox's rows to the broker and back: sending in id order, paced, within a window
of unacknowledged PUBLISHes; settling each PUBACK; letting rows go when the fleet confirms
them; sending again what was lost. One :class:`Pump` per uplink, on its event loop thread.

The connection itself (connect, reconnect, state messages, commands) is
:class:`edge_agent.uplink.publisher.Uplink`'s; the pump is handed the connected client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTErrorCode

from edge_agent.uplink.config import UplinkSection
from edge_agent.uplink.delivery import Delivery, TokenBucket
from edge_agent.uplink.outbox import Outbox, OutboxRow
from wire.commands import decode_stored
from wire.errors import WireError
from wire.messages import MAX_PAYLOAD_BYTES

log = logging.getLogger(__name__)

#: Pause before sending a row again that nobody was subscribed to.
NO_SUBSCRIBERS_RETRY_S = 1.0
#: How often rows acked but not confirmed by the fleet are looked at (see .delivery).
RESEND_CHECK_S = 1.0


class Pump:
    """What goes out and when it is let go (see the module docstring).

    ``invalid`` is the uplink's per-kind counter of messages never sent; ``wake`` its event
    (set by every PUBACK and confirmation); ``clock_ns`` the wall clock of the outbox.
    """

    def __init__(
        self,
        outbox: Outbox,
        section: UplinkSection,
        *,
        wake: asyncio.Event,
        invalid: dict[str, int],
        clock_ns: Callable[[], int],
    ) -> None:
        self.outbox = outbox
        self.max_inflight = section.max_inflight
        self.delivery = Delivery(
            section.delivery, section.confirm_timeout_s, fleet_confirms=outbox.fleet_confirms
        )
        self.bucket = TokenBucket(
            section.replay_rate_per_s,
            max(1.0, min(section.replay_rate_per_s, float(section.max_inflight))),
            time.monotonic,
        )
        self._wake = wake
        self._invalid = invalid
        self._clock_ns = clock_ns
        self.inflight: dict[int, tuple[int, str]] = {}  # mid -> (row id, kind)
        self._acks: list[int] = []
        #: Rows to delete whatever the delivery mode (the broker refused them).
        self._drops: list[int] = []
        self._cursor = 0
        self._resend_from: int | None = None
        self._hold_until = 0.0
        self._resend_check = 0.0
        self.sent = 0
        self.acked = 0
        self.rejected: dict[str, int] = {}
        self.no_subscribers = 0
        #: ``cmd/stored`` messages taken (and refused), and rows sent again for want of one.
        self.confirmations = 0
        self.confirm_errors = 0
        self.resent = 0
        self.last_error: str | None = None

    # -- the connection's events --------------------------------------------------------------

    def connected(self) -> None:
        """A new connection: PUBACKs still pending settle (else delivery ``broker`` would
        send again rows the broker acked just before the connection went: duplicates), and
        sending starts again at the oldest row the broker never acknowledged. Kept rows
        waiting for the fleet are not sent again here: a broker restart would otherwise
        have every device send its whole unconfirmed backlog at once (twice the queue the
        broker is sized for, while the fleet is behind); :meth:`_resend_stale` sends those
        the fleet shows it lost."""
        self.inflight.clear()
        self.settle()
        self._cursor = self.outbox.resume_after() if self.delivery.keep else 0

    def lost(self) -> None:
        self.inflight.clear()

    def puback(self, mid: int, failed: bool, why: str, nobody: bool) -> bool:
        """A PUBACK for ``mid``; False if ``mid`` is not a row of ours (a state message)."""
        entry = self.inflight.pop(mid, None)
        if entry is None:
            return False
        row_id, kind = entry
        if nobody:
            # "No matching subscribers": the broker took it but nobody will get it. The
            # fleet's subscription can be missing for a moment (Mosquitto 2.0 does not
            # restore shared subscriptions of persistent sessions after a restart), so the
            # row stays and is sent again, in order, after a pause.
            self.no_subscribers += 1
            if self._resend_from is None or row_id < self._resend_from:
                self._resend_from = row_id
            self._hold_until = time.monotonic() + NO_SUBSCRIBERS_RETRY_S
        elif failed:
            # The broker refused it (e.g. not authorised): sending it again cannot help.
            self.rejected[kind] = self.rejected.get(kind, 0) + 1
            self.last_error = f"broker refused a {kind} message: {why}"
            log.warning("uplink: broker refused a %s message: %s", kind, why)
            self._drops.append(row_id)
        else:
            self.acked += 1
            self._acks.append(row_id)
        self._wake.set()
        return True

    def stored(self, payload: bytes) -> None:
        """The fleet's ``cmd/stored``: its seqs leave the outbox."""
        try:
            cmd = decode_stored(payload)
        except WireError as exc:
            self.confirm_errors += 1
            self.last_error = f"cmd/stored: {exc}"
            log.warning("uplink: ignored a malformed cmd/stored: %s", exc)
            return
        self.confirmations += 1
        _deleted, latest = self.outbox.confirm(cmd.boot_id, cmd.seqs)
        self.delivery.confirmed(self._clock_ns(), latest)
        self._wake.set()

    def settle(self) -> None:
        """Apply the PUBACKs gathered so far to the outbox (delete, or keep for the fleet's
        confirmation), and delete the rows the broker refused."""
        if self._acks:
            acks, self._acks = self._acks, []
            if self.delivery.keep:
                self.outbox.mark_acked(acks)
            else:
                self.outbox.ack(acks)
        if self._drops:
            drops, self._drops = self._drops, []
            self.outbox.ack(drops)

    # -- sending ------------------------------------------------------------------------------

    async def drain(
        self,
        client: mqtt.Client,
        connected: Callable[[], bool],
        *,
        until_idle: bool = False,
        tick: Callable[[], None] | None = None,
    ) -> None:
        """Send outbox rows while ``connected()`` (or, ``until_idle``, until nothing is left
        to send or to be confirmed). ``tick`` is called at every turn (at least once a
        second while rows are kept for the fleet's confirmation)."""
        while connected():
            self._wake.clear()
            self.settle()
            if tick is not None:
                tick()
            if self._resend_from is not None:
                self._cursor = min(self._cursor, self._resend_from - 1)
                self._resend_from = None
            if until_idle and self._idle():
                return
            hold = self._hold_until - time.monotonic()
            if hold > 0:
                if until_idle:
                    return  # shutting down: the rows wait in the outbox for the next start
                await woken(self._wake, hold)
                continue
            timeout: float | None = RESEND_CHECK_S if self.delivery.keep else None
            free = self.max_inflight - len(self.inflight)
            if free > 0 and not until_idle:
                free -= self._resend_stale(client, free)
            if free > 0:
                n = min(free, self.bucket.available())
                if n > 0:
                    rows = self.outbox.peek(self._cursor, n)
                    self.send(client, rows)
                    if len(rows) == n:
                        timeout = self.bucket.wait_s()
                else:
                    timeout = self.bucket.wait_s()
            await woken(self._wake, timeout)

    def _idle(self) -> bool:
        return (
            not self.inflight
            and not self.outbox.peek(self._cursor, 1)
            and not (self.delivery.keep and self.outbox.awaiting)
        )

    def _resend_stale(self, client: mqtt.Client, free: int) -> int:
        """Send again (up to ``free``, once a second) rows the broker acked and the fleet
        has not confirmed though it confirmed later ones (see .delivery); how many."""
        now = time.monotonic()
        if now < self._resend_check:
            return 0
        self._resend_check = now + RESEND_CHECK_S
        before = self.delivery.resend_before(self._clock_ns())
        if before is None:
            return 0
        n = min(free, self.bucket.available())
        rows = self.outbox.stale(before, n) if n > 0 else []
        if rows:
            log.info("uplink: sending %d row(s) again: stored by no fleet since acked", len(rows))
            self.send(client, rows, resend=True)
            self.resent += len(rows)
        return len(rows)

    def send(self, client: mqtt.Client, rows: Sequence[OutboxRow], *, resend: bool = False) -> None:
        """Publish ``rows`` (QoS 1); ``resend``: rows behind the cursor, which stays."""
        for row in rows:
            if len(row.payload) > MAX_PAYLOAD_BYTES:
                # publish() never stores one (wire.decode caps it), but an outbox written by
                # another build could hold one: the fleet's ingest would never get it (its
                # Maximum Packet Size), so it is never sent, and counted.
                self._invalid[row.kind] = self._invalid.get(row.kind, 0) + 1
                self.last_error = (
                    f"outbox row {row.id}: a {row.kind} payload of {len(row.payload)} bytes is "
                    f"over the wire limit of {MAX_PAYLOAD_BYTES}; dropped unsent"
                )
                log.error("uplink: %s", self.last_error)
                self._drops.append(row.id)
                if not resend:
                    self._cursor = row.id
                continue
            info = client.publish(row.topic, row.payload, qos=1)
            if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                # The connection is going down; on_disconnect follows and we resend later.
                self.last_error = f"publish: {mqtt.error_string(info.rc)}"
                return
            self.inflight[info.mid] = (row.id, row.kind)
            if not resend:
                self._cursor = row.id
            self.bucket.spend(1)
            self.sent += 1

    def stats(self) -> dict[str, object]:
        ob = self.outbox.stats()
        return {
            "sent": self.sent,
            "acked": self.acked,
            "inflight": len(self.inflight),
            "backlog_rows": ob["rows"],
            "outbox_rows": ob["rows"],
            "outbox_bytes": ob["bytes"],
            "delivery": "stored" if self.delivery.keep else "broker",
            "awaiting_confirmation": ob["awaiting_confirmation"],
            "confirmations": self.confirmations,
            "confirm_errors": self.confirm_errors,
            "confirmed": ob["confirmed"],
            "resent": self.resent,
            "dropped": ob["dropped"],
            "rejected": dict(self.rejected),
            "no_subscribers": self.no_subscribers,
            "outbox_errors": ob["put_errors"],
            # 1 when the outbox was found corrupt at start, moved aside and started empty.
            "outbox_corrupt_recoveries": ob["corrupt_recoveries"],
        }


async def woken(wake: asyncio.Event, timeout: float | None) -> None:
    """Wait up to ``timeout`` s for ``wake``.

    Not ``asyncio.wait_for``: on Python 3.11 it swallows a cancel that arrives in the step
    the event is set, and the agent does exactly that at stop (it publishes its last
    windows, then cancels the uplink), so the uplink would never end.
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await wake.wait()


__all__ = ["Pump", "woken"]
