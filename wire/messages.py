"""Message schemas (msgspec): what every uplink payload may hold, checked strictly.

Every data message carries the envelope ``device``, ``boot_id`` (32 hex digits, new at every
agent start), ``seq`` (per boot, gap-free over the data streams: telemetry, decision,
ota/status) and ``t_ns`` (UNIX ns). The fleet stores data idempotently on
``(device, boot_id, seq)``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from wire.errors import WireError
from wire.jsonscan import scan

#: Refused before parsing. A 1 s telemetry aggregate of 64 signals is ~5 KB; a decision ~1 KB.
MAX_PAYLOAD_BYTES = 256 * 1024
#: Deepest nesting of a payload (the top-level object is level 1). The schema's own fields
#: reach 5 (telemetry's ``more``); only the free-form ``detail`` could go deeper, and
#: msgspec's parser recurses per level (60,000 levels raised RecursionError).
MAX_DEPTH = 32

_NAME_PATTERN = r"^[A-Za-z0-9_.:\-]{1,128}$"
Name = Annotated[str, msgspec.Meta(pattern=_NAME_PATTERN)]
Hex32 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}$")]
Sha256 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
U63 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
# No NUL: PostgreSQL text cannot hold one (SQLite can), so the two stores would disagree
# about the same message; refused here, both quarantine it as a schema error.
_NO_NUL = r"^[^\x00]*$"
Text = Annotated[str, msgspec.Meta(max_length=1024, pattern=_NO_NUL)]
ShortText = Annotated[str, msgspec.Meta(max_length=128, pattern=_NO_NUL)]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    pass


class Envelope(_Strict, frozen=True):
    device: Name
    boot_id: Hex32
    seq: U63
    t_ns: U63


class ModelHealth(_Strict, frozen=True):
    """What is wrong with the serving model's view of the plant (see ``edge_agent.ood``):
    the signals out of its training distribution, an alarm storm, a config whose
    acquisition the model was not trained for (run anyway: ``accept-mismatch``)."""

    ood: Annotated[list[Name], msgspec.Meta(max_length=256)] = msgspec.field(default_factory=list)
    alarm_storm: bool = False
    acquisition_mismatch: bool = False


class StateMsg(Envelope, kw_only=True, frozen=True):
    """``.../state``: ``online`` (retained birth), ``offline`` (clean stop or Last Will).

    ``model_health`` is absent while the model is healthy (and from older agents): an
    ``online`` state is published again, retained, whenever it changes, so the fleet's
    registry holds the current one.

    Data seqs start at 0 at every boot. State messages (the retained birth, a clean
    ``offline`` and the Last Will) are not part of the seq stream: a Last Will is composed at
    connect time and may never be sent, so it cannot own a number. Their ``seq`` is the
    device's watermark instead: how many data messages it had numbered when the message was
    made (0: none yet; 5: seqs 0..4 exist), so the fleet can report the missing head and tail
    of a boot as gaps, not only the holes between messages it has. The next boot of an agent
    also sends an ``offline`` state of the boot before it (not retained, made just before its
    own birth) with that boot's final count: the epitaph of a boot that was killed.
    """

    state: Literal["online", "offline"]
    #: False for the Last Will: the broker sent it because the device vanished.
    clean: bool = True
    site: Name
    device_type: Name = "generic"
    agent_version: ShortText = ""
    model_sha256: Annotated[str, msgspec.Meta(pattern=r"^([0-9a-f]{64})?$")] = ""
    model_health: ModelHealth | UnsetType = UNSET
    #: The lowest seq of this boot the device still holds (sends again until the fleet's
    #: ``cmd/stored`` names it): below it, what the fleet does not have is lost; at or
    #: above it, on its way. ``seq`` when it holds none. Absent: the device lets a message
    #: go once the broker acknowledged it (delivery ``broker``, or an older agent).
    held: U63 | UnsetType = UNSET

    def __post_init__(self) -> None:
        if not isinstance(self.held, UnsetType) and self.held > self.seq:
            raise ValueError(f"held {self.held} is beyond the watermark (seq {self.seq})")


class SignalStats(_Strict, array_like=True, frozen=True):
    """One signal over one period, ``[mean, min, max, last, n]`` on the wire (compact)."""

    mean: float
    min: float
    max: float
    last: float
    n: Annotated[int, msgspec.Meta(ge=0, lt=2**31)]


class TelemetryPeriod(_Strict, array_like=True, frozen=True):
    """One more period in a telemetry message, ``[t_ns, keyframe, signals]`` on the wire."""

    t_ns: U63
    keyframe: bool
    signals: Annotated[dict[Name, SignalStats], msgspec.Meta(max_length=1024)]


class TelemetryMsg(Envelope, kw_only=True, frozen=True, omit_defaults=True):
    """``.../telemetry``: per-signal statistics over ``[t_ns - period_ns, t_ns)``.

    ``keyframe`` periods carry every signal; the others only those that moved past their
    deadband since the last period sent (delta upload), so an absent signal means
    "unchanged", not "missing". ``more`` (absent when empty) carries later periods of the
    same length, oldest first, so fast telemetry (e.g. 10 ms periods) need not pay a whole
    envelope per period.
    """

    period_ns: Annotated[int, msgspec.Meta(gt=0, le=3_600_000_000_000)]
    keyframe: bool
    signals: Annotated[dict[Name, SignalStats], msgspec.Meta(max_length=1024)]
    more: Annotated[list[TelemetryPeriod], msgspec.Meta(max_length=10_000)] = msgspec.field(
        default_factory=list
    )


class RuleFired(_Strict, frozen=True):
    rule: ShortText
    reason: Text


class TopSignal(_Strict, frozen=True):
    signal: Name
    contribution: float | None


class WindowRef(_Strict, frozen=True):
    seq: U63
    start_ns: U63


class ModelRef(_Strict, frozen=True):
    sha256: Sha256
    version: ShortText
    ran: bool


class NoticeMsg(_Strict, frozen=True):
    """A change of the model's health on this decision's window (``edge_agent.ood``)."""

    kind: Name
    state: Literal["raised", "cleared"]
    signals: Annotated[list[Name], msgspec.Meta(max_length=256)] = msgspec.field(
        default_factory=list
    )
    reason: Text = ""


class DecisionMsg(Envelope, kw_only=True, frozen=True):
    """``.../decision``: :meth:`edge_agent.rules.Decision.to_json` plus the envelope.

    The last four fields are absent unless they have something to say (and from older
    agents), so an older fleet still reads every ordinary decision.
    """

    trace_id: Hex32
    window: WindowRef
    model: ModelRef
    label: Name
    score: float | None
    probabilities: Annotated[dict[Name, float | None], msgspec.Meta(max_length=256)]
    alarms: Annotated[list[Name], msgspec.Meta(max_length=256)]
    raised: Annotated[list[Name], msgspec.Meta(max_length=256)]
    cleared: Annotated[list[Name], msgspec.Meta(max_length=256)]
    rules_fired: Annotated[list[RuleFired], msgspec.Meta(max_length=256)]
    top_signals: Annotated[list[TopSignal], msgspec.Meta(max_length=256)]
    attribution: ShortText
    degraded: bool
    mode: ShortText
    stage_latency_ms: Annotated[dict[Name, float | None], msgspec.Meta(max_length=16)]
    ood: Annotated[list[Name], msgspec.Meta(max_length=256)] | UnsetType = UNSET
    alarm_storm: bool | UnsetType = UNSET
    acquisition_mismatch: bool | UnsetType = UNSET
    notices: Annotated[list[NoticeMsg], msgspec.Meta(max_length=16)] | UnsetType = UNSET


class OtaStatusMsg(Envelope, kw_only=True, frozen=True):
    """``.../ota/status``: one transition of the device's OTA state machine."""

    bundle_id: ShortText
    state: Name
    kind: Literal["model", "config", "agent"] | None = None
    version: ShortText = ""
    reason: Text = ""
    detail: Annotated[dict[Name, Any], msgspec.Meta(max_length=64)] = msgspec.field(
        default_factory=dict
    )


