"""``ModbusSource``: poll one Modbus port and turn register blocks into samples.

One task per port. A serial line carries one request at a time, and pymodbus serialises
requests on a TCP connection too, so a single loop that picks the next due block is both
the simplest and the fastest design: no locks, no per-unit tasks racing for the port.

The source is ``up`` only while the port is open and at least one unit answers: data that
came in before the device went away does not make it up.
"""

import asyncio
import heapq
import logging
import random
import time
from collections.abc import Mapping
from itertools import repeat

from drivers.backoff import backoff_delay
from drivers.buffer import SampleBuffer
from drivers.errors import (
    ModbusConnectionError,
    ModbusError,
    ModbusExceptionResponse,
    ModbusTimeout,
)
from drivers.modbus.client import ModbusClient
from drivers.modbus.codec import block_decoder
from drivers.modbus.plan import ReadBlock, plan_blocks, split_block
from drivers.sample import Sample, new_sample
from drivers.specs import ModbusSpec

log = logging.getLogger(__name__)

# Exception codes by which a gateway says the unit behind it does not answer: as good as a
# timeout for backoff purposes (10 = gateway path unavailable, 11 = target failed to respond).
_GATEWAY_CODES = frozenset((10, 11))
_ILLEGAL_DATA_ADDRESS = 2


class _UnitState:
    __slots__ = (
        "exception_responses",
        "failures",
        "id",
        "last_error",
        "state",
        "timeouts",
        "until",
    )

    def __init__(self, unit: int) -> None:
        self.id = unit
        # "unknown" until asked; "ok" after an answer, "backoff" while failing itself,
        # "unreachable" while the port is down (then "unknown" again once it is back).
        self.state = "unknown"
        self.failures = 0  # consecutive failures, drives the backoff exponent
        self.until = 0.0  # monotonic time the backoff ends
        self.timeouts = 0
        self.exception_responses = 0
        self.last_error = ""


class _BlockState:
    """A block plus what the hot path needs, precomputed."""

    __slots__ = (
        "block",
        "deadbands",
        "decode",
        "exc_code",
        "filtered",
        "last",
        "last_t",
        "names",
        "period",
        "unit",
    )

    def __init__(self, block: ReadBlock, unit: _UnitState) -> None:
        self.block = block
        self.unit = unit
        self.period = block.poll_ms / 1000.0
        # Every value of the block from its registers, in entry order, in one call.
        self.decode = block_decoder([(e.offset, e.spec) for e in block.entries])
        self.names = tuple(e.spec.name for e in block.entries)
        self.deadbands = tuple(e.spec.deadband for e in block.entries)
        # Whether any value has a deadband; blocks without one take the plain fast path.
        self.filtered = any(self.deadbands)
        # Last emitted value and its monotonic time, per value (deadband / heartbeat).
        self.last: list[float | None] = [None] * len(self.names)
        self.last_t: list[float] = [0.0] * len(self.names)
        self.exc_code = 0  # last exception code answered for this block, 0 = none


