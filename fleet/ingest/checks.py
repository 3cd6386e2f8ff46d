"""Checking a batch of uplink messages and writing it to the store: pure checks per message
(:func:`check_message`), one transaction per batch (:func:`process_batch`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fleet.errors import MessageRefused
from fleet.store import IngestResult, Quarantined, Row
from fleet.store.base import QUARANTINE_PAYLOAD_MAX
from wire import Message, StateMsg, Topic, WireError, decode, parse_topic
from wire.topics import UPLINK_KINDS

#: One received message as paho's thread queues it: ``(epoch, mid, qos, topic, payload,
#: received_ns)``; ``epoch`` is the connection the mid belongs to (a mid is only valid on its
#: own connection). A plain tuple, not a dataclass: it is built in paho's thread, the one
#: every other cost of the worker's process competes with for the GIL, and a tuple literal
#: is the cheapest object there is (a frozen dataclass costs ~10 times as much).
Incoming = tuple[int, int, int, str, bytes, int]


@dataclass(slots=True)
class BatchOutcome:
    """What :func:`process_batch` did with one batch (all of it committed)."""

    inserted: int = 0
    duplicates: int = 0
    #: Rows whose key was stored with another body: quarantined by the store as ``conflict``.
    conflicts: int = 0
    states: int = 0
    #: Reason class -> messages quarantined.
    refused: dict[str, int] = field(default_factory=dict)
    #: ``(kind, text)`` of unexpected errors, for the worker to log (once per kind).
    notes: list[tuple[str, str]] = field(default_factory=list)
    #: The device time (UNIX ns) of each data message stored or found stored: the lag.
    t_ns: list[int] = field(default_factory=list)
    #: ``(site, device, boot_id, seq)`` of each data message stored or found stored (or
    #: kept as the first of a conflict): what the devices are told is stored (cmd/stored).
    stored: list[tuple[str, str, str, int]] = field(default_factory=list)


# Topics repeat (a few per device): caching the parse saves two regex matches per message.
_parse_topic = functools.lru_cache(maxsize=65_536)(parse_topic)


def check_message(topic: str, payload: bytes) -> tuple[Topic, Message]:
    """Parse an uplink message and check topic and payload against each other.

    Pure (no store, no clock). Raises :class:`MessageRefused` naming why and where.
    """
    parsed = _parse_topic(topic)
    if parsed is None or parsed.kind not in UPLINK_KINDS:
        raise MessageRefused("topic", f"topic {topic!r} is not an uplink topic")
    try:
        msg = decode(parsed.kind, payload)
    except WireError as e:
        raise MessageRefused("schema", e.reason, e.where, parsed.device) from None
    if msg.device != parsed.device:
        raise MessageRefused(
            "device_mismatch",
            f"device in payload {msg.device!r} does not match topic device {parsed.device!r}",
            "$.device",
            parsed.device,
        )
    if isinstance(msg, StateMsg) and msg.site != parsed.site:
        raise MessageRefused(
            "device_mismatch",
            f"site in payload {msg.site!r} does not match topic site {parsed.site!r}",
            "$.site",
            parsed.device,
        )
    return parsed, msg


class _Backend(Protocol):
    """The part of :class:`fleet.store.Store` that :func:`process_batch` uses."""

    def ingest(self, rows: Sequence[Row]) -> IngestResult: ...
    def quarantine(self, items: Sequence[Quarantined]) -> None: ...
    def record_state(self, device: str, site: str, state: StateMsg, received_ns: int) -> None: ...
    def device_site(self, device: str) -> str | None: ...


#: Registered sites the store process remembers: device -> (site, received_ns when read).
Sites = dict[str, tuple[str, int]]
#: How long a remembered site is trusted before the registry is read again: an operator
#: moving a device (``register_device``) takes effect within this time (and at once for
#: messages from the new site, since a mismatch always reads the registry again).
SITE_RECHECK_NS = 60 * 1_000_000_000


def check_site(
    store: _Backend, device: str, site: str, known: Sites, received_ns: int, *, auto_register: bool
) -> None:
    """Refuse a message whose topic names another site than the one ``device`` is registered
    at (``site_mismatch``), or from an unregistered device when ``auto_register`` is off
    (``unknown_device``). A new device's site is the first one it is seen at; the batch's
    own upsert registers it.

    The registry is read once per device and ``SITE_RECHECK_NS``, and again on every
    mismatch (the device may have been moved), so a well-behaved fleet costs no read per
    message. ``received_ns`` serves as the clock.
    """
    cached = known.get(device)
    if cached is not None and cached[0] == site and received_ns - cached[1] < SITE_RECHECK_NS:
        return
    registered = store.device_site(device)
    if registered is None:
        if not auto_register:
            raise MessageRefused(
                "unknown_device",
                f"unknown device {device!r} (auto-registration is off)",
                "$",
                device,
            )
        # Not committed yet: the first site of this batch (or this message's) will be.
        registered = cached[0] if cached is not None else site
    known[device] = (registered, received_ns)
    if registered != site:
        raise MessageRefused(
            "site_mismatch",
            f"site mismatch: topic site {site!r} is not {device!r}'s registered site "
            f"{registered!r}",
            "$",
            device,
        )


def _classify(
    store: _Backend,
    item: Incoming,
    known: Sites,
    auto_register: bool,
    notes: list[tuple[str, str]],
) -> Row | None:
    """The Row of a data message, ``None`` for a state message already recorded.

    Raises MessageRefused for anything to quarantine. Store errors propagate (retry the batch).
    """
    _, _, _, topic, payload, received_ns = item
    try:
        parsed, msg = check_message(topic, payload)
    except MessageRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - a bug of ours must not stop ingest
        notes.append((f"internal:{type(exc).__name__}", f"unexpected error on {topic}"))
        found = parse_topic(topic) if isinstance(topic, str) else None
        raise MessageRefused(
            "internal",
            f"internal error: {type(exc).__name__}",
            "$",
            found.device if found else None,
        ) from None
    # With auto-registration on, the batch's own upsert (ingest or record_state) registers a
    # new device in the same transaction: no separate write per new device. Off, a device
    # must exist. Either way its site must be the registered one.
    check_site(store, parsed.device, parsed.site, known, received_ns, auto_register=auto_register)
    if isinstance(msg, StateMsg):
        store.record_state(parsed.device, parsed.site, msg, received_ns)
        return None
    return Row(
        msg.device, parsed.site, parsed.kind, msg.boot_id, msg.seq, msg.t_ns, payload, received_ns
    )


def process_batch(
    store: _Backend, items: Sequence[Incoming], known: Sites, *, auto_register: bool
) -> BatchOutcome:
    """Check every message of a batch, store the good ones in one transaction, quarantine the
    rest. Returns once all of it is committed; a store failure raises (nothing to ack).

    ``known`` holds the registered sites already read (:func:`check_site`); the caller
    keeps it between batches.
    """
    out = BatchOutcome()
    rows: list[Row] = []
    refused: list[Quarantined] = []
    for item in items:
        try:
            row = _classify(store, item, known, auto_register, out.notes)
        except MessageRefused as r:
            refused.append(
                Quarantined(
                    item[3], item[4][:QUARANTINE_PAYLOAD_MAX], r.reason, r.where, item[5], r.device
                )
            )
            out.refused[r.cls] = out.refused.get(r.cls, 0) + 1
            continue
        if row is None:
            out.states += 1
        else:
            rows.append(row)
    if rows:
        out.t_ns = [r.t_ns for r in rows]
        out.stored = [(r.site, r.device, r.boot_id, r.seq) for r in rows]
        result = store.ingest(rows)
        out.inserted, out.duplicates = result.inserted, result.duplicates
        out.conflicts = result.conflicts
    if refused:
        store.quarantine(refused)
    return out