Message = StateMsg | TelemetryMsg | DecisionMsg | OtaStatusMsg

#: Topic kind -> schema.
KINDS: dict[str, type[Message]] = {
    "state": StateMsg,
    "telemetry": TelemetryMsg,
    "decision": DecisionMsg,
    "ota/status": OtaStatusMsg,
}

_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    kind: msgspec.json.Decoder(cls) for kind, cls in KINDS.items()
}


# Telemetry, the bulk of all traffic, has a fast path. msgspec checks a constrained dict key
# by calling Python's ``re`` for every key of every message: for 8 signals that was 3/5 of
# the decode. The twins below are TelemetryMsg / TelemetryPeriod with plain ``str`` keys
# (every other constraint the same); their keys are then checked against the same pattern,
# through a cache of names already seen to match (signal names repeat in every message).
# Anything the fast path does not accept is decoded again by the strict decoder, so what is
# accepted, and every error and where it points, is exactly the strict decoder's.
class _PeriodKeysUnchecked(_Strict, array_like=True, frozen=True):
    t_ns: U63
    keyframe: bool
    signals: Annotated[dict[str, SignalStats], msgspec.Meta(max_length=1024)]


class _TelemetryKeysUnchecked(Envelope, kw_only=True, frozen=True):
    period_ns: Annotated[int, msgspec.Meta(gt=0, le=3_600_000_000_000)]
    keyframe: bool
    signals: Annotated[dict[str, SignalStats], msgspec.Meta(max_length=1024)]
    more: Annotated[list[_PeriodKeysUnchecked], msgspec.Meta(max_length=10_000)] = msgspec.field(
        default_factory=list
    )