class ModbusSource:
    """Polls every register of one :class:`ModbusSpec` port into a :class:`SampleBuffer`.

    Samples are stamped with ``time.time_ns()`` when the reply arrives (one stamp per block).
    A value is emitted when it moved by at least its ``deadband`` since the last emitted
    value, or ``spec.heartbeat_ms`` after that emission; ``deadband=0`` emits every poll.
    ``poll_ms=0`` polls as fast as the port answers.

    ``run`` only ends by cancellation; every Modbus fault is ridden out and counted in
    :meth:`stats`. Raises :class:`drivers.errors.DriverConfigError` at construction for a
    register map that cannot be polled. ``rng`` makes backoff jitter reproducible in tests.

    Fault handling, by who is at fault:

    * **A unit** (no answer, garbled answer, or a gateway saying the unit is unreachable): the
      unit goes into jittered exponential backoff and its blocks are skipped until the backoff
      expires; then one block is sent as a probe. Other units keep their schedule; the only time
      a dead unit costs them is its probe's timeout.
    * **The register map** (exception reply, e.g. code 2 "illegal data address"): the unit is
      alive, so it is not backed off; the code is counted and logged when it changes. A
      coalesced block refused with code 2 is split into one read per value once, because the
      hole between two values is usually what the device does not map.
    * **The port** (cannot connect, connection lost): every unit waits (``unreachable``), the
      port backs off and reconnects; each successful reconnect is counted.
    """

    def __init__(self, spec: ModbusSpec, *, rng: random.Random | None = None) -> None:
        self.name = spec.name
        self.spec = spec
        self.blocks: tuple[ReadBlock, ...] = tuple(plan_blocks(spec))
        self._rng = rng if rng is not None else random.Random()
        self._units: dict[int, _UnitState] = {}
        for b in self.blocks:
            self._units.setdefault(b.unit, _UnitState(b.unit))
        self._heartbeat_s = spec.heartbeat_ms / 1000.0
        self._client: ModbusClient | None = None
        self._port_failures = 0
        self.requests = 0
        self.replies = 0
        self.timeouts = 0
        self.exception_responses = 0
        self.errors = 0
        self.connection_errors = 0
        self.samples = 0
        self.late_polls = 0
        self.splits = 0
        self.last_error = ""

    def stats(self) -> Mapping[str, int | float | str]:
        """Counters since construction, plus ``unit.<id>.*`` per unit.

        ``requests`` counts read attempts; each ends as one of ``replies`` (data),
        ``exception_responses``, ``timeouts``, ``errors`` (garbled/mismatched replies) or a
        connection error. ``connection_errors`` counts every failed attempt to open the port
        and every connection lost during a request. ``reconnects`` counts
        connections opened after the first, whether after a loss or after pymodbus dropped
        the connection for silent units. ``late_polls`` counts polls that finished after
        their next slot was due (the port cannot keep up with the poll periods);
        ``blocks_split`` counts coalesced blocks split after "illegal data address".

        ``up`` is 1 while the port is connected and at least one unit's last request was
        answered (data or an exception reply: the unit is there). ``last_error`` is the
        latest failure of any kind (port, unit or exception reply); it stays after recovery.
        ``unit.<id>.state`` is ``unknown`` before the unit is asked, then ``ok``,
        ``backoff`` (it timed out or its gateway says it is gone) or ``unreachable`` (the
        port is down); ``unit.<id>.last_error`` is why it last was not ``ok``.
        """
        client = self._client
        connected = client is not None and client.connected
        out: dict[str, int | float | str] = {
            "up": int(connected and any(u.state == "ok" for u in self._units.values())),
            "last_error": self.last_error,
            "requests": self.requests,
            "replies": self.replies,
            "timeouts": self.timeouts,
            "exception_responses": self.exception_responses,
            "errors": self.errors,
            "connection_errors": self.connection_errors,
            "reconnects": max(0, client.connects - 1) if client is not None else 0,
            "connected": int(connected),
            "samples": self.samples,
            "late_polls": self.late_polls,
            "blocks_split": self.splits,
        }
        for uid in sorted(self._units):
            u = self._units[uid]
            out[f"unit.{uid}.state"] = u.state
            out[f"unit.{uid}.timeouts"] = u.timeouts
            out[f"unit.{uid}.exception_responses"] = u.exception_responses
            out[f"unit.{uid}.last_error"] = u.last_error
        return out

    async def run(self, sink: SampleBuffer) -> None:
        """Poll until cancelled, putting samples into ``sink``."""
        async with ModbusClient(self.spec) as client:
            self._client = client
            await self._poll_forever(client, sink)

    async def _poll_forever(self, client: ModbusClient, sink: SampleBuffer) -> None:  # noqa: PLR0915 - the poll loop: one cycle inline on the hot path, reconnect around it
        monotonic = time.monotonic
        # Connect before starting the schedule, so the time it takes (pymodbus adds 100 ms)
        # does not make every block start late.
        while not client.connected:
            try:
                await client.connect()
            except ModbusConnectionError as exc:
                await self._port_down(exc)
        if self._port_failures:
            self._port_up()
        start = monotonic()
        # (due, tie-break, block): the tie-break keeps equal due times in plan order and
        # round-robins blocks polled "as fast as possible".
        heap: list[tuple[float, int, _BlockState]] = [
            (start, i, _BlockState(b, self._units[b.unit])) for i, b in enumerate(self.blocks)
        ]
        heapq.heapify(heap)
        seq = len(heap)
        while True:
            due, tie, st = heap[0]
            now = monotonic()
            if due > now:
                await asyncio.sleep(due - now)
                continue
            unit = st.unit
            if unit.until > now:
                # Unit in backoff: park the block until the backoff ends. The first of the
                # unit's blocks to come due then is the single probe.
                heapq.heapreplace(heap, (unit.until, tie, st))
                continue
            block = st.block
            self.requests += 1
            connects = client.connects
            try:
                values = await client.read(block.function, block.unit, block.start, block.count)
            except ModbusConnectionError as exc:
                await self._port_down(exc)
                continue  # same block, same due time: it is retried after reconnecting
            except ModbusExceptionResponse as exc:
                replacement = self._exception_reply(st, exc)
                if replacement:
                    heapq.heappop(heap)
                    now = monotonic()
                    for new in replacement:
                        heapq.heappush(heap, (now, seq, new))
                        seq += 1
                    continue
            except ModbusTimeout as exc:
                self.timeouts += 1
                unit.timeouts += 1
                self._unit_failed(unit, exc)
            except ModbusError as exc:
                self.errors += 1
                self._unit_failed(unit, exc)
            else:
                t_ns = time.time_ns()
                self.replies += 1
                if self._port_failures:
                    self._port_up()
                if unit.failures or unit.state != "ok":
                    self._unit_answered(unit)
                if st.exc_code:
                    log.info(
                        "%s: unit %d %s %d+%d answers again (was exception code %d)",
                        self.name,
                        unit.id,
                        block.function,
                        block.start,
                        block.count,
                        st.exc_code,
                    )
                    st.exc_code = 0
                self._emit(st, values, t_ns, sink)

            # Next due on the period grid. A block that missed its next slot (the port was
            # busy, e.g. with a dead unit's probe) is read once now rather than in a burst.
            # Slots lost to (re)connecting are not the port falling behind: not counted.
            now = monotonic()
            nxt = due + st.period
            if nxt < now:
                if st.period and client.connects == connects:
                    self.late_polls += 1
                nxt = now
            heapq.heapreplace(heap, (nxt, tie, st))

    def _emit(
        self, st: _BlockState, values: list[int] | list[bool], t_ns: int, sink: SampleBuffer
    ) -> None:
        names = st.names
        n = len(names)
        if not st.filtered:
            # map/zip keep the per-value work in C: this runs for every read of every block.
            rows = zip(names, st.decode(values), repeat(t_ns, n), strict=True)
            out = list(map(new_sample, repeat(Sample, n), rows))
        else:
            out = []
            last, last_t = st.last, st.last_t
            mono = time.monotonic()
            heartbeat = self._heartbeat_s
            for i, (name, value, deadband) in enumerate(
                zip(names, st.decode(values), st.deadbands, strict=True)
            ):
                if deadband:
                    prev = last[i]
                    # NaN never compares within the deadband, so it is always emitted.
                    if (
                        prev is not None
                        and abs(value - prev) < deadband
                        and mono - last_t[i] < heartbeat
                    ):
                        continue
                    last[i] = value
                    last_t[i] = mono
                out.append(new_sample(Sample, (name, value, t_ns)))
            if not out:
                return
        self.samples += len(out)
        sink.put_many(out)

    def _exception_reply(
        self, st: _BlockState, exc: ModbusExceptionResponse
    ) -> list[_BlockState] | None:
        """Count and log an exception reply; return replacement blocks if ``st`` is split."""
        unit, block = st.unit, st.block
        self.exception_responses += 1
        unit.exception_responses += 1
        self.last_error = str(exc)
        if exc.code in _GATEWAY_CODES:
            self._unit_failed(unit, exc)
            return None
        # Any other code is an answer: the unit is alive.
        if unit.failures or unit.state != "ok":
            self._unit_answered(unit)
        if exc.code == _ILLEGAL_DATA_ADDRESS and len(block.entries) > 1:
            parts = split_block(block)
            if len(parts) > 1:
                self.splits += 1
                log.warning(
                    "%s: unit %d refused %s %d+%d with illegal data address; reading its "
                    "%d values one by one from now on (lower max_gap to avoid this)",
                    self.name,
                    unit.id,
                    block.function,
                    block.start,
                    block.count,
                    len(parts),
                )
                return [_BlockState(p, unit) for p in parts]
        if exc.code != st.exc_code:
            log.warning(
                "%s: unit %d answered exception code %d for %s %d+%d (%s)",
                self.name,
                unit.id,
                exc.code,
                block.function,
                block.start,
                block.count,
                ", ".join(e.spec.name for e in block.entries),
            )
            st.exc_code = exc.code
        return None

    def _unit_failed(self, unit: _UnitState, exc: ModbusError) -> None:
        delay = backoff_delay(
            unit.failures,
            base_s=self.spec.backoff_min_ms / 1000.0,
            max_s=self.spec.backoff_max_ms / 1000.0,
            rng=self._rng,
        )
        unit.failures += 1
        unit.until = time.monotonic() + delay
        unit.last_error = self.last_error = str(exc)
        if unit.state != "backoff":
            log.warning(
                "%s: unit %d failed (%s); skipping it, next try in %.1f s",
                self.name,
                unit.id,
                exc,
                delay,
            )
            unit.state = "backoff"
        else:
            log.debug(
                "%s: unit %d still failing (%s); next try in %.1f s", self.name, unit.id, exc, delay
            )

    def _unit_answered(self, unit: _UnitState) -> None:
        if unit.state == "backoff":
            log.info(
                "%s: unit %d answers again after %d failed tries", self.name, unit.id, unit.failures
            )
        unit.state = "ok"
        unit.failures = 0
        unit.until = 0.0

    async def _port_down(self, exc: ModbusConnectionError) -> None:
        self.connection_errors += 1
        self.last_error = str(exc)
        for unit in self._units.values():
            # Not the unit's fault: its failure count (backoff) is left alone.
            unit.state = "unreachable"
            unit.last_error = str(exc)
        delay = backoff_delay(
            self._port_failures,
            base_s=self.spec.backoff_min_ms / 1000.0,
            max_s=self.spec.backoff_max_ms / 1000.0,
            rng=self._rng,
        )
        if self._port_failures == 0:
            log.warning("%s: %s; reconnecting", self.name, exc)
        else:
            log.debug("%s: %s; next try in %.1f s", self.name, exc, delay)
        self._port_failures += 1
        # Make sure the next read starts from a fresh connection rather than a half-dead one.
        if self._client is not None:
            self._client.close()
        await asyncio.sleep(delay)

    def _port_up(self) -> None:
        log.info("%s: connected again after %d failed tries", self.name, self._port_failures)
        self._port_failures = 0
        # Units that went silent with the port were not necessarily dead: probe them now
        # rather than after a backoff that may have grown to backoff_max_ms. The failure
        # count stays, so a unit that really is dead resumes its backoff where it was.
        for unit in self._units.values():
            unit.until = 0.0
            if unit.state == "unreachable":
                unit.state = "unknown"
