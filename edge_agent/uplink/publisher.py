"""The uplink service: drains the durable outbox to an MQTT broker with QoS 1.

Threads: paho runs its network loop in its own thread (``loop_start``); every paho callback
only hands its facts to the asyncio loop with ``call_soon_threadsafe``. The outbox, the
in-flight table and every counter are touched on the asyncio loop thread only.

Delivery, the Last Will and ``held``: :class:`Uplink`; design: ``docs/ARCHITECTURE.md``,
"Uplink and fleet ingest".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from edge_agent.gates import set_socket_priority
from edge_agent.rules import Decision
from edge_agent.uplink.config import UplinkSection
from edge_agent.uplink.outbox import Outbox, Session
from edge_agent.uplink.pump import Pump
from edge_agent.uplink.states import StateMessages
from wire.errors import WireError
from wire.messages import (
    KINDS,
    DecisionMsg,
    Message,
    decode,
    encode,
    kind_of,
)
from wire.topics import device_root, topic

log = logging.getLogger(__name__)

#: The broker keeps our session (command subscription, queued commands) this long offline.
SESSION_EXPIRY_S = 24 * 3600
#: How long a CONNECT may wait for its CONNACK before the attempt counts as failed.
CONNACK_TIMEOUT_S = 10.0
#: At the end of run(): time to flush the outbox, then to get the clean offline acked.
FLUSH_S = 1.0
OFFLINE_ACK_S = 0.5

Build = Callable[[str, int], Message]


#: MQTT 5 PUBACK reason 16: accepted, but no subscription matched.
NO_MATCHING_SUBSCRIBERS = 16


class Uplink:
    """MQTT uplink of one device. Construct, then ``await run()`` until cancelled (once).

    ``publish_decision`` / ``publish`` are synchronous and cheap (one SQLite insert without
    fsync); call them on the event loop thread. They never raise for bad messages or I/O
    trouble: the message is dropped and counted in :meth:`stats`.

    One paho client per connection attempt: the Last Will is fixed at CONNECT, and its ``seq``
    is the watermark at that moment, so a fresh client per attempt keeps the will current; it
    also means no paho-internal queue survives a lost connection: what was in flight is simply
    sent again from the outbox (QoS 1 may duplicate; the fleet dedups on ``(boot_id, seq)``).

    Delivery: every data message (live or backlog) goes through the outbox and leaves it in id
    order, paced by a token bucket (``replay_rate_per_s``) and a window of ``max_inflight``
    unacknowledged PUBLISHes. A row is deleted when its PUBACK arrives, or, once the fleet
    confirms what it stores, when its ``cmd/stored`` names it (:mod:`.delivery`). After an
    outage the backlog drains at the paced rate while new rows append behind it.

    State (``.../state``, retained, QoS 1): ``online`` at every connect, ``offline`` with
    ``clean=False`` as the Last Will, and a clean ``offline`` at :meth:`Uplink.run`'s end. While
    rows are kept for the fleet's confirmation, every state carries ``held`` (the lowest seq of
    its boot still in the outbox), and ``online`` is published again when it moved, at most
    every ``HELD_EVERY_S``: the fleet reports a missing seq as lost only below it. The payloads
    and that cadence: :mod:`.states`.
    """

    def __init__(
        self,
        section: UplinkSection,
        *,
        site: str,
        device: str,
        device_type: str,
        agent_version: str,
        state_dir: str | Path,
        model_sha256: Callable[[], str],
        model_health: Callable[[], dict[str, object] | None] | None = None,
        priority: int | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
        on_command: Callable[[str, bytes], None] | None = None,
    ) -> None:
        self.section = section
        self.device = device
        self.priority = priority
        self.clock_ns = clock_ns
        #: Called on the event loop with (name, payload) for each ``.../cmd/{name}`` message.
        self.on_command = on_command
        self.root = device_root(site, device)  # raises ValueError for a bad site/device
        self.state_topic = topic(site, device, "state")
        # Built once: topic() checks the names with a regex, too slow for every message.
        self._topics = {kind: topic(site, device, kind) for kind in KINDS if kind != "state"}
        self.client_id = section.effective_client_id(device)
        self.session = Session()
        self.outbox = Outbox(
            section.resolve_outbox(state_dir),
            boot_id=self.session.boot_id,
            max_bytes=section.outbox.max_bytes,
            reserve_bytes=section.outbox.decision_reserve_bytes,
            clock_ns=clock_ns,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._client: mqtt.Client | None = None
        self._connecting: asyncio.Future[Any] | None = None
        self._connected = False
        #: mid -> (the earlier boot it ends, whether the outbox holds none of its rows).
        self._epitaphs: dict[int, tuple[str, bool]] = {}
        #: When this connection's birth was made: epitaphs are dated just before it.
        self._birth_t = 0
        #: Messages never sent, per kind (invalid at publish, or over the wire limit).
        self.invalid: dict[str, int] = {}
        self.pump = Pump(
            self.outbox, section, wake=self._wake, invalid=self.invalid, clock_ns=clock_ns
        )
        self.states = StateMessages(
            device=device,
            site=site,
            device_type=device_type,
            agent_version=agent_version,
            model_sha256=model_sha256,
            model_health=model_health,
            clock_ns=clock_ns,
            session=self.session,
            outbox=self.outbox,
            keep=lambda: self.pump.delivery.keep,
        )
        self._ran = False
        #: Set once run() is cancelled: a connection lost from then on is part of stopping.
        self._stopping = False
        # counters (event loop thread only)
        self.queued: dict[str, int] = {}
        self.connect_attempts = 0
        self.connects = 0
        self.connect_failures = 0
        self.disconnects = 0
        self.commands = 0
        self.command_errors = 0
        #: Earlier boots whose final watermark the broker acknowledged (see _publish_epitaphs).
        self.epitaphs = 0
        self.last_error: str | None = None
        self.socket_priority: int | None = None
        self._prio_warned = False

    # -- producing --------------------------------------------------------------------------

    def publish(self, kind: str, build: Build) -> bool:
        """Number, check and store one data message; ``False`` if it was dropped.

        ``build(boot_id, seq)`` returns the message (its envelope must carry exactly these
        numbers). The seq is only taken once the message is built and valid, so a failing
        build never leaves a gap; a message the outbox drops does (and is counted).
        """
        seq = self.session.next_seq
        if kind not in self._topics:
            # State messages have no seq (see wire.messages); anything else is not ours.
            self.invalid[kind] = self.invalid.get(kind, 0) + 1
            self.last_error = f"not a data message kind: {kind!r}"
            return False
        try:
            payload = self._checked(kind, build(self.session.boot_id, seq), seq)
        except (WireError, TypeError, ValueError, msgspec.ValidationError) as exc:
            self.invalid[kind] = self.invalid.get(kind, 0) + 1
            self.last_error = f"invalid {kind} message: {exc}"
            log.warning("uplink: dropped an invalid %s message: %s", kind, exc)
            return False
        except Exception as exc:  # a bug in a build callback must not stop its caller
            self.invalid[kind] = self.invalid.get(kind, 0) + 1
            self.last_error = f"building a {kind} message failed: {exc!r}"
            log.exception("uplink: building a %s message failed", kind)
            return False
        self.session.take()
        ok = self.outbox.put(kind, self._topics[kind], payload, seq)
        if ok:
            self.queued[kind] = self.queued.get(kind, 0) + 1
        self._wake.set()
        return ok

    def _checked(self, kind: str, msg: Message, seq: int) -> bytes:
        if kind_of(msg) != kind:
            raise WireError(f"built a {kind_of(msg)!r} message for kind {kind!r}")
        payload = encode(msg)
        # A round trip through the fleet's own decoder: what we store, the fleet accepts.
        back = decode(kind, payload)
        if back.boot_id != self.session.boot_id or back.seq != seq:
            raise WireError("envelope boot_id/seq differ from the ones given to build")
        return payload

    def publish_decision(self, d: Decision) -> bool:
        """Publish one decision on ``.../decision`` (``d.to_json()`` plus the envelope)."""
        fields = d.to_json()

        def build(boot_id: str, seq: int) -> Message:
            return msgspec.convert(
                {**fields, "device": self.device, "boot_id": boot_id, "seq": seq}, DecisionMsg
            )

        return self.publish("decision", build)

    # -- stats ------------------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        ob = self.outbox.stats()
        return {
            "connected": self._connected,
            "host": self.section.host,
            "port": self.section.port,
            "client_id": self.client_id,
            "boot_id": self.session.boot_id,
            "next_seq": self.session.next_seq,
            "queued": dict(self.queued),
            **self.pump.stats(),
            "invalid": dict(self.invalid),
            "connect_attempts": self.connect_attempts,
            "connects": self.connects,
            "reconnects": max(0, self.connects - 1),
            "connect_failures": self.connect_failures,
            "disconnects": self.disconnects,
            "commands": self.commands,
            "command_errors": self.command_errors,
            "epitaphs": self.epitaphs,
            "socket_priority": self.socket_priority,
            "last_error": self.last_error or self.pump.last_error or ob["last_error"],
        }

    # -- messages of our own -------------------------------------------------------------------

    def announce(self) -> None:
        """Publish the retained ``online`` state again: the versions in it changed (an OTA
        update committed or rolled back) or the model's health did, and the fleet's
        registry reads them from there."""
        client = self._client
        if client is not None and self._connected:
            client.publish(
                self.state_topic, self.states.make("online", clean=True), qos=1, retain=True
            )

    def _tell_held(self) -> None:
        """While rows are kept: the state and the epitaphs again when ``held`` moved (see
        :mod:`.states`)."""
        client = self._client
        if client is not None and self._connected and self.states.tell_held():
            self._publish_epitaphs(client, self._birth_t - 1)
            self.announce()

    # -- paho side (network thread): hand everything to the loop ----------------------------

    def _to_loop(self, fn: Callable[..., None], *args: object) -> None:
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed while paho was finishing
            loop.call_soon_threadsafe(fn, *args)

    def _make_client(self, connack: asyncio.Future[tuple[bool, str]]) -> mqtt.Client:
        s = self.section
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=mqtt.MQTTv5,
            reconnect_on_failure=False,
        )
        # A few above ours: births and the offline message share paho's window.
        client.max_inflight_messages_set(s.max_inflight + 4)
        if s.tls is not None:
            client.tls_set(ca_certs=s.tls.ca_file, certfile=s.tls.cert_file, keyfile=s.tls.key_file)
        if s.username is not None:
            password: str | None = None
            if s.password_file is not None:
                try:
                    password = Path(s.password_file).expanduser().read_text().rstrip("\r\n")
                except OSError as exc:
                    raise OSError(
                        f"cannot read uplink.password_file {s.password_file!r}: {exc.strerror}"
                    ) from None
            client.username_pw_set(s.username, password)
        client.will_set(
            self.state_topic, self.states.make("offline", clean=False), qos=1, retain=True
        )

        def on_socket_open(c: mqtt.Client, _u: object, sock: Any) -> None:
            if self.priority is None or not isinstance(sock, socket.socket):
                return
            try:
                set_socket_priority(sock, self.priority)
                self.socket_priority = self.priority
            except (OSError, ValueError) as exc:
                if not self._prio_warned:
                    self._prio_warned = True
                    log.warning("uplink: cannot set SO_PRIORITY %s: %s", self.priority, exc)

        def on_connect(c: mqtt.Client, _u: object, _f: object, rc: ReasonCode, _p: object) -> None:
            self._to_loop(self._on_connack, connack, rc.is_failure, str(rc))

        def on_disconnect(
            c: mqtt.Client, _u: object, _f: object, rc: ReasonCode, _p: object
        ) -> None:
            self._to_loop(self._on_lost, c, str(rc), connack)

        def on_publish(c: mqtt.Client, _u: object, mid: int, rc: ReasonCode, _p: object) -> None:
            failed = rc.is_failure
            nobody = not failed and rc.value == NO_MATCHING_SUBSCRIBERS
            self._to_loop(self._on_puback, c, mid, failed, str(rc), nobody)

        def on_message(c: mqtt.Client, _u: object, msg: mqtt.MQTTMessage) -> None:
            self._to_loop(self._on_command, msg.topic, bytes(msg.payload))

        client.on_socket_open = on_socket_open
        client.on_connect = on_connect
        client.on_disconnect = on_disconnect
        client.on_publish = on_publish
        client.on_message = on_message
        return client

    # -- loop side ----------------------------------------------------------------------------

    def _on_connack(self, fut: asyncio.Future[tuple[bool, str]], failed: bool, why: str) -> None:
        if not fut.done():
            fut.set_result((failed, why))

    def _on_lost(
        self, client: mqtt.Client, why: str, connack: asyncio.Future[tuple[bool, str]]
    ) -> None:
        if not connack.done():
            # Closed before its CONNACK (e.g. the TLS peer refused our certificate).
            connack.set_result((True, f"connection closed before CONNACK: {why}"))
        if client is not self._client:
            return
        if self._connected and self._stopping:
            # The broker went first (a site or demo shutdown): what is left stays in the
            # outbox for the next start, as run()'s last line says.
            log.info("uplink: connection to %s:%s lost while stopping: %s", *self._where(), why)
        elif self._connected:
            self.disconnects += 1
            self.last_error = f"connection lost: {why}"
            log.warning("uplink: connection to %s:%s lost: %s", *self._where(), why)
        self._connected = False
        self._wake.set()

    def _on_puback(
        self, client: mqtt.Client, mid: int, failed: bool, why: str, nobody: bool = False
    ) -> None:
        if client is not self._client:
            return  # a PUBACK of a connection we already gave up: its row is sent again
        if self.pump.puback(mid, failed, why, nobody):
            return
        ended = self._epitaphs.pop(mid, None)  # else a state message
        if ended is not None and not failed and not nobody:
            boot_id, final = ended
            if final:
                self.outbox.forget_boot(boot_id)  # else told again by _tell_held
            self.epitaphs += 1

    def _on_command(self, topic_name: str, payload: bytes) -> None:
        prefix = f"{self.root}/cmd/"
        if not topic_name.startswith(prefix):
            return
        name = topic_name.removeprefix(prefix)
        if name == "stored":
            self.pump.stored(payload)
            return
        self.commands += 1
        if self.on_command is None:
            log.info("uplink: command %r ignored (no handler)", name[:128])
            return
        try:
            self.on_command(name, payload)
        except Exception as exc:  # a handler bug must not take the uplink down
            self.command_errors += 1
            self.last_error = f"command {name[:128]!r} handler failed: {exc}"
            log.exception("uplink: command handler failed for %r", name[:128])

    def _where(self) -> tuple[str, int]:
        return self.section.host, self.section.port

    # -- run ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, publish, reconnect with jittered backoff; until cancelled.

        On cancellation: flush for up to 1 s, publish the clean ``offline``, disconnect,
        close the outbox, and re-raise.
        """
        if self._ran:
            raise RuntimeError("Uplink.run() can be called once")
        self._ran = True
        self._loop = asyncio.get_running_loop()
        attempt = 0
        try:
            while True:
                if await self._connect_once():
                    attempt = 0
                    if self._client is not None:
                        await self.pump.drain(
                            self._client, lambda: self._connected, tick=self._tell_held
                        )
                    await self._teardown()
                else:
                    await self._teardown()
                    attempt += 1
                await asyncio.sleep(self._backoff_s(attempt))
        except asyncio.CancelledError:
            await self._shutdown()
            raise
        finally:
            await self._teardown()
            self.pump.settle()
            self.outbox.close()

    def _backoff_s(self, attempt: int) -> float:
        s = self.section
        cap = min(s.reconnect_max_ms, s.reconnect_min_ms * 2 ** min(attempt, 30))
        # Jitter spreads the reconnects of a whole site after a broker restart.
        return float(random.uniform(0.5, 1.0) * cap / 1000.0)

    async def _connect_once(self) -> bool:
        s = self.section
        self.connect_attempts += 1
        loop = asyncio.get_running_loop()
        connack: asyncio.Future[tuple[bool, str]] = loop.create_future()
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = SESSION_EXPIRY_S
        try:
            client = self._make_client(connack)
            self._client = client
            # connect() is blocking (DNS, TCP, TLS handshake): off the loop. Shielded, so a
            # cancel cannot orphan a half-made connection: _teardown waits for it first.
            self._connecting = asyncio.ensure_future(
                asyncio.to_thread(
                    client.connect,
                    s.host,
                    s.port,
                    s.keepalive_s,
                    clean_start=False,
                    properties=props,
                )
            )
            await asyncio.shield(self._connecting)
            client.loop_start()
            async with asyncio.timeout(CONNACK_TIMEOUT_S):
                failed, why = await connack
        except TimeoutError:
            return self._failed(f"cannot connect: no CONNACK within {CONNACK_TIMEOUT_S:g} s")
        except (OSError, ValueError) as exc:
            return self._failed(f"cannot connect: {exc or type(exc).__name__}")
        if failed:
            return self._failed(f"broker refused the connection: {why}")
        self.connects += 1
        self._connected = True
        self.pump.connected()
        log.info(
            "uplink: connected to %s:%s as %r (boot %s, backlog %d)",
            s.host,
            s.port,
            self.client_id,
            self.session.boot_id,
            len(self.outbox),
        )
        birth_t = self._birth_t = self.clock_ns()
        self._publish_epitaphs(client, birth_t - 1)
        client.publish(
            self.state_topic,
            self.states.make("online", clean=True, t_ns=birth_t),
            qos=1,
            retain=True,
        )
        client.subscribe(f"{self.root}/cmd/#", qos=1)
        return True

    def _publish_epitaphs(self, client: mqtt.Client, t_ns: int) -> None:
        """Tell the fleet how many seqs each earlier boot numbered: an ``offline`` state
        message of that boot (not retained), made just before this boot's birth.

        A boot that was killed or lost its broker ends with a Last Will made at its last
        connect, or with nothing: what it numbered after that and the broker dropped on its
        way to the ingest would be a tail no one could see. With this watermark ``fleet
        gaps`` reports it. The fleet raises the old boot's watermark and, the message being
        older than this birth, never lets it mark the device offline after the birth.
        Sent again at every connect until the broker acknowledges it to a subscriber and,
        while rows are kept for the fleet, with the boot's ``held`` by :meth:`_tell_held`
        until none of its rows is left."""
        self._epitaphs.clear()
        for boot_id, numbered, clean in self.outbox.previous_boots():
            payload = self.states.make("offline", clean=clean, boot=(boot_id, numbered), t_ns=t_ns)
            info = client.publish(self.state_topic, payload, qos=1, retain=False)
            if info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
                final = self.states.held(boot_id, numbered) in (None, numbered)
                self._epitaphs[info.mid] = (boot_id, final)

    def _failed(self, why: str) -> bool:
        self.connect_failures += 1
        if why != self.last_error:
            log.warning("uplink: %s:%s: %s", *self._where(), why)
        self.last_error = why
        return False

    async def _teardown(self) -> None:
        client, self._client = self._client, None
        self._connected = False
        self.pump.lost()
        if client is None:
            return
        connecting, self._connecting = self._connecting, None
        if connecting is not None and not connecting.done():
            await asyncio.wait([connecting], timeout=CONNACK_TIMEOUT_S)
        if connecting is not None and connecting.done() and not connecting.cancelled():
            connecting.exception()  # retrieved: a failed connect is reported by _failed
        with contextlib.suppress(Exception):
            client.disconnect()
        # loop_stop joins paho's thread: off the loop.
        await asyncio.to_thread(client.loop_stop)
        with contextlib.suppress(Exception):
            sock = client.socket()
            if sock is not None:
                sock.close()

    async def _shutdown(self) -> None:
        self._stopping = True
        self.outbox.stopped_clean()
        client = self._client
        if client is None or not self._connected:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FLUSH_S):
                await self.pump.drain(client, lambda: self._connected, until_idle=True)
        self.pump.settle()
        if self._connected:
            info = client.publish(
                self.state_topic, self.states.make("offline", clean=True), qos=1, retain=True
            )
            with contextlib.suppress(ValueError, RuntimeError):
                await asyncio.to_thread(info.wait_for_publish, OFFLINE_ACK_S)
        log.info("uplink: stopped (backlog %d rows kept for the next start)", len(self.outbox))


__all__ = ["Uplink"]
