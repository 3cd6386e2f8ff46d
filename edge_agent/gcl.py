"""The gate control list (IEEE 802.1Qbv style): config section, timeline math, taprio command.

One ``[schedule]`` list drives both sides of the device: :mod:`edge_agent.gates` opens each
pipeline stage inside its window, and :func:`render_taprio` turns the NIC traffic classes of
the same list into a ``tc qdisc ... taprio`` command. Gates name a stage or a traffic class
(its bit in the taprio mask is its index in ``classes``). Pure: no I/O, no clock reads;
timeline methods take ``now``. Every key with its default: ``examples/agent.toml``.
Design (and the CLOCK_REALTIME / CLOCK_TAI phase): docs/ARCHITECTURE.md, "Data flow on the
device".
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from edge_agent._schema import Name, StrictModel
from edge_agent.errors import ConfigError

#: Pipeline stages in pipeline order; in one entry they run in this order.
STAGES: tuple[str, ...] = ("perception", "memory", "reasoning")

#: TAI - UTC since 2017-01-01; leap seconds are announced months ahead, none is planned.
TAI_OFFSET_S = 37

#: taprio (and mqprio) limits: 16 priorities map onto at most 16 classes and 16 TX queues.
MAX_PRIORITY = 15
MAX_QUEUES = 16

MIN_CYCLE_US = 100
MAX_CYCLE_US = 1_000_000

# IFNAMSIZ is 16 with the NUL; the kernel's dev_valid_name() refuses '/', ':' and blanks.
InterfaceName = Annotated[str, Field(min_length=1, max_length=15, pattern=r"^[^\s/:]+$")]
ClockId = Literal["CLOCK_TAI", "CLOCK_REALTIME"]

_US = 1_000
_S = 1_000_000_000


class TrafficClassSection(StrictModel):
    """One NIC traffic class: the socket priority that selects it and its TX queues."""

    name: Name
    priority: Annotated[int, Field(ge=0, le=MAX_PRIORITY)]
    queues: Annotated[int, Field(ge=1, le=MAX_QUEUES)] = 1


class EntrySection(StrictModel):
    """One window of the cycle and the gates open during it."""

    name: Name
    # Zero passes the schema on purpose: check() reports it with the entry's name, next to
    # the sum-of-durations error it usually comes with.
    duration_us: Annotated[int, Field(ge=0, le=MAX_CYCLE_US)]
    gates: Annotated[list[Name], Field(min_length=1, max_length=64)]


def _default_classes() -> list[TrafficClassSection]:
    return [
        TrafficClassSection(name="best_effort", priority=0),
        TrafficClassSection(name="uplink", priority=3),
    ]


def _default_entries() -> list[EntrySection]:
    return [
        EntrySection(
            name="compute",
            duration_us=6_000,
            gates=["perception", "memory", "reasoning", "best_effort"],
        ),
        EntrySection(name="uplink", duration_us=4_000, gates=["uplink", "best_effort"]),
    ]


class TsnSection(StrictModel):
    """The NIC side: interface, taprio clock and traffic classes (tc0 first)."""

    interface: InterfaceName = "eth0"
    clockid: ClockId = "CLOCK_TAI"
    classes: Annotated[list[TrafficClassSection], Field(min_length=1, max_length=MAX_QUEUES)] = (
        Field(default_factory=_default_classes)
    )


class ScheduleSection(StrictModel):
    """The ``[schedule]`` section (field docs in the module docstring)."""

    cycle_us: int = 10_000
    base_time_ns: int | None = None
    spin_us: Annotated[int, Field(ge=0, le=2_000)] = 200
    entries: Annotated[list[EntrySection], Field(min_length=1, max_length=256)] = Field(
        default_factory=_default_entries
    )
    tsn: TsnSection = Field(default_factory=TsnSection)

    def check(self) -> list[str]:
        """Hard errors across keys, each starting with its key path (``schedule. ...``)."""
        errors: list[str] = []
        if not MIN_CYCLE_US <= self.cycle_us <= MAX_CYCLE_US:
            errors.append(
                f"schedule.cycle_us: expected between {MIN_CYCLE_US} and {MAX_CYCLE_US} "
                f"(100 us to 1 s); got {self.cycle_us}"
            )
        if self.base_time_ns is not None and self.base_time_ns < 0:
            errors.append(f"schedule.base_time_ns: expected >= 0; got {self.base_time_ns}")

        classes = self.tsn.classes
        class_at: dict[str, int] = {}
        priority_at: dict[int, int] = {}
        for i, tc in enumerate(classes):
            at = f"schedule.tsn.classes[{i}]"
            if tc.name in STAGES:
                errors.append(
                    f"{at}.name: {tc.name!r} is a pipeline stage; expected a name other than "
                    f"{', '.join(STAGES)}"
                )
            if tc.name in class_at:
                errors.append(
                    f"{at}.name: {tc.name!r} is already used by "
                    f"schedule.tsn.classes[{class_at[tc.name]}]"
                )
            else:
                class_at[tc.name] = i
            if tc.priority in priority_at:
                j = priority_at[tc.priority]
                errors.append(
                    f"{at}.priority: {tc.priority} is already used by schedule.tsn.classes[{j}] "
                    f"({classes[j].name!r}); expected one class per priority"
                )
            else:
                priority_at[tc.priority] = i
        total_queues = sum(tc.queues for tc in classes)
        if total_queues > MAX_QUEUES:
            errors.append(
                f"schedule.tsn.classes: {total_queues} TX queues in total; "
                f"expected at most {MAX_QUEUES}"
            )

        known = [*STAGES, *(tc.name for tc in classes if tc.name not in STAGES)]
        entry_at: dict[str, int] = {}
        opened: set[str] = set()
        for i, entry in enumerate(self.entries):
            at = f"schedule.entries[{i}]"
            if entry.name in entry_at:
                errors.append(
                    f"{at}.name: {entry.name!r} is already used by "
                    f"schedule.entries[{entry_at[entry.name]}]"
                )
            else:
                entry_at[entry.name] = i
            if entry.duration_us == 0:
                errors.append(f"{at}.duration_us: zero-length entry {entry.name!r}; expected > 0")
            seen: set[str] = set()
            for gate in entry.gates:
                if gate not in known:
                    errors.append(
                        f"{at}.gates: unknown gate {gate!r}; expected one of "
                        f"{', '.join(known)} (entry {entry.name!r})"
                    )
                elif gate in seen:
                    errors.append(
                        f"{at}.gates: gate {gate!r} is listed twice (entry {entry.name!r})"
                    )
                seen.add(gate)
            opened |= seen
        total = sum(e.duration_us for e in self.entries)
        if total != self.cycle_us:
            errors.append(
                f"schedule.entries: durations sum to {total} us; "
                f"expected cycle_us ({self.cycle_us} us)"
            )
        for stage in STAGES:
            if stage not in opened:
                errors.append(
                    f"schedule.entries: stage {stage!r} has no entry; "
                    f"expected at least one entry whose gates include {stage!r}"
                )
        for tc in classes:
            if tc.name not in opened and tc.name not in STAGES:
                errors.append(
                    f"schedule.entries: traffic class {tc.name!r} has no entry; "
                    f"expected at least one entry whose gates include {tc.name!r}"
                )
        return errors

    def notes(self, *, rate_hz: float | None = None) -> list[str]:
        """Warnings: the schedule works, but not quite as one may think.

        ``rate_hz`` (perception's grid rate) enables the note about window closes that do not
        fall at one phase of the cycle.
        """
        out: list[str] = []
        cycle_ns = self.cycle_us * _US
        if cycle_ns <= 0:
            return out
        if self.tsn.clockid == "CLOCK_TAI" and _S % cycle_ns != 0:
            drift_ns = (TAI_OFFSET_S * _S) % cycle_ns
            out.append(
                f"schedule.cycle_us: {self.cycle_us} does not divide 1 s, so taprio (CLOCK_TAI) "
                f"and the agent (CLOCK_REALTIME) run the schedule {drift_ns / _US:g} us apart; "
                f"pick a cycle that divides 1000000"
            )
        if rate_hz is not None and rate_hz > 0:
            step_ns = round(1e9 / rate_hz)
            if step_ns % cycle_ns != 0:
                out.append(
                    f"schedule.cycle_us: perception steps of {step_ns / _US:g} us are not a "
                    f"multiple of the cycle ({self.cycle_us} us); windows close at a different "
                    f"phase from cycle to cycle, so the default base time cannot follow them"
                )
        return out


def window_close_phase_ns(cycle_ns: int, *, lateness_ms: float) -> int:
    """The phase in the cycle at which perception windows close: ``lateness mod cycle``.

    Windows end on grid points (multiples of the step in UNIX time) and close ``lateness_ms``
    later; when the step is a multiple of the cycle every grid point is at phase 0, so the
    close is at ``lateness`` mod cycle. Used as the default ``base_time_ns``.
    """
    return round(lateness_ms * 1_000_000) % cycle_ns


@dataclass(frozen=True, slots=True)
class GateEntry:
    """One window of the cycle: ``[offset_ns, offset_ns + duration_ns)`` from the cycle start.

    ``mask`` is the taprio gate mask: bit ``i`` is traffic class ``i``; stages have no bit.
    """

    name: str
    offset_ns: int
    duration_ns: int
    gates: frozenset[str]
    mask: int

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages open in this entry, in pipeline order."""
        return tuple(s for s in STAGES if s in self.gates)


@dataclass(frozen=True, slots=True)
class TrafficClass:
    name: str
    priority: int
    queues: int


@dataclass(frozen=True, slots=True)
class GateControlList:
    """A validated schedule. Cycles start at ``base_time_ns + k * cycle_ns`` for every integer
    ``k`` (negative too); times are UNIX ns on the agent's clock."""

    cycle_ns: int
    base_time_ns: int
    entries: tuple[GateEntry, ...]
    classes: tuple[TrafficClass, ...]
    clockid: ClockId = "CLOCK_TAI"
    interface: str = "eth0"
    spin_ns: int = 200_000

    def __post_init__(self) -> None:
        # The timeline methods loop over entries; a gap, an overlap or an empty entry would
        # make them wrong or endless, so even hand-built lists must tile the cycle exactly.
        offset = 0
        for e in self.entries:
            if e.duration_ns <= 0 or e.offset_ns != offset:
                raise ValueError(
                    f"entry {e.name!r}: expected offset {offset} ns and a positive duration; "
                    f"got offset {e.offset_ns} ns, duration {e.duration_ns} ns"
                )
            offset += e.duration_ns
        if not self.entries or offset != self.cycle_ns:
            raise ValueError(f"entries cover {offset} ns; expected the cycle ({self.cycle_ns} ns)")

    @classmethod
    def from_section(cls, section: ScheduleSection, *, default_base_ns: int = 0) -> GateControlList:
        """Build the list; ``default_base_ns`` stands in for an unset ``base_time_ns`` (the
        agent passes its window-close phase, so the first entry opens as windows close).

        Raises :class:`ConfigError` with :meth:`ScheduleSection.check`'s errors.
        """
        errors = section.check()
        if errors:
            raise ConfigError("schedule", errors)
        classes = tuple(TrafficClass(c.name, c.priority, c.queues) for c in section.tsn.classes)
        bit = {c.name: 1 << i for i, c in enumerate(classes)}
        entries: list[GateEntry] = []
        offset = 0
        for e in section.entries:
            gates = frozenset(e.gates)
            mask = 0
            for g in gates:
                mask |= bit.get(g, 0)
            entries.append(GateEntry(e.name, offset, e.duration_us * _US, gates, mask))
            offset += e.duration_us * _US
        base = section.base_time_ns if section.base_time_ns is not None else default_base_ns
        return cls(
            cycle_ns=section.cycle_us * _US,
            base_time_ns=base,
            entries=tuple(entries),
            classes=classes,
            clockid=section.tsn.clockid,
            interface=section.tsn.interface,
            spin_ns=section.spin_us * _US,
        )

    def cycle_start(self, now_ns: int) -> int:
        """The start of the cycle containing ``now_ns`` (also before ``base_time_ns``)."""
        return self.base_time_ns + (now_ns - self.base_time_ns) // self.cycle_ns * self.cycle_ns

    def next_opening(self, after_ns: int) -> tuple[int, int, GateEntry]:
        """``(open_ns, close_ns, entry)`` of the first entry opening at or after ``after_ns``."""
        start = self.cycle_start(after_ns)
        for e in self.entries:
            if start + e.offset_ns >= after_ns:
                return start + e.offset_ns, start + e.offset_ns + e.duration_ns, e
        start += self.cycle_ns
        first = self.entries[0]
        return start, start + first.duration_ns, first

    def current(self, now_ns: int) -> tuple[int, int, GateEntry]:
        """``(open_ns, close_ns, entry)`` of the entry open at ``now_ns``."""
        start = self.cycle_start(now_ns)
        phase = now_ns - start
        for e in self.entries:
            if phase < e.offset_ns + e.duration_ns:
                return start + e.offset_ns, start + e.offset_ns + e.duration_ns, e
        raise AssertionError("unreachable: entries tile the cycle")  # pragma: no cover

    def gates_of(self, gate: str) -> tuple[GateEntry, ...]:
        """The entries in which ``gate`` (a stage or a traffic class) is open, in order."""
        return tuple(e for e in self.entries if gate in e.gates)

    def priority(self, class_name: str) -> int:
        """The socket priority (``SO_PRIORITY``) that selects traffic class ``class_name``."""
        for c in self.classes:
            if c.name == class_name:
                return c.priority
        known = ", ".join(c.name for c in self.classes)
        raise KeyError(f"no traffic class {class_name!r}; known: {known}")

    def priority_map(self) -> tuple[int, ...]:
        """taprio's ``map``: for each priority 0..15 the index of its class (default tc0)."""
        index = {c.priority: i for i, c in enumerate(self.classes)}
        return tuple(index.get(p, 0) for p in range(MAX_PRIORITY + 1))

    @property
    def tx_queues(self) -> int:
        """TX queues the NIC needs for this list."""
        return sum(c.queues for c in self.classes)


def render_taprio(gcl: GateControlList, interface: str | None = None) -> list[str]:
    """The ``tc qdisc replace ... taprio`` argv for ``gcl`` (``interface`` defaults to the
    list's own). Masks are hex with at least two digits, as tc-taprio(8) writes them.

    ``base-time`` is the list's base on the agent's clock; see the module docstring for why
    CLOCK_TAI still lands in phase.
    """
    argv = [
        "tc", "qdisc", "replace", "dev", interface or gcl.interface,
        "parent", "root", "handle", "100", "taprio",
        "num_tc", str(len(gcl.classes)),
        "map", *(str(i) for i in gcl.priority_map()),
        "queues",
    ]  # fmt: skip
    offset = 0
    for c in gcl.classes:
        argv.append(f"{c.queues}@{offset}")
        offset += c.queues
    argv += ["base-time", str(gcl.base_time_ns)]
    for e in gcl.entries:
        argv += ["sched-entry", "S", f"{e.mask:02x}", str(e.duration_ns)]
    argv += ["clockid", gcl.clockid]
    return argv


def format_command(argv: Sequence[str]) -> str:
    """``argv`` as one shell-safe line."""
    return shlex.join(argv)


__all__ = [
    "STAGES",
    "EntrySection",
    "GateControlList",
    "GateEntry",
    "ScheduleSection",
    "TrafficClass",
    "TrafficClassSection",
    "TsnSection",
    "format_command",
    "render_taprio",
    "window_close_phase_ns",
]