_TELEMETRY_FAST = msgspec.json.Decoder(_TelemetryKeysUnchecked)
# msgspec applies a pattern with ``search``, so does this (``$`` also matches before a
# final newline, and must keep doing so).
_name_ok = re.compile(_NAME_PATTERN).search
_NAMES_SEEN: set[str] = set()
_NAMES_SEEN_MAX = 65_536


def _names_ok(names: Any) -> bool:
    for name in names:
        if name not in _NAMES_SEEN:
            if _name_ok(name) is None:
                return False
            if len(_NAMES_SEEN) < _NAMES_SEEN_MAX:
                _NAMES_SEEN.add(name)
    return True


def _telemetry_keys_unique(m: _TelemetryKeysUnchecked, payload: bytes) -> bool:
    """True when ``payload`` provably repeats no key (False: let the scan decide).

    Every key and every string value is one JSON string with exactly two unescaped quotes.
    A telemetry message's strings are its 7 required keys (8 with a non-empty ``more``),
    ``device`` and ``boot_id`` and the signal names (none may hold a quote), so a payload
    with exactly twice as many quote bytes has no string token the decoder dropped: no
    repeated key. A fraction of the cost of encoding the message again to compare."""
    strings = 9 + len(m.signals)
    if m.more:
        strings += 1 + sum(len(p.signals) for p in m.more)
    return payload.count(b'"') == 2 * strings


def _decode_telemetry_fast(payload: bytes) -> tuple[TelemetryMsg, bool] | None:
    """The message and whether its keys are known to be unique, or None when the strict
    decoder must decide (and say why)."""
    try:
        m = _TELEMETRY_FAST.decode(payload)
    except msgspec.DecodeError:  # ValidationError too
        return None
    if not _names_ok(m.signals) or not all(_names_ok(p.signals) for p in m.more):
        return None
    unique = _telemetry_keys_unique(m, payload)
    return TelemetryMsg(
        device=m.device,
        boot_id=m.boot_id,
        seq=m.seq,
        t_ns=m.t_ns,
        period_ns=m.period_ns,
        keyframe=m.keyframe,
        signals=m.signals,
        more=[TelemetryPeriod(p.t_ns, p.keyframe, p.signals) for p in m.more],
    ), unique


