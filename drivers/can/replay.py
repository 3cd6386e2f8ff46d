"""Replay a recorded CAN capture (candump ``.log`` or Vector ``.asc``) through a DBC.

Samples are stamped with ``time.time_ns()`` when the frame is *emitted*, not with the
recorded timestamp. A replay stands in for a live bus: perception aligns samples onto a
grid of "now", checks staleness against "now" and the uplink stamps windows with "now",
so samples from 2021 would all read as hours stale, and a looping replay would run time
backwards at each wrap. The recorded timing survives as the spacing between emissions
(scaled by ``speed``); the recorded absolute times are not kept.
"""

import asyncio
import logging
import math
import threading
import time
from collections.abc import Mapping
from typing import Final

from drivers.buffer import SampleBuffer
from drivers.can._thread import run_in_thread
from drivers.can.capture import CaptureReader
from drivers.can.dbc import FrameDecoder
from drivers.errors import DriverConfigError, ReplayError
from drivers.sample import Sample
from drivers.specs import ReplaySpec

log = logging.getLogger(__name__)

#: Samples per hand-off to the buffer at most.
MAX_BATCH: Final = 512
#: A frame due less than this far ahead is emitted now rather than slept for: sleeping
#: per frame at ~1,000 frames/s would cost more than it is worth, and the sample is
#: stamped when actually emitted anyway.
MIN_SLEEP_S: Final = 0.001
#: Poll interval while waiting for the consumer to make room (``speed=0`` only).
BACKPRESSURE_POLL_S: Final = 0.001


