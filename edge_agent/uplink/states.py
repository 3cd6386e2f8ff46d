"""What a device says about itself on ``.../state``: the payloads of its state messages
(the retained ``online`` birth, the Last Will, the clean ``offline``, the epitaph of an
earlier boot) and when its ``held`` is worth telling again. No I/O of its own beyond
reading the outbox; :class:`edge_agent.uplink.publisher.Uplink` publishes them.

``held`` (see :class:`wire.messages.StateMsg`): while rows are kept for the fleet's
confirmation, the lowest seq of a boot still in the outbox (the watermark when none is).
The fleet reports a missing seq as lost only below it; at or above it the device will send
it again. A fleet that knows an older ``held`` reports less as lost, never more, so telling
it again every ``HELD_EVERY_S`` (when it moved) is enough.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from edge_agent.uplink.outbox import Outbox, Session
from wire.messages import StateMsg, encode

log = logging.getLogger(__name__)

#: While rows are kept for the fleet: how often, at most, the state goes out again to tell
#: it the lowest seq the outbox still holds.
HELD_EVERY_S = 30.0


class StateMessages:
    """The state messages of one device (see the module docstring). ``keep()``: whether
    rows stay in the outbox after their PUBACK (the delivery policy)."""

    def __init__(
        self,
        *,
        device: str,
        site: str,
        device_type: str,
        agent_version: str,
        model_sha256: Callable[[], str],
        model_health: Callable[[], dict[str, object] | None] | None,
        clock_ns: Callable[[], int],
        session: Session,
        outbox: Outbox,
        keep: Callable[[], bool],
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device = device
        self.site = site
        self.device_type = device_type
        self.agent_version = agent_version
        self.model_sha256 = model_sha256
        #: The serving model's health for ``online`` states (None: nothing to report).
        self.model_health = model_health
        self.clock_ns = clock_ns
        self.session = session
        self.outbox = outbox
        self.keep = keep
        self._monotonic = monotonic
        #: The ``held`` of this boot the last ``online`` carried (None: none did), and
        #: when (monotonic s) it may be told again.
        self._told: int | None = None
        self._due = 0.0

    def make(
        self,
        state: str,
        clean: bool,
        *,
        boot: tuple[str, int] | None = None,
        t_ns: int | None = None,
    ) -> bytes:
        """A state message of this boot, or with ``boot`` = ``(boot_id, watermark)`` of an
        earlier one (its epitaph)."""
        boot_id, watermark = boot or (self.session.boot_id, self.session.watermark)
        held = self.held(boot_id, watermark)
        fields: dict[str, Any] = {
            "device": self.device,
            "boot_id": boot_id,
            "seq": watermark,
            "t_ns": self.clock_ns() if t_ns is None else t_ns,
            "state": state,
            "clean": clean,
            "site": self.site,
            "device_type": self.device_type,
            "agent_version": self.agent_version[:128],
            "model_sha256": "",
        }
        if held is not None:
            fields["held"] = held
            if boot is None and state == "online":
                self._told, self._due = held, self._monotonic() + HELD_EVERY_S
        try:
            fields["model_sha256"] = self.model_sha256()
            health = self.model_health() if self.model_health and state == "online" else None
            if health is not None and boot is None:
                fields["model_health"] = health
            return encode(msgspec.convert(fields, StateMsg))
        except (msgspec.ValidationError, ValueError, TypeError) as exc:
            # A state message must go out even if one of its details is off.
            log.warning("uplink: state message without model hash/agent version: %s", exc)
            fields.update(model_sha256="", agent_version="")
            fields.pop("model_health", None)
            return encode(msgspec.convert(fields, StateMsg))

    def held(self, boot_id: str, watermark: int) -> int | None:
        """The state's ``held`` for ``boot_id``; None while a row leaves the outbox at its
        PUBACK (the fleet then counts every hole)."""
        if not self.keep():
            return None
        oldest = self.outbox.held(boot_id)
        return watermark if oldest is None else min(oldest, watermark)

    def tell_held(self) -> bool:
        """Whether to publish the ``online`` state (and the epitaphs) again now: rows are
        kept, and this boot's ``held`` moved or an earlier boot still has rows, at most
        every ``HELD_EVERY_S`` after the last ``online`` that carried one; at once if none
        did yet (rows are kept from the fleet's first confirmation on)."""
        now = self._monotonic()
        if not self.keep() or (self._told is not None and now < self._due):
            return False
        held = self.held(self.session.boot_id, self.session.watermark)
        if held == self._told and not self.outbox.previous_boots():
            self._due = now + HELD_EVERY_S
            return False
        return True


__all__ = ["HELD_EVERY_S", "StateMessages"]
