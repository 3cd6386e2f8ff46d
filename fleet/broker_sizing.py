"""How much the broker must queue for the ingest to ride out an outage of ``fleet serve``, and
what that costs the broker: pure arithmetic over the fleet's size, no I/O.

While ``fleet serve`` is down, Mosquitto keeps every message for the ingest's persistent
sessions in memory, up to ``max_queued_messages`` / ``max_queued_bytes`` per session, and
drops the rest ("Outgoing messages are being dropped for client ..."). The devices already
have their PUBACK and deleted those messages from their outboxes, so a drop is lost for
good. Measured on Mosquitto 2.0.11 (``tests/test_fleet_broker.py``):
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fleet.errors import PkiError

#: Broker memory per queued message beyond its payload (topic + Mosquitto's structures).
RAM_OVERHEAD_BYTES = 360
#: Persistence-file bytes per queued message beyond its payload.
FILE_OVERHEAD_BYTES = 120
#: A default agent's larger message: a decision (~635 B; its telemetry is ~310 B).
DEFAULT_MSG_BYTES = 640


def agent_msgs_per_min(
    *, telemetry_period_ms: float, telemetry_batch: int, rate_hz: float, hop: int
) -> float:
    """Uplink messages per minute of one agent: one telemetry message per ``telemetry_batch``
    periods (at most: a period where no signal moved sends nothing) and one decision per
    window (a window every ``hop`` grid points at ``rate_hz``). State and OTA status
    messages are rare and left out."""
    return 60_000 / (telemetry_period_ms * telemetry_batch) + 60 * rate_hz / hop


def default_agent_msgs_per_min() -> float:
    """:func:`agent_msgs_per_min` of an agent on its defaults (154: 60 telemetry + 93.75
    decisions at 100 Hz, 64-point windows, 1 s telemetry)."""
    # Imported on use: the agent's config schema (pydantic) is not needed otherwise.
    from edge_agent.config import PerceptionSection  # noqa: PLC0415
    from edge_agent.uplink.config import UplinkSection  # noqa: PLC0415

    per = PerceptionSection.model_fields
    up = UplinkSection.model_fields
    window = int(per["window"].default)
    hop = per["hop"].default
    return agent_msgs_per_min(
        telemetry_period_ms=float(up["telemetry_period_ms"].default),
        telemetry_batch=int(up["telemetry_batch"].default),
        rate_hz=float(per["rate_hz"].default),
        hop=int(hop) if hop is not None else window,
    )


def _check(what: str, value: float, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise PkiError(f"broker sizing: {what} {value} is outside {low:g}..{high:g}")


@dataclass(frozen=True)
class Sizing:
    """The outage the broker's queues are sized for, and what that costs.

    ``autosave_s``: how often Mosquitto writes its whole in-memory state to its
    persistence file. A restart (SIGTERM) saves everything first; a crash, SIGKILL or
    power cut loses what arrived since the last save.

    - The limits count per session. A shared group hands each message to one session in turn,
      online or not, so with W workers down each session holds about 1/W of the backlog.
      ``fleet broker-config`` still sizes every session for the WHOLE backlog: the worker
      count can shrink to one, and a limit is not an allocation (the broker holds each message
      once, whichever session it is queued for).
    - A queued message costs the broker its payload plus about ``RAM_OVERHEAD_BYTES`` of memory
      (its topic and the broker's structures: 200,000 messages of 507 B took 172 MB), and its
      payload plus about ``FILE_OVERHEAD_BYTES`` in the persistence file (125 MB).
    """

    devices: int = 1000
    msgs_per_min: float = 154.0
    outage_min: float = 30.0
    msg_bytes: int = DEFAULT_MSG_BYTES
    autosave_s: int = 60

    def __post_init__(self) -> None:
        _check("devices", self.devices, 1, 10_000_000)
        _check("msgs_per_min", self.msgs_per_min, 0.001, 1_000_000)
        _check("outage_min", self.outage_min, 0.001, 60 * 24 * 30)
        _check("msg_bytes", self.msg_bytes, 1, 256 * 1024 * 1024)
        _check("autosave_s", self.autosave_s, 1, 86_400)

    @property
    def messages(self) -> int:
        """``max_queued_messages``: the whole fleet's backlog over the outage."""
        return math.ceil(self.devices * self.msgs_per_min * self.outage_min)

    @property
    def queued_bytes(self) -> int:
        """``max_queued_bytes``: the backlog's payload bytes (Mosquitto counts payloads)."""
        return self.messages * self.msg_bytes

    @property
    def memory_bytes(self) -> int:
        """Broker memory a full backlog takes (see the module docstring)."""
        return self.messages * (self.msg_bytes + RAM_OVERHEAD_BYTES)

    @property
    def file_bytes(self) -> int:
        """Size of the persistence file holding a full backlog, rewritten every autosave."""
        return self.messages * (self.msg_bytes + FILE_OVERHEAD_BYTES)

    def summary(self) -> list[str]:
        """What the config was sized for, for a person: the outage, then the cost."""
        return [
            f"{self.devices:,} devices x {self.msgs_per_min:g} msg/min x {self.outage_min:g} "
            f"min without `fleet serve` = {self.messages:,} messages queued per ingest "
            f"session (max_queued_messages), {human_bytes(self.queued_bytes)} at "
            f"{self.msg_bytes} B each (max_queued_bytes)",
            f"a full backlog takes about {human_bytes(self.memory_bytes)} of broker memory "
            f"and a {human_bytes(self.file_bytes)} persistence file, written every "
            f"{self.autosave_s} s (autosave_interval): a broker restart loses nothing, a "
            f"crash or power cut what arrived in the last {self.autosave_s} s",
        ]


def human_bytes(n: int) -> str:
    """``n`` bytes as B, KiB, MiB or GiB with one decimal."""
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
