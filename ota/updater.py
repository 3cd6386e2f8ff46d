"""The updater: drives one update at a time through the state machine, with I/O.

It owns the journal (``ota_dir/journal.json``), the content store (``ota_dir/store``) and
the trust root (``ota_dir/root.json``, provisioned). Everything about *what* may happen is
in :mod:`ota.machine` and :mod:`ota.probation`; this module fetches, verifies (in a
thread), persists each transition *before* acting on it, and asks an :class:`Activator`
(the agent) to switch versions. ``on_transition`` is called after each persisted step:
the agent publishes it on ``.../ota/status``; crash tests kill the process there.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from ota import journal as _journal
from ota.errors import (
    ActivationError,
    FetchError,
    FloorsUnknown,
    MalformedBundle,
    OtaError,
    StorageError,
    TrustError,
)
from ota.fetch import redact_url
from ota.fsutil import atomic_write
from ota.machine import Event, Installed, Journal, Update, recover, step
from ota.manifest import Probation
from ota.probation import Baseline, Observation, judge
from ota.store import ContentStore
from ota.trust import TrustRoot, load_root, rotate
from ota.verify import Policy, VerifiedBundle, verify_bundle

log = logging.getLogger(__name__)


class Activator(Protocol):
    """What the agent does for the updater. Methods run on the event loop."""

    async def activate(self, target: Installed, store: ContentStore) -> bool:
        """Make ``target`` live. True when it is live now; False when it goes live only
        after a restart (an agent build). Raises :class:`ActivationError`."""
        ...

    async def restore(self, installed: Installed | None, store: ContentStore) -> bool:
        """Make ``installed`` (None: the factory version of that kind) live again.
        True when done now; False when a restart is needed to finish."""
        ...

    async def commit(self, target: Installed) -> None:
        """The probation passed: make ``target`` permanent where the activator keeps its own
        state (an agent build's slot becomes ``good``)."""
        ...

    def baseline(self) -> Baseline: ...

    async def settled(self) -> None:
        """Return once the agent runs as it will from now on (an agent that has just
        restarted into a new build is still starting up)."""
        ...

    def begin_observing(self) -> None: ...

    def observe(self) -> Observation: ...

    async def health(self) -> bool: ...


Report = Callable[[Journal, str, dict[str, Any]], None]


@dataclass(frozen=True)
class Outcome:
    result: str  # committed | rolled_back | failed | busy | restart
    reason: str
    code: str = ""


class Updater:
    def __init__(
        self,
        ota_dir: Path,
        *,
        policy: Policy,
        activator: Activator,
        on_transition: Report | None = None,
        clock: Callable[[], int] = time.time_ns,
        probation_poll_s: float = 0.05,
        health_every_s: float = 0.5,
        fetch: Callable[..., Awaitable[Path]] | None = None,
    ) -> None:
        self.dir = ota_dir
        self.policy = policy
        self.activator = activator
        self.on_transition = on_transition
        self.clock = clock
        self.poll_s = probation_poll_s
        self.health_every_s = health_every_s
        self._fetch = fetch
        self.store = ContentStore(ota_dir / "store")
        self.journal_path = ota_dir / "journal.json"
        self.root_path = ota_dir / "root.json"
        self.journal = Journal()
        self.warning = ""
        #: non-empty: the anti-rollback floors are unknown (:func:`ota.journal.load_state`);
        #: every install is refused with this and nothing is persisted until an operator acts
        self.refused = ""
        self._lock = asyncio.Lock()
        self._abort = asyncio.Event()
        self.last_probation: dict[str, Any] = {}
        self.last_rollback_ms: float | None = None
        self._failed_at: float | None = None

    # -- state ------------------------------------------------------------------------------

    def load(self) -> Journal:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        self.store.ensure()
        got = _journal.load_state(self.journal_path)
        self.journal, self.warning, self.refused = got.journal, got.warning, got.refused
        return self.journal

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.clock() / 1e9, tz=UTC)

    def trust_root(self) -> TrustRoot | None:
        """The provisioned root, or None (then every bundle is refused)."""
        try:
            data = self.root_path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TrustError(f"{self.root_path}: unreadable: {exc}") from None
        return load_root(data, self.now())

    def install_root(self, data: bytes) -> TrustRoot:
        """Replace the trust root by ``data`` if the TUF rule accepts it (or set the first)."""
        old = self.trust_root()
        new = load_root(data, self.now()) if old is None else rotate(old, data, self.now())
        atomic_write(self.root_path, data, mode=0o644)
        return new

    def _go(
        self,
        event: Event,
        *,
        update: Update | None = None,
        target: Installed | None = None,
        reason: str = "",
        detail: dict[str, Any] | None = None,
    ) -> Journal:
        nxt = step(self.journal, event, self.clock(), update=update, target=target, reason=reason)
        if not self.refused:
            if nxt.floors != self.journal.floors:
                # Before the journal that raises them, so the floors file is never behind a
                # committed journal. Failing to write it loses nothing yet: the journal still
                # has them, and the next load writes the file again.
                try:
                    _journal.save_floors(_journal.floors_path(self.journal_path), nxt.floors)
                except StorageError as exc:
                    log.error("ota: %s", exc)
            _journal.save(self.journal_path, nxt)
        # else: the floors are unknown and the only transitions are an offer and its refusal;
        # writing them would replace the damaged journal the operator has to look at (and a
        # readable journal with no floors would pass for "no floors" at the next start).
        prev, self.journal = self.journal, nxt
        info = dict(detail or {})
        info.setdefault("event", event)
        log.info(
            "ota: %s -> %s (%s)%s",
            prev.state,
            nxt.state,
            event,
            f": {reason}" if reason else "",
        )
        if self.on_transition is not None:
            self.on_transition(nxt, reason, info)
        return nxt

    def status(self) -> dict[str, Any]:
        return {
            **describe(self.journal),
            "trust_root": self.root_path.is_file(),
            "warning": self.warning,
            "probation": dict(self.last_probation),
        }

    # -- start ------------------------------------------------------------------------------

    async def recover(self, *, running_agent_version: str | None = None) -> Outcome | None:
        """Finish or undo what a crash interrupted (see :func:`ota.machine.recover`)."""
        action, why = recover(self.journal, running_agent_version=running_agent_version)
        if action == "none":
            return None
        log.warning("ota: recovering from %s: %s", self.journal.state, why or action)
        if action == "drop":
            self._go("rejected", reason=why, detail={"code": "interrupted"})
            return Outcome("failed", why, "interrupted")
        if action == "finish_commit":
            up = self.journal.update
            if up is not None and up.target is not None:
                await self.activator.commit(up.target)
            self._go("committed", reason="commit finished after a restart")
            return Outcome("committed", "commit finished after a restart")
        if action == "continue_probation":
            return await self._guarded(self._probation(self._limits()))
        # rollback / finish_rollback
        if self.journal.state == "activating":
            self._go("activation_failed", reason=why)
        elif self.journal.state in ("probation", "committing"):
            # committing: an agent build whose commit was interrupted, and the launcher has
            # gone back to the previous slot since; the new build is not what runs.
            self._go("failed", reason=why)
        return await self._rollback(why)

    def _limits(self) -> Probation:
        up = self.journal.update
        if up is not None and up.probation:
            known = {f for f in Probation.__struct_fields__}
            return Probation(**{k: v for k, v in up.probation.items() if k in known})
        return Probation(seconds=up.probation_s) if up is not None else Probation()

    # -- updates ----------------------------------------------------------------------------

    async def install_file(self, path: Path, *, bundle_id: str = "") -> Outcome:
        """Verify, stage, activate and probe the bundle at ``path`` (a user's file: copied)."""
        if self._lock.locked():
            return Outcome("busy", f"an update is in progress ({self.journal.state})", "busy")
        async with self._lock:
            self._abort.clear()
            up = Update(bundle_id=bundle_id or path.name, source=str(path))
            self._go("install", update=up)
            return await self._guarded(self._verify_and_apply(path, keep_source=True))

    async def install_url(
        self, url: str, *, length: int, bundle_id: str, incoming_name: str = ""
    ) -> Outcome:
        """Fetch (resumable) from ``url`` into ``incoming/``, then as :meth:`install_file`.

        The download is named by the URL and length (:func:`download_name`; ``incoming_name``
        overrides), so only a re-offer of the same file resumes its ``.part``. An offer
        longer than the policy's ``max_bundle_bytes`` is refused before a byte is fetched.
        The journal and the status reports carry the URL without credentials or query.
        """
        if self._lock.locked():
            same = self.journal.update is not None and self.journal.update.bundle_id == bundle_id
            why = "the same offer is in progress" if same else "another update is in progress"
            return Outcome("busy", why, "busy")
        async with self._lock:
            self._abort.clear()
            self._go("offer", update=Update(bundle_id=bundle_id, source=redact_url(url)))
            name = incoming_name or download_name(url, length)
            return await self._guarded(self._fetch_and_apply(url, length, name))

    async def _fetch_and_apply(self, url: str, length: int, incoming_name: str) -> Outcome:
        dest = self.store.incoming / incoming_name
        part = dest.with_name(dest.name + ".part")
        try:
            if self.refused:  # before a byte is fetched: it could not be installed
                raise FloorsUnknown(self.refused)
            if length > self.policy.max_bundle_bytes:
                raise MalformedBundle(
                    f"{redact_url(url)}: the offer declares {length} bytes; this device's limit "
                    f"is {self.policy.max_bundle_bytes} (nothing fetched)"
                )
            if self._fetch is None:
                raise FetchError("no bundle transport configured on this device")
            await self._fetch(url, dest, length=length)
        except OtaError as exc:
            if exc.permanent:  # a .part that cannot complete is only a waste of flash
                part.unlink(missing_ok=True)
            detail = {"code": exc.code, "permanent": exc.permanent}
            self._go("rejected", reason=str(exc), detail=detail)
            return Outcome("failed", str(exc), exc.code)
        self._go("fetched", detail={"bytes": length})
        outcome = await self._verify_and_apply(dest, keep_source=False)
        if outcome.result == "failed":
            # Refused (or not staged): the fetched file must not be found again, neither by
            # a resume nor by anything else; a re-offer downloads it afresh. (Once staged,
            # it was renamed into the store: nothing is left here.)
            dest.unlink(missing_ok=True)
            part.unlink(missing_ok=True)
        return outcome

    async def _guarded(self, work: Awaitable[Outcome]) -> Outcome:
        """Run one update; an error that is not an OtaError (a disk that cannot be read, a
        bug) must not leave the journal mid-update with nobody to finish it."""
        try:
            return await work
        except asyncio.CancelledError:
            raise
        # The journal must end in a state (see above): any exception, logged with its trace.
        except Exception as exc:
            log.exception("ota: update failed unexpectedly in %s", self.journal.state)
            why = f"internal error while {self.journal.state}: {type(exc).__name__}: {exc}"
            state = self.journal.state
            if state in ("fetching", "verifying", "staged"):
                self._go("rejected", reason=why, detail={"code": "internal", "permanent": False})
                return Outcome("failed", why, "internal")
            if state == "activating":
                self._go("activation_failed", reason=why)
            elif state == "probation":
                self._go("failed", reason=why)
            if self.journal.state == "rolling_back":
                return await self._rollback(why)
            return Outcome("failed", why, "internal")

    async def _verify_and_apply(self, path: Path, *, keep_source: bool) -> Outcome:
        try:
            if self.refused:
                raise FloorsUnknown(self.refused)
            vb = await asyncio.to_thread(
                verify_bundle,
                path,
                root=self.trust_root(),
                policy=self.policy,
                floors=self.journal.floors,
                now=self.now(),
                store=self.store,
                keep_source=keep_source,
            )
        except OtaError as exc:
            detail = {"code": exc.code, "permanent": exc.permanent}
            self._go("rejected", reason=str(exc), detail=detail)
            return Outcome("failed", str(exc), exc.code)
        except OSError as exc:  # the device's disk, not the bundle: worth another offer
            why = f"staging failed: {exc}"
            self._go("rejected", reason=why, detail={"code": "storage", "permanent": False})
            return Outcome("failed", why, "storage")
        target = _installed(vb)
        limits = vb.signed.probation
        assert self.journal.update is not None  # set by offer/install, under the lock
        up = replace(
            self.journal.update,
            probation_s=limits.seconds,
            probation={f: getattr(limits, f) for f in Probation.__struct_fields__},
        )
        self._go("verified", update=up, target=target, detail={"code": "verified"})
        return await self._activate(target, limits)

    async def _activate(self, target: Installed, limits: Probation) -> Outcome:
        baseline = self.activator.baseline()
        assert self.journal.update is not None
        up = replace(
            self.journal.update,
            baseline_p50_us=baseline.p50_us,
            baseline_p99_us=baseline.p99_us,
            baseline_rss=baseline.rss_bytes,
        )
        self._go("activate", update=up, detail={"version": target.version})
        try:
            live = await self.activator.activate(target, self.store)
        except OtaError as exc:
            self._go("activation_failed", reason=str(exc), detail={"code": exc.code})
            out = await self._rollback(str(exc))
            # The outcome keeps why activation failed (e.g. self_test, its own code).
            return replace(out, code=exc.code) if out.result == "rolled_back" else out
        if not live:
            self._go("activated", detail={"restart": True})
            return Outcome("restart", f"{target.kind} {target.version} needs a restart")
        self._go("activated")
        return await self._probation(limits)

    async def _probation(self, limits: Probation) -> Outcome:
        up = self.journal.update
        base = Baseline(
            up.baseline_p50_us if up else None,
            up.baseline_rss if up else None,
            up.baseline_p99_us if up else None,
        )
        await self._settle(limits)
        self.activator.begin_observing()
        started = self.clock()
        health_ok = health_failed = streak = 0
        next_health = 0.0
        loop = asyncio.get_running_loop()
        verdict, why = "pending", ""
        while verdict == "pending":
            if self._abort.is_set():
                self._go("abort", reason="rollback requested during probation")
                return await self._rollback("rollback requested during probation")
            if loop.time() >= next_health:
                next_health = loop.time() + self.health_every_s
                try:
                    # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that lands as
                    # the check completes, and the probation would run on after a stop.
                    async with asyncio.timeout(self.health_every_s):
                        ok = await self.activator.health()
                except Exception:  # noqa: BLE001 - a health check that raises did not answer
                    ok = False
                health_ok += ok
                health_failed += not ok
                streak = 0 if ok else streak + 1
            obs = replace(
                self.activator.observe(),
                health_ok=health_ok,
                health_failed=health_failed,
                health_streak=streak,
            )
            verdict, why = judge(obs, base, limits, started_ns=started, now_ns=self.clock())
            figures = {
                "windows": obs.model_runs,
                "p50_us": obs.p50_us,
                "p99_us": obs.p99_us,
                "rss_bytes": obs.rss_bytes,
                "baseline_p50_us": base.p50_us,
                "baseline_p99_us": base.p99_us,
                "baseline_rss": base.rss_bytes,
            }
            self.last_probation = {"verdict": verdict, "reason": why, **figures}
            if verdict == "pending":
                await asyncio.sleep(self.poll_s)
        if verdict == "fail":
            self._failed_at = time.perf_counter()
            self._go("failed", reason=why, detail={"code": "probation_failed", **figures})
            return await self._rollback(why)
        # The fleet's regression check compares these with the device's own baseline.
        self._go("passed", reason=why, detail=figures)
        up = self.journal.update
        if up is not None and up.target is not None:
            await self.activator.commit(up.target)
        self._go("committed", reason=why, detail=figures)
        await asyncio.to_thread(self.store.gc, self.journal.payloads_in_use())
        return Outcome("committed", why)

    async def _settle(self, limits: Probation) -> None:
        """Wait, at most the probation's own length, for the agent to have settled: the
        probation judges the version as it runs, not the start-up of the process an agent
        build restarted into (its first windows share the CPU with loading the compiled
        kernels, and at a few windows a second that start-up is much of a short
        probation). A rollback asked for meanwhile ends the wait at once."""
        waits = [
            asyncio.ensure_future(self.activator.settled()),
            asyncio.ensure_future(self._abort.wait()),
        ]
        try:
            done, _ = await asyncio.wait(
                waits, timeout=max(1, limits.seconds), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waits:
                w.cancel()
        if not done:
            log.info(
                "ota: the agent is still starting up after %d s; probation starts", limits.seconds
            )

    async def _rollback(self, why: str) -> Outcome:
        up = self.journal.update
        back = up.replaced if up is not None else None
        if up is not None and up.target is None and up.kind:
            kept = self.journal.kept.get(up.kind, ())
            back = kept[0] if kept else None
        try:
            done = await self.activator.restore(back, self.store)
            if up is not None and up.fell_back and up.target is None:
                # A retried manual rollback (after a restart) that worked this time: the
                # kept version is what serves, not the earlier fallback.
                self.journal = replace(self.journal, update=replace(up, fell_back=False))
                _journal.save(self.journal_path, self.journal)
            if self._failed_at is not None:
                # From the failed check to the previous version serving (bench.ota).
                self.last_rollback_ms = (time.perf_counter() - self._failed_at) * 1000.0
                self._failed_at = None
        except OtaError as exc:
            # The rollback target cannot be brought back: try the factory version, else
            # keep what serves now. Either way the journal says what really runs, the
            # report says why, and nothing loops.
            why = f"{why}; rollback target unavailable: {exc}"
            done, live = await self._fallback(back)
            if up is not None:
                fell = replace(up, replaced=live, fell_back=True)
                self.journal = replace(self.journal, update=fell)
                _journal.save(self.journal_path, self.journal)
            log.error("ota: %s", why)
        self._go("rolled_back", reason=why)
        if not done:
            return Outcome("restart", why)
        return Outcome("rolled_back", why)

    async def _fallback(self, failed: Installed | None) -> tuple[bool, Installed | None]:
        """After the rollback target failed to come back: the factory version if that was
        not it, else the version serving now. Returns (done, what is live)."""
        up = self.journal.update
        if failed is not None:
            try:
                return await self.activator.restore(None, self.store), None
            except OtaError as exc:
                log.error("ota: the factory version does not come back either: %s", exc)
        if up is not None and up.target is not None:
            return True, up.target
        # A manual rollback (no target): what serves now is the journal's active version.
        return True, self.journal.active.get(up.kind) if up is not None else None

    async def rollback(self, kind: str, *, bundle_id: str = "") -> Outcome:
        """Abort a probation, or bring back the previous committed version of ``kind``.

        ``bundle_id`` (a fleet's rollback command) is what the status reports carry, so
        the rollout that asked sees the answer."""
        up = self.journal.update
        if self._lock.locked():
            if up is not None and bundle_id and up.bundle_id != bundle_id:
                why = f"rollback of {bundle_id} ignored: updating {up.bundle_id}"
                return Outcome("failed", why, "not_active")
            # The update in flight stops at its probation (or before it goes live) and
            # rolls back: a rollback that arrives while it downloads is not lost.
            self._abort.set()
            return Outcome("rolled_back", f"abort requested ({self.journal.state})")
        active = self.journal.active.get(kind)
        if bundle_id and (active is None or active.bundle_id != bundle_id):
            # A fleet's rollback of a bundle that is not the live one (a redelivery, or an
            # offer that was refused): rolling back again would remove the wrong version.
            why = f"{bundle_id} is not the live {kind}: nothing to roll back"
            return Outcome("failed", why, "not_active")
        if not self.journal.kept.get(kind) and active is None:
            return Outcome(
                "failed", f"nothing to roll back: the factory {kind} is already live", "none"
            )
        async with self._lock:
            up = Update(bundle_id=bundle_id, kind=kind)
            self._go("abort", update=up, reason="rollback requested")
            return await self._rollback(f"{kind} rollback requested")


def describe(j: Journal) -> dict[str, Any]:
    """The journal as people and ``--json`` read it."""
    return {
        "state": j.state,
        "update": j.update.to_json() if j.update else None,
        "active": {
            k: {"version": v.version, "counter": v.counter, "bundle_id": v.bundle_id}
            for k, v in j.active.items()
        },
        "floors": dict(j.floors),
        "kept": {k: [v.version for v in vs] for k, vs in j.kept.items()},
        "last": j.last.to_json() if j.last else None,
    }


def download_name(url: str, length: int) -> str:
    """The file an offer downloads to in ``incoming/``: a hash of its URL and length.

    A ``.part`` is resumed only by an offer with the same name, so two different files
    (a re-signed bundle under the same bundle_id, say) are never spliced together.
    """
    digest = hashlib.sha256(f"{length} {url}".encode()).hexdigest()
    return f"offer-{digest[:32]}.efb"


def _installed(vb: VerifiedBundle) -> Installed:
    s = vb.signed
    return Installed(
        bundle_id=s.bundle_id,
        kind=s.kind,
        version=s.version,
        counter=s.counter,
        manifest_sha256=vb.manifest_sha256,
        payloads=dict(vb.payloads),
    )


__all__ = ["ActivationError", "Activator", "Outcome", "Updater", "download_name"]
