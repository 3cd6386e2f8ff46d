"""Running rollouts: the store and the broker at the edges of :mod:`fleet.rollout.machine`.

:func:`create_rollout` plans and saves a rollout (no broker needed); the
:class:`Orchestrator` steps every active one inside ``fleet serve``: requests, ``ota/status``
messages, ticks, saves, then the commands. All of a rollout's state is its document in the
store, so a restart continues where it was.

Design: ``docs/ARCHITECTURE.md``, "Rollouts".
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from fleet.errors import FleetError, RolloutError
from fleet.rollout import machine as m
from fleet.rollout.held import RESEND_GRACE_S, HeldOffers
from fleet.rollout.plan import (
    Candidate,
    plan,
)
from fleet.store import Store
from ota.canonical import canonical, loads_strict
from ota.efb import BundleReader
from ota.errors import OtaError
from ota.manifest import parse_signed
from ota.trust import load_root, signers, split_envelope
from wire import OtaCommand, OtaStatusMsg, WireError, decode, encode_command, topic

log = logging.getLogger(__name__)

TRANSPORTS = ("http", "coap")
#: How long a halted, aborted or completed rollout still takes late status reports.
LINGER_S = 600.0
#: How far back each step re-reads stored status reports (late commits of a batch).
CURSOR_OVERLAP_S = 30.0
#: Status reports read per store query; a step reads pages until one is shorter.
STATUS_PAGE = 10_000
#: Up to this many held devices are looked up one by one; more, with one registry read.
HELD_LOOKUPS = 100


@dataclass
class _Step:
    """What one :meth:`Orchestrator.step` works on: the rollouts it watches (with their
    transport), which of them changed, and the commands their machines asked for."""

    rollouts: dict[str, tuple[m.Rollout, str]]
    changed: set[str] = field(default_factory=set)
    commands: list[tuple[m.Rollout, str, m.Command]] = field(default_factory=list)

    def request(self, rid: str, action: str, now: int) -> None:
        """An operator's pause, resume or abort of ``rid`` (ignored if not watched)."""
        if rid not in self.rollouts:
            return
        r, transport = self.rollouts[rid]
        if action == "pause":
            r = m.pause(r, now)
        elif action == "resume":
            r = m.resume(r, now)
        else:
            r, cmds = m.abort(r, now)
            self.commands += [(r, transport, c) for c in cmds]
        self.rollouts[rid] = (r, transport)
        self.changed.add(rid)

    def tick(self, rid: str, now: int) -> None:
        """Time passes for ``rid``: waves open, gates and timeouts are judged."""
        r, transport = self.rollouts[rid]
        nxt, cmds = m.tick(r, now)
        if nxt != r or cmds:
            self.rollouts[rid] = (nxt, transport)
            self.changed.add(rid)
            if nxt.state != r.state or nxt.wave != r.wave:
                log.info("rollout %s: %s", rid, nxt.history[-1][1] if nxt.history else nxt.state)
        self.commands += [(nxt, transport, c) for c in cmds]


@dataclass(frozen=True)
class BundleInfo:
    bundle_id: str
    kind: str
    version: str
    counter: int
    length: int
    signed_by: int


