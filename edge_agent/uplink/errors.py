"""Errors of the uplink, rooted in :class:`edge_agent.errors.AgentError`.

Broker trouble (refused connection, bad credentials, TLS failure) is never raised: the uplink
keeps reconnecting with backoff and reports the cause in ``stats()["last_error"]``. A
message that cannot be built or stored is dropped and counted, never raised to the caller.
"""

from __future__ import annotations

from edge_agent.errors import AgentError


class UplinkError(AgentError):
    """The uplink cannot run (at start: fatal for the uplink, with this message).

    ::

        AgentError
        └── UplinkError        the uplink cannot start: its outbox cannot be opened
            └── OutboxError    the outbox database cannot be opened or migrated
    """


class OutboxError(UplinkError):
    """The outbox database cannot be opened, migrated or written."""


__all__ = ["OutboxError", "UplinkError"]
