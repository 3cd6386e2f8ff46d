"""The ``[uplink]`` section of the agent's TOML config.

Same rules as :mod:`edge_agent.config`: strict types, unknown keys rejected, frozen. Relative
paths (``outbox.path``) are relative to ``agent.state_dir``. Sizes are bytes, times carry
their unit in the key name. The MQTT password is never in this file: ``password_file`` names
a file that holds it (mode 0600, one line), so the config can be logged and shared. Every
key, with its default and what it does: ``examples/agent.toml``, section ``[uplink]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from edge_agent._schema import Name, StrictModel

_MIB = 1 << 20


class TlsSection(StrictModel):
    """Server-CA-only TLS with just ``ca_file``; mutual TLS with ``cert_file`` + ``key_file``."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


class DeltaSection(StrictModel):
    """Delta upload of telemetry (see :class:`wire.messages.TelemetryMsg`)."""

    enabled: bool = True
    default_deadband: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    deadband: dict[Name, Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(
        default_factory=dict
    )
    keyframe_every: Annotated[int, Field(ge=1, le=10_000)] = 10

    def deadbands_for(self, signals: Sequence[str]) -> tuple[float, ...]:
        """The deadband of each signal, in order: its own entry or ``default_deadband``."""
        return tuple(float(self.deadband.get(s, self.default_deadband)) for s in signals)


class OutboxSection(StrictModel):
    """The durable outbox (SQLite) every uplink message passes through."""

    path: Annotated[str, Field(min_length=1)] = "outbox.db"
    max_bytes: Annotated[int, Field(ge=64 * 1024, le=1 << 40)] = 64 * _MIB
    decision_reserve_bytes: Annotated[int, Field(ge=0, le=1 << 40)] = 16 * _MIB


class UplinkSection(StrictModel):
    """MQTT uplink to the fleet (field docs in the module docstring)."""

    enabled: bool = False
    host: Annotated[str, Field(min_length=1, max_length=253)] = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65_535)] = 1883
    client_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    keepalive_s: Annotated[int, Field(ge=5, le=65_535)] = 30
    tls: TlsSection | None = None
    username: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    password_file: Annotated[str, Field(min_length=1)] | None = None
    telemetry_period_ms: Annotated[int, Field(ge=10, le=3_600_000)] = 1000
    #: Periods per telemetry message: with fast periods (10 ms) the envelope would
    #: otherwise cost more than the data. The batch leaves when full or at shutdown.
    telemetry_batch: Annotated[int, Field(ge=1, le=10_000)] = 1
    delta: DeltaSection = Field(default_factory=DeltaSection)
    outbox: OutboxSection = Field(default_factory=OutboxSection)
    replay_rate_per_s: Annotated[float, Field(gt=0, le=1_000_000, allow_inf_nan=False)] = 200.0
    max_inflight: Annotated[int, Field(ge=1, le=65_535)] = 32
    reconnect_min_ms: Annotated[int, Field(ge=1, le=3_600_000)] = 500
    reconnect_max_ms: Annotated[int, Field(ge=1, le=3_600_000)] = 30_000
    delivery: Literal["auto", "stored", "broker"] = "auto"
    confirm_timeout_s: Annotated[float, Field(ge=1, le=86_400, allow_inf_nan=False)] = 60.0

    @model_validator(mode="after")
    def _consistent(self) -> UplinkSection:
        if self.reconnect_max_ms < self.reconnect_min_ms:
            raise ValueError(
                f"reconnect_max_ms ({self.reconnect_max_ms}) must be at least "
                f"reconnect_min_ms ({self.reconnect_min_ms})"
            )
        return self

    def resolve_outbox(self, state_dir: str | Path) -> Path:
        """The outbox database path; a relative ``outbox.path`` is under ``state_dir``."""
        p = Path(self.outbox.path).expanduser()
        return p if p.is_absolute() else Path(state_dir).expanduser() / p

    def effective_client_id(self, device: str) -> str:
        return self.client_id if self.client_id is not None else device

    def check(self, signals: Sequence[str] = ()) -> list[str]:
        """Errors the types cannot see: file pairs, missing files, unknown deadband signals.

        ``signals`` are the perception signal names; an empty sequence skips that check.
        Only meaningful when ``enabled`` (a disabled uplink reports nothing).
        """
        if not self.enabled:
            return []
        errors: list[str] = []

        def need_file(key: str, value: str | None) -> None:
            if value is not None and not Path(value).expanduser().is_file():
                errors.append(f"uplink.{key}: {value!r} does not exist or is not a file")

        if self.tls is not None:
            t = self.tls
            if (t.cert_file is None) != (t.key_file is None):
                have, missing = (
                    ("cert_file", "key_file") if t.cert_file else ("key_file", "cert_file")
                )
                errors.append(
                    f"uplink.tls.{have}: set without uplink.tls.{missing}; "
                    "expected both (mutual TLS) or neither"
                )
            need_file("tls.ca_file", t.ca_file)
            need_file("tls.cert_file", t.cert_file)
            need_file("tls.key_file", t.key_file)
        if self.password_file is not None and self.username is None:
            errors.append(
                f"uplink.password_file: {self.password_file!r} set without uplink.username; "
                "expected a username to go with the password"
            )
        need_file("password_file", self.password_file)
        if signals:
            known = set(signals)
            errors.extend(
                f"uplink.delta.deadband.{name}: {name!r} is not a perception signal; "
                f"known: {', '.join(signals)}"
                for name in self.delta.deadband
                if name not in known
            )
        return errors


__all__ = ["DeltaSection", "OutboxSection", "TlsSection", "UplinkSection"]
