"""Live updates for the console: device online/offline, decisions that raise or hold an
alarm, rollout and per-device transitions, as Server-Sent Events (``GET /api/v1/events``).

One poller reads the store once a second while anyone listens (:func:`diff` turns two
snapshots into events, pure) and fans out to each listener's bounded queue; a listener too
slow to keep up loses events, counted, and is sent ``resync`` (reload what you show).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent

from fleet.api.auth import Viewer
from fleet.api.context import StorePool
from fleet.errors import FleetError
from fleet.rollout.orchestrator import load
from wire.messages import DecisionMsg

log = logging.getLogger(__name__)

POLL_S = 1.0
QUEUE_MAX = 1000


@dataclass(frozen=True)
class Event:
    kind: str
    data: dict[str, Any]


@dataclass
class Snapshot:
    """What the last poll saw: devices' online state, and each rollout's state, wave and
    per-device states."""

    online: dict[str, bool] = field(default_factory=dict)
    rollouts: dict[str, tuple[str, int, dict[str, str]]] = field(default_factory=dict)


def diff(before: Snapshot, after: Snapshot) -> list[Event]:
    """The events between two snapshots (devices first, then rollouts; sorted by name)."""
    out: list[Event] = []
    for device, up in sorted(after.online.items()):
        if before.online.get(device) != up:
            out.append(Event("device.online" if up else "device.offline", {"device": device}))
    for rid, (state, wave, devices) in sorted(after.rollouts.items()):
        old_state, old_wave, old_devices = before.rollouts.get(rid, ("", -2, {}))
        if (state, wave) != (old_state, old_wave):
            out.append(Event("rollout.state", {"rollout": rid, "state": state, "wave": wave + 1}))
        for device, dstate in sorted(devices.items()):
            if old_devices.get(device) != dstate:
                out.append(
                    Event("rollout.device", {"rollout": rid, "device": device, "state": dstate})
                )
    return out


def alarm_event(device: str, t_ns: int, body: bytes) -> Event | None:
    """A ``decision.alarm`` event for a decision that raises or holds an alarm, else None."""
    m = msgspec.json.decode(body, type=DecisionMsg)
    if not (m.alarms or m.raised):
        return None
    return Event(
        "decision.alarm",
        {"device": device, "t_ns": t_ns, "label": m.label, "score": m.score,
         "alarms": list(m.alarms), "raised": list(m.raised)},
    )  # fmt: skip


class EventHub:
    """Polls while someone listens and hands each listener its own bounded queue."""

    def __init__(self, pool: StorePool, *, poll_s: float = POLL_S) -> None:
        self._pool = pool
        self._poll_s = poll_s
        self._queues: set[asyncio.Queue[Event]] = set()
        self._task: asyncio.Task[None] | None = None
        self._snapshot = Snapshot()
        self._after: tuple[int, str, str, int] | None = None
        #: Events a slow listener lost (each time, it was sent ``resync``).
        self.dropped = 0
        self.listeners = 0

    def _read(self, first: bool) -> tuple[Snapshot, list[Event]]:
        with self._pool.store() as st:
            snap = Snapshot(online={d.device: d.online for d in st.devices()})
            for rid, state, doc in st.rollouts():
                r = load(doc)[0]
                snap.rollouts[rid] = (
                    state,
                    r.wave,
                    {d.device: d.state for d in r.devices.values()},
                )
            if first:
                self._after = st.newest_received("decision")
                return snap, []
            alarms: list[Event] = []
            rows = st.decisions_received(self._after, limit=1000)
            for received, device, boot, seq, t_ns, body in rows:
                self._after = (received, device, boot, seq)
                ev = alarm_event(device, t_ns, body)
                if ev is not None:
                    alarms.append(ev)
        return snap, alarms

    async def _run(self) -> None:
        snap, _ = await asyncio.to_thread(self._read, True)
        self._snapshot = snap
        while self._queues:
            await asyncio.sleep(self._poll_s)
            try:
                snap, alarms = await asyncio.to_thread(self._read, False)
            except FleetError as exc:
                log.warning("events: %s", exc)
                continue
            events = diff(self._snapshot, snap) + alarms
            self._snapshot = snap
            for q in list(self._queues):
                for ev in events:
                    self._offer(q, ev)

    def _offer(self, q: asyncio.Queue[Event], ev: Event) -> None:
        try:
            q.put_nowait(ev)
        except asyncio.QueueFull:
            self.dropped += 1
            while not q.empty():
                q.get_nowait()
                self.dropped += 1
            q.put_nowait(Event("resync", {"reason": "events were dropped: reload"}))

    async def listen(self) -> AsyncIterator[Event]:
        q: asyncio.Queue[Event] = asyncio.Queue(QUEUE_MAX)
        self._queues.add(q)
        self.listeners = len(self._queues)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            yield Event("hello", {"poll_s": self._poll_s})
            while True:
                yield await q.get()
        finally:
            self._queues.discard(q)
            self.listeners = len(self._queues)

    async def close(self) -> None:
        self._queues.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


router = APIRouter()


@router.get("/events", response_class=EventSourceResponse, summary="Live events (SSE)")
async def events(request: Request, _who: Viewer) -> AsyncIterator[ServerSentEvent]:
    """``device.online``, ``device.offline``, ``decision.alarm``, ``rollout.state``,
    ``rollout.device``, and ``resync`` when events were lost; each ``data`` is JSON."""
    hub: EventHub = request.app.state.hub
    n = 0
    async for ev in hub.listen():
        n += 1
        yield ServerSentEvent(event=ev.kind, data=ev.data, id=str(n))
