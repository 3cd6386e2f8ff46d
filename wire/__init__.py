"""The wire contract between agents and the fleet: MQTT topics and message schemas.

Defined once, here, and imported by both sides (``edge_agent.uplink`` publishes with it,
``fleet`` ingests with it), so the two cannot drift apart. See :mod:`wire.topics` and
:mod:`wire.messages`.
"""

from wire.commands import OtaCommand, decode_command, encode_command
from wire.errors import WireError
from wire.messages import (
    KINDS,
    MAX_PAYLOAD_BYTES,
    DecisionMsg,
    Envelope,
    Message,
    ModelHealth,
    NoticeMsg,
    OtaStatusMsg,
    SignalStats,
    StateMsg,
    TelemetryMsg,
    TelemetryPeriod,
    decode,
    encode,
)
from wire.topics import Topic, parse_topic, topic

__all__ = [
    "KINDS",
    "MAX_PAYLOAD_BYTES",
    "DecisionMsg",
    "Envelope",
    "Message",
    "ModelHealth",
    "NoticeMsg",
    "OtaCommand",
    "OtaStatusMsg",
    "SignalStats",
    "StateMsg",
    "TelemetryMsg",
    "TelemetryPeriod",
    "Topic",
    "WireError",
    "decode",
    "decode_command",
    "encode",
    "encode_command",
    "parse_topic",
    "topic",
]
