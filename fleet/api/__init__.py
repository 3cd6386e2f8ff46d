"""The fleet's HTTP API (``/api/v1``, FastAPI), served by ``fleet serve --http``.

Routes are grouped by what they serve (:mod:`.routes_fleet`, :mod:`.routes_rollouts`,
:mod:`.routes_admin`, :mod:`.events`); every change goes through :class:`fleet.changes.Changes`
(as the CLI's do), so the audit log sees them all. Design: docs/ARCHITECTURE.md,
"The fleet API".
"""

from fleet.api.app import create_app
from fleet.api.context import ApiConfig, ApiContext

__all__ = ["ApiConfig", "ApiContext", "create_app"]
