"""Commands to a device on ``edgefleet/v1/{site}/{device}/cmd/{name}``.

``cmd/ota`` carries an :class:`OtaCommand`: an offer (``install``: where to fetch the
bundle and how long it is) or a ``rollback``. The offer is only a pointer: the bundle
itself is verified on the device, so a forged offer can waste a download but never install
anything.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from wire.errors import WireError
from wire.jsonscan import scan
from wire.messages import (
    MAX_DEPTH,
    Name,
)

#: An offer is a URL and a few numbers.
MAX_COMMAND_BYTES = 4096

Url = Annotated[str, msgspec.Meta(pattern=r"^(https?|coaps?)://[^\s]{1,2000}$")]


class OtaCommand(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    action: Literal["install", "rollback"]
    bundle_id: Name
    #: ``install``: the bundle's URL (HTTP(S) with ranges, or CoAP block-wise) and length.
    url: Url | None = None
    length: Annotated[int, msgspec.Meta(ge=1, le=4 * 1024**3)] = 1
    #: ``rollback``: which kind to roll back (default ``model``).
    kind: Literal["model", "config", "agent"] | None = None
    #: The rollout this offer belongs to (echoed in status reports).
    rollout: Name | None = None


_DECODER = msgspec.json.Decoder(OtaCommand)
_ENCODER = msgspec.json.Encoder()


def decode_command(payload: bytes) -> OtaCommand:
    """Parse and check a ``cmd/ota`` payload. Raises WireError with the JSON path."""
    if len(payload) > MAX_COMMAND_BYTES:
        raise WireError(f"command is {len(payload)} bytes; expected at most {MAX_COMMAND_BYTES}")
    try:
        cmd = _DECODER.decode(payload)
    except msgspec.ValidationError as exc:
        reason, _, where = str(exc).partition(" - at `")
        raise WireError(reason, where.rstrip("`") if where else "$") from None
    except msgspec.DecodeError as exc:
        raise WireError(f"not a JSON object: {exc}") from None
    if _ENCODER.encode(cmd) != payload:
        # Not the fleet's own bytes: make sure no key was given twice (msgspec keeps the
        # last), as the ingest does for uplink messages (wire.messages.decode).
        found = scan(payload, max_depth=MAX_DEPTH)
        if found is not None:
            raise WireError(*found)
    if cmd.action == "install" and cmd.url is None:
        raise WireError("an install offer needs a url", "$.url")
    return cmd


def encode_command(cmd: OtaCommand) -> bytes:
    return _ENCODER.encode(cmd)
