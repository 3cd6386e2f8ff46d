"""OTA in the running agent: the ``[ota]`` section, the activator and the wiring.

The updater (:mod:`ota.updater`) decides; this module does what only the agent can: make a
model directory and swap it in, swap a config's rules, gather probation evidence (each:
:class:`AgentOta`). Offers arrive on ``.../cmd/ota`` (:class:`wire.OtaCommand`); every
transition goes out on ``.../ota/status`` through the outbox.

Design: ``docs/ARCHITECTURE.md``, "OTA on the device".
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from edge_agent import __version__
from edge_agent.acquisition import contract_check
from edge_agent.config import parse_config
from edge_agent.errors import AgentError, ConfigError, ReasoningError, SelfTestFailed
from edge_agent.ota_config import ota_dir
from edge_agent.probe import parse_probe
from edge_agent.warm import precompile_slot
from firmware.boot import ENV_SLOT, parse_slot_env
from firmware.errors import RollbackUnavailable
from firmware.slots import Slots
from models import selftest
from models.errors import ModelRejected
from models.runtime import LoadedModel, ModelManifest
from models.selftest import KnownAnswersFailed
from ota.errors import ActivationError, ModelSelfTestFailed, StorageError
from ota.machine import Installed, Journal, recover
from ota.probation import Baseline, Observation
from ota.store import ContentStore
from ota.updater import Outcome, Updater
from ota.verify import Policy
from wire import OtaStatusMsg, WireError, decode_command

if TYPE_CHECKING:
    from edge_agent.config import AgentConfig
    from edge_agent.perception import Window
    from edge_agent.probe import Probe, ProbeResult
    from edge_agent.reasoning import PreparedModel, ReasoningStage, Scorer
    from edge_agent.rules import Decision
    from edge_agent.uplink.publisher import Uplink

log = logging.getLogger(__name__)

#: Decisions remembered for a probation's P99 (20 s at 100 windows/s is 2000).
OBSERVED = 4096


#: The key of the model that came with the image in :attr:`AgentOta._retired`.
FACTORY = "factory"


def _model_dir_name(tflite_sha: str, meta_sha: str) -> str:
    """``<tflite sha[:16]>-<model.json sha[:16]>``: what :meth:`AgentOta._prune` parses."""
    return f"{tflite_sha[:16]}-{meta_sha[:16]}"


class AgentPort(Protocol):
    """What :class:`AgentOta` uses of the agent it updates (``edge_agent.service.Agent``
    implements it): its config (a config bundle replaces it), the serving stage and model,
    the latest window and a probe through every stage for probation, the uplink for status
    reports, and a restart for agent builds."""

    config: AgentConfig
    clock_ns: Callable[[], int]
    #: set once READY and the compiled kernels serve (what a probation waits for)
    settled: asyncio.Event

    @property
    def stage(self) -> ReasoningStage | None: ...
    @property
    def uplink(self) -> Uplink | None: ...
    @property
    def stage_errors(self) -> Mapping[str, int]: ...
    @property
    def signals(self) -> Sequence[str]: ...
    @property
    def api_port(self) -> int | None: ...
    def windows_per_s(self) -> float: ...
    def last_window(self) -> Window | None: ...
    def model_sha256(self) -> str: ...
    def rss_bytes(self) -> int | None: ...
    def probe(self, probe: Probe) -> ProbeResult: ...
    async def reload_model(self, model_dir: Path | None = None) -> Scorer: ...
    def request_restart(self, why: str) -> None: ...


class AgentOta:
    """The agent's side of OTA: an :class:`ota.updater.Activator` plus the wiring.

    What only the agent can do:

    - **model** bundles: the payloads are materialised as a model directory under
      ``state_dir/ota/models/<tflite sha>-<model.json sha>/`` (prefixes of both) and swapped
      in through :meth:`Agent.reload_model` (load and check in a thread, one assignment
      between two windows: no window missed); the replaced model stays in memory, so a
      rollback is one more swap, not a reload;
    - **config** bundles: the new ``agent.toml`` is validated as a whole; its ``[reasoning]``
      rules and thresholds are swapped in between two windows (re-preparing the serving model
      with the new rules). A config that changes anything else (sources, perception, ...)
      is refused at activation: those need a restart, which a config bundle does not do yet;
    - probation evidence: decisions scored by the new version, the reasoning stage's latency
      (µs, from each Decision), inference errors, resident memory, and the health API asked
      over HTTP (in-process when the API is off).
    """

    def __init__(
        self, config: AgentConfig, *, windows_per_s: float, clock_ns: Callable[[], int]
    ) -> None:
        self._agent: AgentPort | None = None
        section = config.ota
        self.section = section
        self.dir = ota_dir(config.state_dir)
        cfg = config
        self.updater = Updater(
            self.dir,
            policy=Policy(
                device_type=cfg.agent.device_type,
                agent_version=__version__,
                permissions=frozenset(section.permissions),
                max_bundle_bytes=section.max_bundle_mb * 1024 * 1024,
                windows_per_s=windows_per_s,
                model_check=self._model_check,
            ),
            activator=self,
            on_transition=self._on_transition,
            clock=clock_ns,
            fetch=self._fetch,
        )
        self.updater.load()
        self._provision_root()
        self._observing = False
        self._target_sha = ""
        self._latencies: deque[float] = deque(maxlen=OBSERVED)
        self._runs = 0
        self._windows = 0
        self._degraded = 0
        self._was_degraded = False
        self._errors0 = 0
        #: Models replaced by a swap, by :func:`_model_dir_name` of both payloads (or
        #: ``"factory"``): a rollback swaps back without reloading. The tflite sha alone
        #: is not enough: a bundle may change only ``model.json`` (thresholds, labels).
        self._retired: dict[str, Scorer] = {}
        #: The key of the model serving now (set by the agent when it starts on an OTA one).
        self.serving_model = FACTORY
        self._pending: list[tuple[Journal, str, dict[str, Any]]] = []
        self._task: asyncio.Task[Outcome | None] | None = None
        #: The bundle ``_task`` installs ("" for a probation resumed at start).
        self._task_bundle = ""
        self._background: set[asyncio.Task[Outcome]] = set()
        self.transitions = 0
        #: The sha of the model that came with the image, once known (see Agent).
        self.factory_sha = ""
        #: The config file as the agent started with it: what a config rollback returns to.
        self._factory_config = config

    def attach(self, agent: AgentPort) -> None:
        """The agent this OTA updates, once it is built (before :meth:`start`)."""
        self._agent = agent

    @property
    def agent(self) -> AgentPort:
        if self._agent is None:
            raise RuntimeError("AgentOta is not attached to an agent yet")
        return self._agent

    def _model_check(self, manifest: bytes) -> str:
        """Why an offered model must not be staged here ("" if it may): its input contract
        against this device's config (``edge_agent.acquisition``). Runs in the verifier's
        thread, on the bundle's verified ``model.json``."""
        config = self.agent.config
        if not config.reasoning.enabled:
            return ""
        try:
            doc = json.loads(manifest)
            parsed = ModelManifest.from_json(doc, source="model.json")
        except (ValueError, ModelRejected) as exc:
            return f"model.json is not a model manifest this agent reads: {exc}"
        report = contract_check(config)(parsed)
        if report.refused:
            return (
                "the model was trained for another acquisition than this device's config "
                f"delivers: {report.brief()} (edge-agent check-config shows each finding)"
            )
        return ""

    # -- start ------------------------------------------------------------------------------

    def _provision_root(self) -> None:
        src = self.section.trust_root
        if src is None or self.updater.root_path.exists():
            return
        path = Path(src)
        if not path.is_absolute():
            path = self.agent.config.path.parent / path
        try:
            self.updater.install_root(path.read_bytes())
            log.info("ota: trust root provisioned from %s", path)
        except (OSError, AgentError) as exc:
            log.error("ota: cannot provision the trust root from %s: %s", path, exc)
        except Exception as exc:  # noqa: BLE001 - a bad root must not stop the agent
            log.error("ota: trust root %s refused: %s (every bundle will be refused)", path, exc)

    def model_dir_at_start(self) -> Path | None:
        """The OTA model the journal says is live, materialised, or None (factory)."""
        inst = self.updater.journal.active.get("model")
        if inst is None:
            return None
        try:
            return self._materialise_model(inst, self.updater.store)
        except StorageError as exc:
            log.error(
                "ota: active model %s unavailable (%s); the factory model runs", inst.version, exc
            )
            return None

    async def start(self) -> None:
        """Finish or undo an update a crash interrupted (before any window is scored).

        The probation of a new agent build continues in the background: it needs the
        pipeline running to see windows scored.
        """
        if self.updater.warning:
            self._pending.append((self.updater.journal, self.updater.warning, {"code": "journal"}))
        running = parse_slot_env(os.environ.get(ENV_SLOT))[1] or __version__
        action, _ = recover(self.updater.journal, running_agent_version=running)
        if action == "continue_probation":
            coro = self.updater.recover(running_agent_version=running)
            self._task = asyncio.get_running_loop().create_task(coro, name="ota:probation")
            up = self.updater.journal.update
            self._task_bundle = up.bundle_id if up is not None else ""
            self._task.add_done_callback(functools.partial(self._finished, self._task_bundle))
        else:
            outcome = await self.updater.recover(running_agent_version=running)
            if outcome is not None:
                log.warning("ota: recovery: %s (%s)", outcome.result, outcome.reason)
        inst = self.updater.journal.active.get("config")
        if inst is not None:
            try:
                await self._swap_config(await self._bundle_config(inst, self.updater.store))
            except (ActivationError, StorageError) as exc:
                log.error("ota: the active config bundle %s does not apply: %s", inst.version, exc)

    # -- Activator ---------------------------------------------------------------------------

    def _materialise_model(self, inst: Installed, store: ContentStore) -> Path:
        """The model directory of ``inst`` under ``ota/models``, written if not there yet.

        The directory is named by both payloads' shas: a bundle that changes only
        ``model.json`` (thresholds, labels) gets its own directory, never the old
        manifest. ``manifest.json`` is written last, so its presence means complete.
        """
        tflite = inst.payloads["model.tflite"]
        meta = inst.payloads["model.json"]
        where = self.dir / "models" / _model_dir_name(tflite, meta)
        manifest = where / "manifest.json"
        if manifest.is_file():
            return where
        where.mkdir(parents=True, exist_ok=True, mode=0o750)
        doc = json.loads(store.read(meta, max_bytes=1 << 20))
        name = Path(str(doc.get("file", "model.tflite"))).name
        store.copy_to(tflite, where / name)
        store.copy_to(meta, manifest)
        return where

    async def activate(self, target: Installed, store: ContentStore) -> bool:
        if target.kind == "model":
            where = await asyncio.to_thread(self._materialise_model, target, store)
            try:
                old = await self.agent.reload_model(where)
            except SelfTestFailed as exc:
                raise ModelSelfTestFailed(str(exc)) from None
            except ReasoningError as exc:
                raise ActivationError(str(exc)) from None
            self._retired[self.serving_model] = old
            self.serving_model = where.name
            self._target_sha = target.payloads["model.tflite"]
            return True
        if target.kind == "config":
            await self._swap_config(await self._bundle_config(target, store))
            self._target_sha = self.agent.model_sha256()
            return True
        if target.kind == "agent":
            await asyncio.to_thread(self._install_agent, target, store)
            # The new build runs after a restart; its probation continues there.
            self.agent.request_restart(f"agent {target.version} installed")
            return False
        raise ActivationError(f"unknown bundle kind {target.kind!r}")

    # -- agent builds: A/B slots ------------------------------------------------------------

    def slots(self) -> Slots:
        cfg = self.agent.config
        return Slots(self.section.resolve_slots(cfg.state_dir, cfg.path.parent))

    def _install_agent(self, target: Installed, store: ContentStore) -> None:
        wheel = next(n for n in target.payloads if n.endswith(".whl"))
        sha = target.payloads[wheel]
        tmp = self.dir / "incoming" / wheel
        store.copy_to(sha, tmp)
        try:
            slots = self.slots()
            slot = slots.install_wheel(tmp, version=target.version, sha256=sha)
            if self.agent.config.reasoning.jit is not False:
                why = precompile_slot(slots.slot_dir(slot))
                if why:
                    log.warning(
                        "ota: agent %s: kernels not compiled at install (%s); it compiles "
                        "them at its start if it can",
                        target.version,
                        why,
                    )
            slots.activate(slot)
        finally:
            tmp.unlink(missing_ok=True)

    async def commit(self, target: Installed) -> None:
        if target.kind == "agent":
            # The version: never vouch for whatever build the launcher went back to.
            await asyncio.to_thread(self.slots().mark_good, target.version)

    async def restore(self, installed: Installed | None, store: ContentStore) -> bool:
        up = self.updater.journal.update
        kind = installed.kind if installed is not None else (up.kind if up else "model")
        if kind == "agent":
            want = await asyncio.to_thread(self._restore_agent, installed, up.reason if up else "")
            if want is None:
                return True
            # On the loop: the restart is a timer on it (a worker thread has no loop).
            self.agent.request_restart(f"rolling back to {want}")
            return False
        if kind == "config":
            if installed is None:
                await self._swap_config(self._factory_config)
            else:
                await self._swap_config(await self._bundle_config(installed, store))
            return True
        stage = self.agent.stage
        if stage is None:
            return True
        want = (
            _model_dir_name(installed.payloads["model.tflite"], installed.payloads["model.json"])
            if installed is not None
            else FACTORY
        )
        old = self._retired.get(want)
        if old is not None:
            # Its known answers again before it serves again (the self-test runs wherever
            # a model is brought in; a retired model keeps its interpreter).
            try:
                prepared = await asyncio.to_thread(_retest_and_prepare, stage, old)
            except SelfTestFailed as exc:
                raise ActivationError(f"cannot bring back the previous model: {exc}") from None
            replaced = stage.swap(prepared)
            self._retired[self.serving_model] = replaced
            self.serving_model = want
            return True
        where = (
            await asyncio.to_thread(self._materialise_model, installed, store)
            if installed is not None
            else self._factory_config.reasoning.model_dir
        )
        try:
            await self.agent.reload_model(where)
        except ReasoningError as exc:
            raise ActivationError(f"cannot bring back the previous model: {exc}") from None
        self.serving_model = want
        return True

    def _restore_agent(self, installed: Installed | None, reason: str) -> str | None:
        """Point the slots back at ``installed`` (None: the base install). None when that
        is already what runs (the launcher fell back by itself), else the version (or
        ``base``) a restart must bring up. Runs in a thread: file work only."""
        slots = self.slots()
        running = os.environ.get(ENV_SLOT, "base")
        want = "base" if installed is None else installed.version
        if running.partition(":")[2] == want or (want == "base" and running == "base"):
            return None
        why = reason or "probation failed"
        if installed is None:
            slots.fall_back_to_base(why)
        else:
            try:
                slots.rollback(why)
            except RollbackUnavailable as exc:
                raise ActivationError(str(exc)) from None
        return want

    async def _bundle_config(self, inst: Installed, store: ContentStore) -> AgentConfig:
        data = await asyncio.to_thread(store.read, inst.payloads["agent.toml"], max_bytes=1 << 20)
        base = self._factory_config.path.parent

        def parse() -> AgentConfig:
            text = data.decode("utf-8")
            return parse_config(text, source=f"config bundle {inst.version}", base_dir=base)

        try:
            return await asyncio.to_thread(parse)
        except (ConfigError, UnicodeDecodeError) as exc:
            raise ActivationError(str(exc)) from None

    async def _swap_config(self, new: AgentConfig) -> None:
        """Apply ``new``'s [reasoning] rules and thresholds between two windows.

        Anything else that differs needs a restart, which a config bundle does not do: such
        a bundle is refused at activation (and so rolled back), with the sections named.
        """
        cur = self.agent.config
        changed = [
            name
            for name in ("perception", "sources", "memory", "schedule", "api", "uplink", "ota")
            if getattr(new, name) != getattr(cur, name)
        ]
        if (cur.agent.device, cur.agent.site, cur.agent.device_type, cur.state_dir) != (
            new.agent.device,
            new.agent.site,
            new.agent.device_type,
            new.state_dir,
        ):
            changed.insert(0, "agent")
        cr, nr = cur.reasoning, new.reasoning
        for key in ("enabled", "backend", "threads", "breaker", "budget_ms", "acquisition"):
            if getattr(cr, key) != getattr(nr, key):
                changed.append(f"reasoning.{key}")
        if changed:
            raise ActivationError(
                f"config bundle changes {', '.join(changed)}, which need a restart; only "
                "[reasoning] rules and thresholds are applied live"
            )
        stage = self.agent.stage
        if stage is None:
            raise ActivationError("config bundle: reasoning is disabled on this device")
        old_rules = stage.rules
        stage.rules = nr.rules
        try:
            # The serving model, new rules: compiled only, the model is not run (prepare()
            # would run it from this thread on the buffers the loop's windows use).
            prepared = stage.prepare_rules(nr.rules)
        except AgentError as exc:
            stage.rules = old_rules
            raise ActivationError(f"config bundle: rules do not fit the model: {exc}") from None
        stage.swap(prepared)
        # The model stays the one OTA (or the image) put there, whatever model_dir says.
        self.agent.config = replace(cur, reasoning=replace(nr, model_dir=cr.model_dir))

    def baseline(self) -> Baseline:
        stage = self.agent.stage
        lat = list(stage.stats.reasoning_us)[-1000:] if stage is not None else []
        return Baseline(_quantile(lat, 0.5), self.agent.rss_bytes(), _quantile(lat, 0.99))

    async def settled(self) -> None:
        await self.agent.settled.wait()

    def begin_observing(self) -> None:
        self._latencies.clear()
        self._runs = self._windows = self._degraded = 0
        # A breaker already degraded before the update is not the new version's doing.
        self._was_degraded = self._breaker_degraded()
        self._errors0 = self.agent.stage_errors.get("reasoning", 0)
        if not self._target_sha:
            self._target_sha = self.agent.model_sha256()
        self._observing = True

    def on_decision(self, d: Decision) -> None:
        if not self._observing:
            return
        self._windows += 1
        if d.degraded and not d.model_ran and not self._was_degraded:
            self._degraded += 1
        if d.model_ran and d.model_sha256 == self._target_sha:
            self._runs += 1
            self._latencies.append(d.stage_latency_ms.get("reasoning", 0.0) * 1000.0)

    def _breaker_degraded(self) -> bool:
        stage = self.agent.stage
        return stage is not None and stage.breaker.mode != "full"

    def observe(self) -> Observation:
        errors = self.agent.stage_errors.get("reasoning", 0) - self._errors0
        return Observation(
            windows=self._windows,
            model_runs=self._runs,
            errors=errors,
            p50_us=_quantile(list(self._latencies), 0.5),
            p99_us=_quantile(list(self._latencies), 0.99),
            rss_bytes=self.agent.rss_bytes(),
            health_ok=0,
            health_failed=0,
            last_error="reasoning stage raised" if errors else "",
            degraded=self._degraded,
        )

    async def health(self) -> bool:
        """The health API answers a probe through every stage (in-process when it is off)."""
        last = self.agent.last_window()
        if last is None:
            return False
        row = {s: float(v) for s, v in zip(last.signals, last.values[-1], strict=True)}
        body = {"sensor_id": "ota-probation", "timestamp_ns": time.time_ns(), "payload": row}
        if not self.agent.config.api.enabled:
            try:
                self.agent.probe(parse_probe(json.dumps(body).encode(), self.agent.signals))
            except Exception:  # noqa: BLE001 - any failure of the probe is "not healthy"
                return False
            return True
        try:
            port = self.agent.api_port
        except RuntimeError:  # configured but not listening: silent
            return False
        if port is None:
            return False
        return await _post_health(self.agent.config.api.host, port, body)

    # -- fetch, commands, reporting ----------------------------------------------------------

    async def _fetch(self, url: str, dest: Path, *, length: int) -> Path:
        from ota.fetch import fetch  # noqa: PLC0415 - aiohttp/aiocoap only when fetching

        return await fetch(url, dest, length=length, stall_timeout_s=self.section.stall_timeout_s)

    def _on_transition(self, j: Journal, reason: str, detail: dict[str, Any]) -> None:
        self.transitions += 1
        if j.state != "probation":
            self._observing = False
        if j.state == "idle":
            self._target_sha = ""
            self._prune(j)
            if self.agent.uplink is not None and j.last is not None:
                self.agent.uplink.announce()
        self._pending.append((j, reason, detail))
        self.flush_reports()

    def _prune(self, j: Journal) -> None:
        """Forget models nothing can come back to: only the live, the kept and the factory
        ones stay in memory and under ``ota/models``."""
        keep = j.payloads_in_use() | {self.factory_sha, self.agent.model_sha256()}
        prefixes = {s[:16] for s in keep}
        for key in list(self._retired):
            if key != FACTORY and not set(key.split("-")) <= prefixes:
                del self._retired[key]
        models = self.dir / "models"
        if models.is_dir():
            for d in models.iterdir():
                if d.is_dir() and not set(d.name.split("-")) <= prefixes:
                    shutil.rmtree(d, ignore_errors=True)

    def flush_reports(self) -> None:
        uplink = self.agent.uplink
        if uplink is None:
            self._pending.clear()
            return
        device = self.agent.config.agent.device
        pending, self._pending = self._pending, []
        for j, reason, detail in pending:
            up = j.update
            last = j.last
            bundle_id = up.bundle_id if up else (last.bundle_id if last else "")
            version = up.version if up else (last.version if last else "")
            kind = (up.kind if up else "") or None
            state = j.state if j.state != "idle" or last is None else last.result
            safe = {
                k: round(v, 1) if isinstance(v, float) else v
                for k, v in detail.items()
                if isinstance(v, str | int | float | bool)
            }

            build = _status_builder(
                device=device,
                bundle_id=bundle_id,
                state=state,
                kind=kind,
                version=version,
                reason=reason,
                detail=safe,
            )
            uplink.publish("ota/status", build)

    def on_command(self, name: str, payload: bytes) -> None:
        """``cmd/ota``: an offer or a rollback; runs in the background, one at a time."""
        try:
            cmd = decode_command(payload)
        except WireError as exc:
            log.warning("ota: command refused: %s", exc)
            return
        if self._task is not None and not self._task.done():
            if cmd.action == "install" and cmd.bundle_id == self._task_bundle:
                # The same offer again (a new rollout leader sending what the one before
                # may have sent): the update it asks for is the one running.
                log.info("ota: offer %s is in progress already", cmd.bundle_id)
                return
            if cmd.action == "install":
                self._report_busy(cmd.bundle_id, "another update is in progress")
                return
            if cmd.action == "rollback":
                coro = self.updater.rollback(cmd.kind or "model", bundle_id=cmd.bundle_id)
                task = asyncio.get_running_loop().create_task(coro, name="ota:rollback")
                # Kept until done: a task nobody holds may be collected mid-flight.
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            else:
                log.info("ota: offer %s ignored: an update is in progress", cmd.bundle_id)
            return
        if cmd.action == "rollback" or cmd.url is None:
            coro = self.updater.rollback(cmd.kind or "model", bundle_id=cmd.bundle_id)
        else:
            # The download is named by its URL (see Updater.install_url), not bundle_id:
            # a re-signed bundle under the same id never resumes the other's .part.
            coro = self.updater.install_url(cmd.url, length=cmd.length, bundle_id=cmd.bundle_id)
        task = asyncio.get_running_loop().create_task(coro, name=f"ota:{cmd.bundle_id}")
        task.add_done_callback(functools.partial(self._finished, cmd.bundle_id))
        self._task = task
        self._task_bundle = cmd.bundle_id

    def _finished(self, bundle_id: str, task: asyncio.Task[Outcome | None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("ota: update of %s failed: %r", bundle_id, exc, exc_info=exc)
            return
        outcome = task.result()
        if outcome is not None and outcome.result == "busy":
            # Nothing moved in the journal, so no status went out: the fleet hears "busy"
            # (transient) and offers again later, instead of waiting for its timeout.
            self._report_busy(bundle_id, outcome.reason)

    def _report_busy(self, bundle_id: str, why: str) -> None:
        uplink = self.agent.uplink
        if uplink is None:
            return
        build = _status_builder(
            device=self.agent.config.agent.device,
            bundle_id=bundle_id,
            state="failed",
            kind=None,
            version="",
            reason=why,
            detail={"code": "busy", "permanent": False},
        )
        uplink.publish("ota/status", build)

    # -- the CLI's and the API's view ----------------------------------------------------------

    async def install_file(self, path: Path) -> Outcome:
        return await self.updater.install_file(path)

    def status(self) -> dict[str, Any]:
        return self.updater.status()


def _status_builder(
    *,
    device: str,
    bundle_id: str,
    state: str,
    kind: str | None,
    version: str,
    reason: str,
    detail: dict[str, Any],
) -> Callable[[str, int], OtaStatusMsg]:
    def build(boot_id: str, seq: int) -> OtaStatusMsg:
        return OtaStatusMsg(
            device=device,
            boot_id=boot_id,
            seq=seq,
            t_ns=time.time_ns(),
            bundle_id=bundle_id[:128] or "-",
            state=state,
            kind=kind if kind in ("model", "config", "agent") else None,  # type: ignore[arg-type]
            version=version[:128],
            reason=reason[:1024],
            detail=detail,
        )

    return build


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _health_url(host: str, port: int) -> str:
    """The agent's own health URL for the API bound on ``host``.

    A wildcard bind is probed on loopback of the same family (asyncio binds ``::`` v6
    only); an IPv6 literal is bracketed (``http://[::1]:8080``); names stay as they are.
    """
    host = host.strip("[]")
    if host in ("0.0.0.0", ""):  # noqa: S104 - the bind address, probed on loopback
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if isinstance(literal, ipaddress.IPv6Address):
        host = f"[{host}]"
    return f"http://{host}:{port}/v1/health"


async def _post_health(host: str, port: int, body: dict[str, Any]) -> bool:
    import aiohttp  # noqa: PLC0415 - as in edge_agent.api: only when the API is used

    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                _health_url(host, port),
                json=body,
                timeout=aiohttp.ClientTimeout(total=1.0),
            ) as resp,
        ):
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


def _retest_and_prepare(stage: ReasoningStage, model: Scorer) -> PreparedModel:
    """A retired model's known answers checked again, then prepared for the swap (in a
    worker thread). Raises :class:`SelfTestFailed`."""
    if isinstance(model, LoadedModel):
        try:
            model = selftest.check(model)
        except KnownAnswersFailed as exc:
            raise SelfTestFailed(f"reasoning: {model.path.parent} is not served: {exc}") from None
    return stage.prepare(model)