class ReplaySource:
    """Plays :attr:`ReplaySpec.path` through :attr:`ReplaySpec.dbc` into a buffer.

    ``speed`` scales recorded time: 1.0 as recorded, 10.0 ten times faster, 0 as fast as
    the consumer drains. At ``speed=0`` the reader waits for room in the buffer instead
    of letting it drop the oldest samples, so an offline run sees every sample; at any
    other speed the replay behaves like a live bus and the buffer's drop policy applies.
    With ``loop`` the capture starts over right after its last frame.

    A malformed line is skipped and counted per reason (``malformed_lines`` and
    ``malformed.<reason>`` in :meth:`stats`; the first few are logged with their line
    numbers, once per capture, not once per pass); with ``strict`` the first one stops the
    replay with :class:`ReplayError` instead.

    When a non-looping capture ends, ``run()`` stays up (a quiet bus, ``state ==
    "finished"``) until cancelled, as every source does. Construction raises
    :class:`ReplayError` for a missing, unreadable or unknown-format capture, and
    :class:`DriverConfigError` for a bad DBC or speed; a capture with no frame at all (or,
    when strict, one malformed further in) raises :class:`ReplayError` from ``run()``.

    The capture is read lazily in a dedicated thread (python-can's readers are line-based
    generators), so a multi-gigabyte capture neither fills memory nor blocks the loop.
    """

    def __init__(self, spec: ReplaySpec) -> None:
        if not (math.isfinite(spec.speed) and spec.speed >= 0):
            raise DriverConfigError(
                f"replay source {spec.name!r}: speed must be a finite number >= 0, got {spec.speed}"
            )
        self.name = spec.name
        self.spec = spec
        self._decoder = FrameDecoder.from_file(spec.dbc, signals=spec.signals, prefix=spec.prefix)
        self._check_capture()
        self._running = False
        self.state = "idle"
        self.error_frames = 0
        self.remote_frames = 0
        self.frames_total = 0
        self.position = 0
        self.passes = 0
        self.malformed: dict[str, int] = {}

    @property
    def signals(self) -> tuple[str, ...]:
        """Every sample name this source can emit (after filtering and prefix)."""
        return self._decoder.signals

    def stats(self) -> Mapping[str, int | float | str]:
        """Counters since construction, summed over passes when looping.

        ``position`` is the number of frames emitted in the current pass; ``frames_total``
        the frames in one pass, known once the first pass has read to the end (0 before:
        counting up front would mean reading a large capture twice); ``passes`` the
        completed passes. ``state`` is ``idle``, ``playing``, ``finished`` or ``stopped``;
        ``up`` is 1 while ``playing`` and once ``finished`` (the capture was read: a quiet
        bus, not a broken one).
        """
        out: dict[str, int | float | str] = dict(self._decoder.stats())
        out["malformed_lines"] = sum(self.malformed.values())
        out.update({f"malformed.{reason}": n for reason, n in sorted(self.malformed.items())})
        out.update(
            up=int(self.state in ("playing", "finished")),
            error_frames=self.error_frames,
            remote_frames=self.remote_frames,
            frames_total=self.frames_total,
            position=self.position,
            passes=self.passes,
            state=self.state,
        )
        return out

    async def run(self, sink: SampleBuffer) -> None:
        """Play the capture into ``sink``; returns only by cancellation."""
        if self._running:
            raise RuntimeError(f"replay source {self.name!r} is already running")
        self._running = True
        try:
            await run_in_thread(
                f"can-replay-{self.name}",
                lambda stop: self._play(sink, stop),
                lambda exc: ReplayError(f"capture {self.spec.path}: replay failed: {exc!r}"),
            )
            # The capture ended; like a bus gone quiet, stay until cancelled.
            await _forever()
        finally:
            self._running = False

    def _check_capture(self) -> None:
        """Fail at construction, not at first use, if the capture cannot be played."""
        reader = CaptureReader(self.spec.path, strict=self.spec.strict)
        frames = iter(reader)
        try:
            first = next(frames, None)
        except ReplayError as exc:
            raise ReplayError(
                f"{exc} (not a valid {self.spec.path.suffix} capture; "
                f"strict = false skips malformed lines)"
            ) from exc
        finally:
            frames.close()  # type: ignore[attr-defined]
        if first is None:
            detail = ""
            if reader.examples:
                line, why = reader.examples[0]
                bad = sum(reader.malformed.values())
                detail = f"; {bad} malformed line(s), first: line {line}: {why}"
            raise ReplayError(f"capture {self.spec.path}: contains no CAN frames{detail}")

    # -- replay thread ---------------------------------------------------------------

    def _play(self, sink: SampleBuffer, stop: threading.Event) -> None:
        self.state = "playing"
        try:
            while not stop.is_set():
                played = self._play_once(sink, stop)
                if stop.is_set():
                    break
                if played == 0:
                    raise ReplayError(f"capture {self.spec.path}: contains no CAN frames")
                self.passes += 1
                self.frames_total = played
                if not self.spec.loop:
                    self.state = "finished"
                    return
        finally:
            if self.state != "finished":
                self.state = "stopped"

    def _play_once(self, sink: SampleBuffer, stop: threading.Event) -> int:
        """One pass over the capture; returns the frames read."""
        speed = self.spec.speed
        decode = self._decoder.decode
        now_ns = time.time_ns
        monotonic = time.monotonic
        batch: list[Sample] = []
        index = 0
        self.position = 0
        reader = CaptureReader(self.spec.path, strict=self.spec.strict)
        start = monotonic()
        first_ts: float | None = None
        try:
            for msg in reader:
                if stop.is_set():
                    break
                index += 1
                if speed > 0.0:
                    if first_ts is None:
                        first_ts = msg.timestamp
                    # Due times are measured from the start of the pass, not from the
                    # previous frame, so sleep overshoot never accumulates into drift.
                    ahead = start + (msg.timestamp - first_ts) / speed - monotonic()
                    if ahead > MIN_SLEEP_S:
                        self._flush(batch, sink, stop)
                        batch = []
                        if stop.wait(ahead):
                            break
                t_ns = now_ns()
                self.position = index
                if msg.is_error_frame:
                    self.error_frames += 1
                    continue
                if msg.is_remote_frame:
                    self.remote_frames += 1
                    continue
                decode(msg.arbitration_id, msg.is_extended_id, msg.data, t_ns, batch)
                if len(batch) >= MAX_BATCH:
                    self._flush(batch, sink, stop)
                    batch = []
            self._flush(batch, sink, stop)
        finally:
            self._note_malformed(reader)
        return index

    def _note_malformed(self, reader: CaptureReader) -> None:
        """Count one pass's malformed lines; log the first pass's first few."""
        if not reader.malformed:
            return
        first_pass = self.passes == 0
        for reason, n in reader.malformed.items():
            self.malformed[reason] = self.malformed.get(reason, 0) + n
        if first_pass:
            total = sum(reader.malformed.values())
            for number, why in reader.examples:
                log.warning("capture %s: line %d skipped: %s", self.spec.path, number, why)
            if total > len(reader.examples):
                log.warning(
                    "capture %s: %d malformed line(s) skipped in all (%s); counted in "
                    "malformed_lines",
                    self.spec.path,
                    total,
                    ", ".join(f"{r} {n}" for r, n in sorted(reader.malformed.items())),
                )

    def _flush(self, batch: list[Sample], sink: SampleBuffer, stop: threading.Event) -> None:
        if not batch:
            return
        if self.spec.speed > 0.0:
            sink.put_many(batch)
            return
        # speed=0: hand over in chunks that fit, waiting for the consumer to make room.
        chunk = max(1, sink.maxlen // 2)
        for i in range(0, len(batch), chunk):
            part = batch[i : i + chunk]
            while len(sink) > sink.maxlen - len(part):
                if stop.wait(BACKPRESSURE_POLL_S):
                    return
            sink.put_many(part)


async def _forever() -> None:
    await asyncio.Event().wait()