def read_bundle(path: Path, root_json: Path | None = None) -> BundleInfo:
    """The manifest facts a rollout needs; with ``root_json``, its signatures checked too.
    Raises ``RolloutError``."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            reader = BundleReader(f, size)
            first = reader.next_member()
            if first is None or first.name != "manifest.json":
                raise RolloutError(f"{path}: not a bundle (manifest.json is not the first member)")
            data = b"".join(bytes(c) for c in reader.read(first))
        doc = loads_strict(data, what="manifest.json", max_bytes=64 * 1024)
        signed, sigs = split_envelope(doc, what="manifest.json")
        manifest = parse_signed(signed)
        count = len(sigs)
        if root_json is not None:
            now = datetime.now(UTC)
            root = load_root(root_json.read_bytes(), now)
            role = root.roles["bundles"]
            good = signers(canonical(signed), sigs, role, root.keys, now, what="manifest.json")
            if len(good) < root.roles["bundles"].threshold:
                raise RolloutError(
                    f"{path}: {len(good)} valid signature(s) by {root_json}'s bundle keys; "
                    f"its threshold is {root.roles['bundles'].threshold}: devices would refuse it"
                )
            count = len(good)
    except OSError as exc:
        raise RolloutError(f"{path}: cannot read: {exc.strerror}") from None
    except OtaError as exc:
        raise RolloutError(f"{path}: {exc}") from None
    return BundleInfo(
        bundle_id=manifest.bundle_id,
        kind=manifest.kind,
        version=manifest.version,
        counter=manifest.counter,
        length=size,
        signed_by=count,
    )


def candidates(store: Store) -> list[Candidate]:
    labels = store.labels()
    out = []
    for d in store.devices():
        group, tier = labels.get(d.device, ("", "normal"))
        out.append(Candidate(d.device, d.site, d.device_type, group, tier))
    return out


def create_rollout(
    store: Store,
    bundle: Path,
    *,
    artifacts: Path,
    selector: dict[str, tuple[str, ...]],
    params: m.Params,
    transport: str = "http",
    root_json: Path | None = None,
    now_ns: int | None = None,
    dry_run: bool = False,
) -> m.Rollout:
    """Check ``bundle``, plan its waves, publish it as an artifact and store the rollout.

    ``dry_run``: every check and the plan, under the id it would get, but nothing is
    published or stored (the preview an operator reads before a fleet-wide change).
    Raises ``RolloutError``.
    """
    from fleet.artifacts import publish  # noqa: PLC0415 - aiohttp/aiocoap on use

    if transport not in TRANSPORTS:
        raise RolloutError(f"--transport {transport!r}: expected one of {', '.join(TRANSPORTS)}")
    info = read_bundle(bundle, root_json)
    if info.signed_by == 0:
        raise RolloutError(f"{bundle}: unsigned (run fleet bundle sign first)")
    now = now_ns if now_ns is not None else time.time_ns()
    existing = store.rollouts()
    active = [r for r in existing if r[1] in ("running", "paused")]
    taken = {rid for rid, _, _ in existing}
    n = len(existing) + 1
    while f"r{n}" in taken:
        n += 1
    rollout_id = f"r{n}"
    waves = plan(rollout_id, candidates(store), selector, params.waves)
    if not waves:
        raise RolloutError(f"no registered device matches --select {_selector_text(selector)}")
    busy = {d for _, _, doc in active for d in json.loads(doc)["devices"]}
    overlap = sorted(busy & {d for w in waves for d in w})
    if overlap:
        raise RolloutError(
            f"{len(overlap)} selected device(s) are in an active rollout already "
            f"({', '.join(overlap[:5])}); pause/abort it or narrow --select"
        )
    try:
        sha = _sha256_of(bundle) if dry_run else publish(artifacts, bundle)
    except (FleetError, OSError) as exc:
        raise RolloutError(str(exc)) from None
    r = m.create(
        rollout_id,
        bundle_id=info.bundle_id,
        version=info.version,
        kind=info.kind,
        sha256=sha,
        length=info.length,
        waves=waves,
        params=params,
        now_ns=now,
    )
    if dry_run:
        return r
    _keep_in_store(store, artifacts, sha, now)
    doc = json.dumps({**r.to_json(), "transport": transport})
    if not store.insert_rollout(r.id, r.state, doc, now):
        raise RolloutError(f"rollout id {r.id} was taken meanwhile (two creates at once); retry")
    return r


def _keep_in_store(store: Store, artifacts: Path, sha: str, now_ns: int) -> None:
    """The published bundle into the store too, for every node to serve (see
    :mod:`fleet.artifacts`); one over ``STORED_BUNDLE_MAX_BYTES`` stays in this node's
    directory only, and the log says so."""
    from fleet.artifacts import STORED_BUNDLE_MAX_BYTES, bundle_path  # noqa: PLC0415

    path = bundle_path(artifacts, sha)
    size = path.stat().st_size
    if size > STORED_BUNDLE_MAX_BYTES:
        log.warning(
            "bundle %s is %d bytes, over the %d the store keeps: only the artifact directory "
            "%s holds it; other fleet serve nodes need that directory shared to serve it",
            sha, size, STORED_BUNDLE_MAX_BYTES, artifacts,
        )  # fmt: skip
        return
    store.put_bundle(sha, path.read_bytes(), now_ns)


def _sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _selector_text(selector: dict[str, tuple[str, ...]]) -> str:
    return ",".join(f"{k}={'|'.join(v)}" for k, v in selector.items()) or "(all)"


def load(doc: str) -> tuple[m.Rollout, str]:
    d = json.loads(doc)
    return m.Rollout.from_json(d), str(d.get("transport", "http"))


def request(store: Store, rollout_id: str, action: str) -> None:
    """Ask the orchestrator to ``pause``, ``resume`` or ``abort`` a rollout.
    Raises ``RolloutError`` (unknown rollout, or not in a state that takes it)."""
    if action not in ("pause", "resume", "abort"):
        raise RolloutError(f"unknown action {action!r}")
    known = {rid: state for rid, state, _ in store.rollouts()}
    if rollout_id not in known:
        raise RolloutError(f"no rollout {rollout_id!r}")
    if known[rollout_id] in ("aborted", "completed", "halted") and action != "abort":
        raise RolloutError(f"rollout {rollout_id} is {known[rollout_id]}: nothing to {action}")
    store.add_rollout_request(rollout_id, action, time.time_ns())


Publish = Callable[[str, bytes], bool]
Urls = Callable[[str, str], str]


class Orchestrator:
    """One step at a time (:meth:`step`); :func:`run_forever` calls it in a loop.

    - **create** (``fleet rollout create``): reads the bundle's manifest (checked against the
      fleet's ``root.json`` when given), publishes the bundle into the artifact directory as
      ``<sha256>.efb``, plans the waves from the registry and its labels, and saves the rollout.
      No broker is needed: the orchestrator picks it up.
    - **step** (every ``tick_s`` inside ``fleet serve``): takes pause/resume/abort requests from
      the store, feeds every ``ota/status`` message the ingest stored since the last step (read
      page by page) to the rollouts it belongs to (matched by ``bundle_id``), ticks each
      rollout, saves what changed and then publishes the offers and rollbacks it asked for on
      ``.../cmd/ota`` (QoS 1; the devices' persistent sessions keep them while a device is
      offline). The cursor and the requests move on only when every save succeeded.

    All of a rollout's state is its document in the store. After a restart the orchestrator
    reads the ``ota/status`` messages again from the oldest active rollout's creation on;
    the machine ignores what it has applied already (``(boot_id, seq)`` order), so the
    rollout continues where it was. One orchestrator runs per store: on several ``fleet
    serve`` nodes the one that holds the lead (:mod:`fleet.leader`), whose saves carry its
    epoch, so a node that lost the lead saves and sends nothing more. An offer the lead
    before saved but did not record as sent is held (:mod:`fleet.rollout.held`): sent again
    only if its device, online, does not answer it within the grace.
    """

    def __init__(
        self,
        store: Store,
        *,
        publish: Publish,
        url_for: Urls,
        clock: Callable[[], int] = time.time_ns,
        resend_grace_s: float = RESEND_GRACE_S,
    ) -> None:
        self.store = store
        self.publish = publish
        self.url_for = url_for
        self.clock = clock
        self.cursor: int | None = None
        self.sent: dict[str, int] = {"offer": 0, "rollback": 0}
        self.ignored = 0
        self._sites: dict[str, str] = {}
        self._unsent: list[tuple[str, m.Command, str, bytes]] = []
        self._bad_docs: set[str] = set()
        #: The lead's fencing token this orchestrator saves under (None: no lead to check).
        self.epoch: int | None = None
        #: The epoch whose first step held what the lead before may have left unsent.
        self._resumed: int | None = -1
        self._held = HeldOffers(resend_grace_s)

    def _site(self, device: str) -> str | None:
        if device not in self._sites:
            for d in self.store.devices():
                self._sites[d.device] = d.site
        return self._sites.get(device)

    def step(self) -> list[m.Rollout]:
        """Requests, new statuses, ticks, saves, commands. Returns the active rollouts.

        One step is all or nothing for the cursor and the requests: they move on only when
        every changed rollout was saved. A step that raises (a store error) leaves both
        where they were, and the next step reads the same reports and applies the same
        requests again on the stored state (the machine ignores what it applied already;
        pause, resume and abort of a rollout in that state already change nothing).
        Commands go out after their rollout's save: a failed save sends nothing of that
        rollout, whose next step decides again.
        """
        now = self.clock()
        # Marked done only after the saves: a step that fails (or a crash) applies them again.
        requests = self.store.pending_rollout_requests()
        work = _Step(self._watched(now, {rid for _, rid, _ in requests}))
        for _, rid, action in requests:
            work.request(rid, action, now)
        cursor = self.cursor
        if work.rollouts:
            if cursor is None:
                # After a (re)start: every status since the oldest active rollout began.
                cursor = min(r.created_ns for r, _ in work.rollouts.values()) - 1
            cursor = self._apply_statuses(work, cursor, now)
        stored = {rid: r for rid, (r, _) in work.rollouts.items()}
        if self._resumed != self.epoch:
            # Before the ticks: only offers of an earlier lead, not those this step makes.
            held = self._held.hold(stored)
            if held:
                log.warning(
                    "rollouts: %d offers saved but not known to be sent: held until their "
                    "devices answer or stay silent online for %.0f s",
                    held, self._held.grace_ns / 1e9,
                )  # fmt: skip
        self._resend_held(work, stored, now)
        for rid in list(work.rollouts):
            work.tick(rid, now)
        saved: set[str] = set()
        sent: list[tuple[str, str]] = []
        try:
            for rid in sorted(work.changed):
                r, transport = work.rollouts[rid]
                self._save(r, transport, now)
                saved.add(rid)
        finally:
            # Even when a later save failed: a saved rollout counts on its commands sent.
            sent = self._publish([(r, t, c) for r, t, c in work.commands if r.id in saved])
        self._mark_sent(work, sent, now)
        self._resumed = self.epoch
        # Every save went through: the step is done.
        if requests:
            self.store.finish_rollout_requests([i for i, _, _ in requests], now)
        self.cursor = cursor
        return [r for r, _ in work.rollouts.values() if r.state in ("running", "paused")]

    def _save(self, r: m.Rollout, transport: str, now: int) -> None:
        doc = json.dumps({**r.to_json(), "transport": transport})
        self.store.save_rollout(r.id, r.state, doc, now, epoch=self.epoch)

    def _resend_held(self, work: _Step, stored: dict[str, m.Rollout], now: int) -> None:
        """Send again each held offer whose device has been online for the grace without
        answering (:mod:`fleet.rollout.held`). After the save under this epoch, like any
        command: a device that got the offer after all ignores it while it runs, or answers
        that it has that version already."""
        names = self._held.devices()
        if not names:
            return
        if len(names) <= HELD_LOOKUPS:
            infos = [self.store.device(name) for name in names]
        else:
            infos = [d for d in self.store.devices() if d.device in names]
        online = {d.device: d.online for d in infos if d is not None}
        due = self._held.due(stored, online, now)
        if due:
            log.warning(
                "rollouts: %d offers not known to be sent got no answer in %.0f s online: "
                "sending again", len(due), self._held.grace_ns / 1e9,
            )  # fmt: skip
        for rid, name in due:
            r, transport = work.rollouts[rid]
            work.commands.append((r, transport, m.Command("offer", name)))
            work.changed.add(rid)

    def _mark_sent(self, work: _Step, sent: list[tuple[str, str]], now: int) -> None:
        """Record the offers handed to the broker (``sent_ns``), so that a next leader does
        not send them again."""
        by_rollout: dict[str, list[str]] = {}
        for rid, device in sent:
            by_rollout.setdefault(rid, []).append(device)
        for rid, names in sorted(by_rollout.items()):
            if rid not in work.rollouts:
                continue
            r, transport = work.rollouts[rid]
            devices = dict(r.devices)
            for name in names:
                d = devices.get(name)
                if d is not None and d.state == "offered":
                    devices[name] = replace(d, sent_ns=d.offered_ns)
            r = replace(r, devices=devices)
            work.rollouts[rid] = (r, transport)
            self._save(r, transport, now)

    def _watched(self, now: int, asked: set[str]) -> dict[str, tuple[m.Rollout, str]]:
        """The stored rollouts this step looks at: active ones, those stopped within
        :data:`LINGER_S` (a device that reports a regression late must still be told to roll
        back; machine.tick does that) and any an operator's request names (an abort of one
        halted long ago still sends rollback to its devices in flight)."""
        recent = now - int(LINGER_S * 1e9)
        rollouts = {}
        for rid, state, doc in self.store.rollouts():
            try:
                r, transport = load(doc)
            except (ValueError, KeyError, TypeError) as exc:
                # One damaged document must not stop every other rollout.
                if rid not in self._bad_docs:
                    self._bad_docs.add(rid)
                    log.error("rollout %s: its stored state is unreadable (%s); skipped", rid, exc)
                continue
            if state in ("running", "paused") or r.updated_ns >= recent or rid in asked:
                rollouts[rid] = (r, transport)
        return rollouts

    def _apply_statuses(self, work: _Step, cursor: int, now: int) -> int:
        """Feed every status report stored since ``cursor`` (less the overlap) to the
        rollout that owns it; returns the new cursor."""
        # A device's report belongs to the rollout that holds that device for that bundle:
        # an active one first, then the newest (two rollouts may share a bundle).
        owners: dict[tuple[str, str], str] = {}
        for rid, (r, _) in sorted(
            work.rollouts.items(),
            key=lambda kv: (kv[1][0].state in ("running", "paused"), kv[1][0].created_ns),
        ):
            for device in r.devices:
                owners[(r.bundle_id, device)] = rid
        # Rows are stamped on arrival and committed in batches (several workers, retries):
        # a row may land below the cursor. Re-reading a trailing window catches it; the
        # machine ignores what it applied already ((boot_id, seq) order). The window is
        # read to its end, page by page, so no number of rows in it can hold the cursor.
        since = cursor - int(CURSOR_OVERLAP_S * 1e9)
        for received, body in self._statuses(since):
            cursor = max(cursor, received)
            try:
                msg = decode("ota/status", body)
            except WireError:
                self.ignored += 1
                continue
            if not isinstance(msg, OtaStatusMsg):
                continue
            owner = owners.get((msg.bundle_id, msg.device))
            if owner is not None:
                self._apply_status(work, owner, msg, received, now)
        return cursor

    def _apply_status(
        self, work: _Step, owner: str, msg: OtaStatusMsg, received: int, now: int
    ) -> None:
        r, transport = work.rollouts[owner]
        try:
            nxt = m.on_status(
                r,
                device=msg.device,
                boot_id=msg.boot_id,
                seq=msg.seq,
                bundle_id=msg.bundle_id,
                state=msg.state,
                reason=msg.reason,
                detail=dict(msg.detail),
                t_ns=msg.t_ns,
                received_ns=received,
                now_ns=now,
            )
        except (ValueError, TypeError, ArithmeticError) as exc:
            # A device's odd report is that report's problem, not the service's.
            self.ignored += 1
            log.warning("rollout %s: report from %s ignored: %s", owner, msg.device, exc)
            return
        if nxt != r:
            work.rollouts[owner] = (nxt, transport)
            work.changed.add(owner)

    def _statuses(self, since: int) -> Iterator[tuple[int, bytes]]:
        """Every stored ``ota/status`` after ``since``, read in pages of :data:`STATUS_PAGE`
        (keyset on ``(received_ns, body)``) until a page is short: a replay after a restart
        holds one page in memory, not the whole backlog."""
        page = self.store.ota_status_since(since, limit=STATUS_PAGE)
        while True:
            yield from page
            if len(page) < STATUS_PAGE:
                return
            last, body = page[-1]
            page = self.store.ota_status_since(last, limit=STATUS_PAGE, after=body)

    def _publish(self, commands: list[tuple[m.Rollout, str, m.Command]]) -> list[tuple[str, str]]:
        """Send ``commands`` (and what an earlier step could not); the ``(rollout, device)``
        of the offers handed to the broker."""
        sent: list[tuple[str, str]] = []
        unsent, self._unsent = self._unsent, []
        for rid, c, topic_name, payload in unsent:
            if self.publish(topic_name, payload):
                self.sent[c.action] += 1
                if c.action == "offer":
                    sent.append((rid, c.device))
            else:
                self._unsent.append((rid, c, topic_name, payload))
        for r, transport, c in commands:
            if self._send(r, transport, c):
                sent.append((r.id, c.device))
        return sent

    def _send(self, r: m.Rollout, transport: str, c: m.Command) -> bool:
        """Publish ``c``; whether it was an offer handed to the broker."""
        site = self._site(c.device)
        if site is None:
            log.warning("rollout %s: device %s is not in the registry", r.id, c.device)
            return False
        if c.action == "offer":
            url = self.url_for(r.sha256, transport)
            cmd = OtaCommand(
                action="install", bundle_id=r.bundle_id, url=url, length=r.length, rollout=r.id
            )
        else:
            kind = r.kind if r.kind in ("model", "config", "agent") else None
            cmd = OtaCommand(
                action="rollback",
                bundle_id=r.bundle_id,
                kind=kind,  # type: ignore[arg-type]
                rollout=r.id,
            )
        payload = encode_command(cmd)
        if self.publish(topic(site, c.device, "cmd/ota"), payload):
            self.sent[c.action] += 1
            return c.action == "offer"
        # Not connected: sent again at the next step (or, after a restart, once held).
        self._unsent.append((r.id, c, topic(site, c.device, "cmd/ota"), payload))
        return False


__all__ = ["Orchestrator", "create_rollout", "read_bundle", "request"]