_ENCODER = msgspec.json.Encoder()


#: msgspec's words for a string refused by the ``_NO_NUL`` pattern, and ours.
_NUL_PATTERN_TEXT = f"Expected `str` matching regex {_NO_NUL!r}"
_NUL_REASON = "text holds a NUL character (\\u0000)"


def _unchecked_by_msgspec(msg: Message, payload: bytes) -> None:
    """Refuse what msgspec accepted but the contract does not: a repeated key, a value
    nested deeper than MAX_DEPTH, NUL in free-form text. Raises WireError.

    The scan (pure Python) runs only when a cheap test says it may find something, so the
    agent's own messages pay one encode and a compare (~1 us for a telemetry message):

    * repeated keys: the payload is not byte for byte what :func:`encode` makes of the
      decoded message (which never repeats a key); the agent sends exactly that;
    * depth and NUL, possible only in ``OtaStatusMsg.detail`` (every other field has a
      fixed shape and a pattern): more brackets than MAX_DEPTH, or ``\\u0000`` anywhere.
    """
    suspect = _ENCODER.encode(msg) != payload
    if not suspect and type(msg) is OtaStatusMsg:
        brackets = payload.count(b"{") + payload.count(b"[")
        suspect = brackets > MAX_DEPTH or b"\\u0000" in payload
    if suspect:
        found = scan(payload, max_depth=MAX_DEPTH)
        if found is not None:
            raise WireError(*found)


def decode(kind: str, payload: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> Message:
    """Parse and check ``payload`` as a message of topic kind ``kind``. Raises WireError.

    Payloads are JSON (UTF-8). Unknown fields are rejected, types are exact (an int is not a
    string, a bool is not an int), numbers are finite (JSON has no NaN), sizes are capped
    before parsing, no object repeats a key (msgspec would keep the last one silently), no
    text anywhere holds NUL (PostgreSQL text cannot, SQLite could: the stores must agree), and
    no value is nested deeper than :data:`MAX_DEPTH` levels (the free-form ``detail``).
    :func:`decode` turns every problem into :class:`WireError` naming where.
    """
    if len(payload) > max_bytes:
        raise WireError(f"payload is {len(payload)} bytes; expected at most {max_bytes}")
    msg: Message | None = None
    if kind == "telemetry":
        fast = _decode_telemetry_fast(payload)
        if fast is not None:
            msg, unique = fast
            if unique:
                return msg  # no free-form field, so no depth or NUL left to check
    if msg is None:
        decoder = _DECODERS.get(kind)
        if decoder is None:
            raise WireError(f"unknown message kind {kind!r}; expected one of {', '.join(KINDS)}")
        try:
            msg = decoder.decode(payload)
        except msgspec.ValidationError as exc:
            text = str(exc)
            reason, _, where = text.partition(" - at `")
            if reason == _NUL_PATTERN_TEXT:
                reason = _NUL_REASON
            raise WireError(reason, where.rstrip("`") if where else "$") from None
        except msgspec.DecodeError as exc:
            raise WireError(f"not a JSON object: {exc}") from None
        except RecursionError:
            # Only a free-form value can nest this deep (a typed field fails at its first
            # wrong token); the scan stops at level MAX_DEPTH + 1 and names it.
            found = scan(payload, max_depth=MAX_DEPTH)
            raise WireError(*(found or (f"nested deeper than {MAX_DEPTH} levels", "$"))) from None
    _unchecked_by_msgspec(msg, payload)
    return msg


def encode(msg: Message) -> bytes:
    """The JSON bytes of ``msg`` (compact; what :func:`decode` reads back)."""
    return _ENCODER.encode(msg)


def kind_of(msg: Message) -> str:
    """The topic kind a message is published under.
    Raises ``TypeError`` for an object that is no message."""
    for kind, cls in KINDS.items():
        if type(msg) is cls:
            return kind
    raise TypeError(f"not a wire message: {type(msg).__name__}")
