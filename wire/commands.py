"""Commands to a device on ``edgefleet/v1/{site}/{device}/cmd/{name}``.

``cmd/ota`` carries an :class:`OtaCommand` (an offer or a rollback: a pointer, never trusted
by itself); ``cmd/stored`` a :class:`StoredCommand` (the seqs of one boot the fleet has
stored, so the agent lets go of them). Design: ``docs/ARCHITECTURE.md``, "Uplink and fleet
ingest" (*Stored, not just delivered*).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Literal, TypeVar

import msgspec

from wire.errors import WireError
from wire.jsonscan import scan
from wire.messages import (
    MAX_DEPTH,
    U63,
    Hex32,
    Name,
)

#: An offer is a URL and a few numbers.
MAX_COMMAND_BYTES = 4096

Url = Annotated[str, msgspec.Meta(pattern=r"^(https?|coaps?)://[^\s]{1,2000}$")]


class OtaCommand(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """``cmd/ota`` carries an :class:`OtaCommand`: an offer (``install``: where to fetch the
    bundle and how long it is) or a ``rollback``. The offer is only a pointer: the bundle
    itself is verified on the device, so a forged offer can waste a download but never install
    anything.
    """

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
_C = TypeVar("_C", bound=msgspec.Struct)
_ENCODER = msgspec.json.Encoder()


def _decode(decoder: msgspec.json.Decoder[_C], payload: bytes, max_bytes: int) -> _C:
    """Size cap, strict schema, and no key given twice. Raises WireError with the path."""
    if len(payload) > max_bytes:
        raise WireError(f"command is {len(payload)} bytes; expected at most {max_bytes}")
    try:
        cmd = decoder.decode(payload)
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
    return cmd


def decode_command(payload: bytes) -> OtaCommand:
    """Parse and check a ``cmd/ota`` payload. Raises WireError with the JSON path."""
    cmd = _decode(_DECODER, payload, MAX_COMMAND_BYTES)
    if cmd.action == "install" and cmd.url is None:
        raise WireError("an install offer needs a url", "$.url")
    return cmd


def encode_command(cmd: OtaCommand) -> bytes:
    return _ENCODER.encode(cmd)


#: Ranges in one ``cmd/stored`` message; a batch of the ingest yields one range per device
#: and boot unless the device's messages were spread over several workers.
MAX_STORED_RANGES = 256
#: 256 ranges of two 19-digit numbers, the boot id and the keys fit in this.
MAX_STORED_BYTES = 12 * 1024


class StoredCommand(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """``cmd/stored``: the fleet has committed seqs ``first..last`` (inclusive, each range)
    of boot ``boot_id`` of this device.

    ``cmd/stored`` carries a :class:`StoredCommand`: the seqs of one boot the fleet has
    committed to its store, as ranges. The agent lets go of an outbox row only then (not at
    its broker's PUBACK), so a broker that crashes before saving what it acknowledged loses
    nothing: the agent sends those rows again. Design: ``docs/ARCHITECTURE.md``, "Stored, not
    just delivered".
    """

    boot_id: Hex32
    seqs: Annotated[list[tuple[U63, U63]], msgspec.Meta(min_length=1, max_length=MAX_STORED_RANGES)]


_STORED_DECODER = msgspec.json.Decoder(StoredCommand)


def seq_ranges(seqs: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted, merged inclusive ranges of ``seqs`` (duplicates allowed): ``[1, 2, 3, 7]``
    -> ``[(1, 3), (7, 7)]``."""
    out: list[tuple[int, int]] = []
    for seq in sorted(set(seqs)):
        if out and seq == out[-1][1] + 1:
            out[-1] = (out[-1][0], seq)
        else:
            out.append((seq, seq))
    return out


def stored_commands(boot_id: str, seqs: Iterable[int]) -> list[bytes]:
    """The ``cmd/stored`` payloads for ``seqs`` of one boot (several if the ranges are many)."""
    ranges = seq_ranges(seqs)
    return [
        _ENCODER.encode(StoredCommand(boot_id=boot_id, seqs=ranges[i : i + MAX_STORED_RANGES]))
        for i in range(0, len(ranges), MAX_STORED_RANGES)
    ]


def decode_stored(payload: bytes) -> StoredCommand:
    """Parse and check a ``cmd/stored`` payload. Raises WireError with the JSON path."""
    cmd = _decode(_STORED_DECODER, payload, MAX_STORED_BYTES)
    for i, (first, last) in enumerate(cmd.seqs):
        if first > last:
            raise WireError(f"range starts after it ends ({first} > {last})", f"$.seqs[{i}]")
    return cmd
