"""The one error tree of ``wire``: a payload that does not fit the contract.

::

    WireError   (also a ValueError) what is wrong and ``where`` (a JSON path such as ``$.seq``)
"""

from __future__ import annotations

from wire.jsonscan import printable


class WireError(ValueError):
    """A payload that does not fit the contract. ``where`` is a JSON path (``$.seq``).

    Both are printable: a NUL or control character quoted from the input (an unknown
    field's name) is escaped, so the reason can go into any store and any log line.
    """

    def __init__(self, reason: str, where: str = "$") -> None:
        reason, where = printable(reason), printable(where)
        super().__init__(f"{reason} (at {where})" if where != "$" else reason)
        self.reason = reason
        self.where = where
