"""The web console at ``/``: server-rendered pages (Jinja2, autoescaped: every device string
is text, never markup) over the same store reads as the API, with charts (uPlot), actions
and live updates done by ``static/console.js`` through the API itself (``/api/v1``, the
session cookie and its CSRF token). Assets are vendored (``static/vendor``), never a CDN.
Design: docs/ARCHITECTURE.md, "The fleet API".
"""

from fleet.console.pages import STATIC_DIR, router

__all__ = ["STATIC_DIR", "router"]
