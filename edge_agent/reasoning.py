"""The reasoning stage: window -> INT8 model -> masks -> hysteresis -> attribution -> Decision.

:class:`ReasoningStage` is synchronous and does no I/O: ``invoke()`` takes tens of
microseconds, so the agent calls :meth:`ReasoningStage.process` inline on the event loop. It
times itself (``time.perf_counter_ns``, injectable) and feeds its
:class:`~edge_agent.breaker.Breaker`. Rules, masks and hysteresis are
:mod:`edge_agent.rules`. Attribution by occlusion (the references per fault kind and the
figures that chose them, held columns for dropout, keep-one-in for joint causes) and the
hot swap (prepare off the loop, one assignment between windows) are explained once in
``docs/ARCHITECTURE.md``, section "Reasoning".
"""

from __future__ import annotations

import asyncio
import math
import operator
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from edge_agent.breaker import Breaker, BreakerSpec
from edge_agent.errors import ModelMismatch, RulesError
from edge_agent.ood import HealthSpec, ModelHealth, Notice
from edge_agent.perception import PerceptionSpec, Window
from edge_agent.rules import (
    DROPOUT,
    NORMAL,
    AlarmTracker,
    CompiledRules,
    Decision,
    Level,
    RuleFiring,
    RuleSet,
    dropout_finding,
)
from models import ModelManifest
from models.kernels import Kernels, kernels
from models.runtime import ColumnMedian, LoadedModel

if TYPE_CHECKING:
    from edge_agent.acquisition import ContractReport

FloatArray = npt.NDArray[np.float32]
T = TypeVar("T")

#: Latencies kept for the P50/P99 in :meth:`ReasoningStage.stats` (the most recent ones).
LATENCY_HISTORY = 2048


class Scorer(Protocol):
    """What the stage needs of a model; :class:`models.LoadedModel` is one."""

    @property
    def manifest(self) -> ModelManifest: ...
    @property
    def sha256(self) -> str: ...
    def predict(self, values: npt.NDArray[Any]) -> FloatArray: ...


@dataclass(frozen=True, slots=True, eq=False)
class PreparedModel:
    """A model checked against this stage, with its rules compiled: what a swap installs."""

    model: Scorer
    rules: CompiledRules
    #: Perception columns in the model's signal order; None when they are the same.
    columns: npt.NDArray[np.intp] | None
    signals: tuple[str, ...]
    #: Per-signal normal mean (manifest) and a fixed pattern of normal step noise, for
    #: occlusion (see the module docstring); level_ref is their sum (the drift reference).
    normal_mean: FloatArray
    step_noise: FloatArray
    level_ref: FloatArray
    #: Right after ``model.predict(values)``, the probabilities with each signal in turn
    #: replaced, one row per signal: ``occlude_normal(values)`` by ``level_ref``;
    #: ``occlude_median(values, x)`` by ``np.median(x, axis=0) + step_noise`` (the model's
    #: batched :class:`~models.runtime.LevelOcclusion` reusing that call's int8 input,
    #: when it has one; else one ``predict()`` per signal).
    occlude_normal: Callable[[FloatArray], FloatArray]
    occlude_median: Callable[[FloatArray, FloatArray], FloatArray]
    #: Right after an occlusion, the rows with only signal ``i`` left as it was (the
    #: fallback explanation, see the module docstring); None for a scorer without it.
    keep_one: Callable[[], FloatArray] | None
    #: The model's, copied here: every decision records them.
    sha256: str
    version: str
    #: The input contract against this agent's config (None: not checked, e.g. a bench);
    #: ``contract.mismatch`` with ``contract.accepted``: every decision is marked.
    contract: ContractReport | None = None
    acquisition_mismatch: bool = False
    #: The training ranges the inputs are watched against (None: no ``input_stats``).
    input_bounds: FloatArray | None = None


class DropOldestQueue(Generic[T]):
    """A bounded FIFO for one asyncio consumer: a full queue drops its oldest item.

    Why drop the oldest: a window that waited behind a newer one is already late; the
    newest one is what the plant is doing now. Drops are counted in :attr:`dropped`.
    """

    def __init__(self, maxlen: int = 2) -> None:
        if maxlen < 1:
            raise ValueError("maxlen must be >= 1")
        self.maxlen = maxlen
        self._items: deque[T] = deque()
        self._ready = asyncio.Event()
        self.dropped = 0
        self.put_total = 0
        self.high_water = 0

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, item: T) -> T | None:
        """Append ``item``; returns the item dropped to make room, if any."""
        dropped = None
        if len(self._items) >= self.maxlen:
            dropped = self._items.popleft()
            self.dropped += 1
        self._items.append(item)
        self.put_total += 1
        self.high_water = max(self.high_water, len(self._items))
        self._ready.set()
        return dropped

    def get_nowait(self) -> T | None:
        """The oldest item, or None when empty."""
        return self._items.popleft() if self._items else None

    async def get(self) -> T:
        """Wait for and remove the oldest item."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


@dataclass(slots=True)
class StageStats:
    """Counters of one stage; latencies are the most recent :data:`LATENCY_HISTORY`."""

    decisions: int = 0
    model_runs: int = 0
    attributions: int = 0
    swaps: int = 0
    swaps_refused: int = 0
    #: Windows whose model alarm was masked because the inputs were out of distribution.
    ood_masked: int = 0
    labels: Counter[str] = field(default_factory=Counter)
    #: Windows scored per model sha256 (a hot swap shows up here).
    by_model: Counter[str] = field(default_factory=Counter)
    reasoning_us: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_HISTORY))
    perception_us: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_HISTORY))


@dataclass(frozen=True, slots=True)
class Evaluation:
    """What :meth:`ReasoningStage.evaluate` makes of one window: a verdict without a Decision.

    ``label``/``score``/``probabilities``/``top_signals``/``attribution``/``rules_fired`` mean
    what they mean in :class:`~edge_agent.rules.Decision`; ``latency_ms`` is the
    evaluation's own time.
    """

    label: str
    score: float
    probabilities: Mapping[str, float]
    top_signals: tuple[tuple[str, float], ...]
    attribution: str
    rules_fired: tuple[RuleFiring, ...]
    model_sha256: str
    latency_ms: float


def percentiles(samples: Sequence[float] | deque[float]) -> dict[str, float | int]:
    """P50/P99/P99.9/max of ``samples`` (rounded to 0.1) and their count; zeros when empty."""
    if not samples:
        return {"p50": 0.0, "p99": 0.0, "p999": 0.0, "max": 0.0, "n": 0}
    arr = np.fromiter(samples, dtype=np.float64, count=len(samples))
    p50, p99, p999 = np.percentile(arr, [50, 99, 99.9])
    return {
        "p50": round(float(p50), 1),
        "p99": round(float(p99), 1),
        "p999": round(float(p999), 1),
        "max": round(float(arr.max()), 1),
        "n": len(samples),
    }


class ReasoningStage:
    """Scores windows with the serving model under rules, hysteresis and a breaker.

    ``perception`` gives the window's signals, length and rate (default: the model's own,
    for benches and tests that build windows from the model's signal list). The model's
    signals must all be perception signals (columns are picked by name) and its window and
    rate must match; the rules' labels must be alarm labels of the model. ``timer`` is the
    monotonic ns clock the stage times itself with.
    """

    def __init__(
        self,
        model: Scorer,
        rules: RuleSet,
        *,
        perception: PerceptionSpec | None = None,
        breaker: BreakerSpec | None = None,
        timer: Callable[[], int] = time.perf_counter_ns,
        contract: Callable[[ModelManifest], ContractReport] | None = None,
        health: HealthSpec | None = None,
    ) -> None:
        m = model.manifest
        self.perception = perception or PerceptionSpec(
            signals=m.signals, rate_hz=m.rate_hz, window=m.window, hop=m.window
        )
        self.rules = rules
        self.breaker = Breaker(breaker or BreakerSpec())
        #: Set by the agent while its own start-up work (the compiled kernels loading after
        #: READY) runs beside the pipeline: overruns then do not feed the breaker.
        self.warming = False
        self.timer = timer
        self.stats = StageStats()
        #: Checks a model's input contract against the agent's config in prepare() (None:
        #: not checked); a refused contract is a ModelMismatch.
        self.contract = contract
        self._active = self.prepare(model)
        self._seen = self._active
        #: The model-health monitors' horizons and shares (edge_agent.ood).
        self.health_spec = health or HealthSpec()
        self.health = _health_of(self._active, self.health_spec)
        self.tracker = AlarmTracker(rules.hysteresis)
        self._held: tuple[str, float] = (NORMAL, float("nan"))
        # Trace ids: 16 random hex digits per stage instance + a counter, 32 in all like a
        # uuid4 hex, unique across restarts, and ~10x cheaper than uuid4() per window.
        self._trace_prefix = uuid.uuid4().hex[:16]
        self._trace = 0
        # Stale flags of the previous window when any was set (see _held_signals).
        self._prev_stale: npt.NDArray[np.bool_] | None = None
        self._prev_seq = -1

    # -- models ---------------------------------------------------------------------------

    @property
    def model(self) -> Scorer:
        """The model serving now."""
        return self._active.model

    def new_health(self) -> ModelHealth:
        """Fresh monitors for the serving model under :attr:`health_spec` (what a swap
        gets; tests set a shorter spec and call this)."""
        return _health_of(self._active, self.health_spec)

    @property
    def model_jit(self) -> bool:
        """Whether the serving model runs on the compiled kernels."""
        return bool(getattr(self._active.model, "jit", False))

    @property
    def prepared(self) -> PreparedModel:
        """The serving model as prepared (its contract, its training ranges)."""
        return self._active

    def prepare(self, model: Scorer) -> PreparedModel:
        """Check ``model`` against this stage and compile the rules for it.

        Raises :class:`ModelMismatch` naming every difference. Then it runs the model once
        on a window of normal means: the first invoke of an interpreter allocates and takes
        milliseconds, which would otherwise land on a live window (and the breaker).

        Safe to call from any thread (it only reads the stage's configuration) as long as
        ``model`` is not serving elsewhere at the same time: do it where the model was
        loaded, so that the loop pays only for :meth:`swap`.
        """
        m = model.manifest
        per = self.perception
        errors: list[str] = []
        missing = [s for s in m.signals if s not in per.signals]
        if missing:
            errors.append(
                f"model signals {list(m.signals)} are not all perception signals "
                f"{list(per.signals)} (missing: {', '.join(missing)})"
            )
        if m.window != per.window:
            errors.append(f"model window is {m.window} steps, perception.window is {per.window}")
        if abs(m.rate_hz - per.rate_hz) > 1e-9 * per.rate_hz:
            errors.append(f"model rate is {m.rate_hz:g} Hz, perception.rate_hz is {per.rate_hz:g}")
        if DROPOUT in m.labels:
            errors.append(f"model label {DROPOUT!r} clashes with the built-in rule")
        compiled = None
        try:
            compiled = self.rules.compile(m.labels, per.signals, m.thresholds)
        except RulesError as exc:
            errors.append(str(exc))
        report = self.contract(m) if self.contract is not None else None
        if report is not None and report.refused:
            errors.append(report.refusal())
        if errors or compiled is None:
            raise ModelMismatch(
                f"model {m.name} {m.version} ({model.sha256[:12]}): " + "; ".join(errors)
            )
        columns = None
        if m.signals != per.signals:
            columns = np.array([per.signals.index(s) for s in m.signals], dtype=np.intp)
        mean, noise = _occlusion_constants(m)
        level_ref = mean + noise
        make = getattr(model, "level_occlusion", None)
        # keep_one_in reads the buffers of the model's own batched occlusion: only with it.
        keep_one = None
        if callable(make):
            batched = make(noise, mean)
            occlude_normal, occlude_median = batched.at_base, batched.at_median
            keep_one = getattr(model, "keep_one_in", None)
        else:
            occlude_normal = partial(_occluded_one_by_one, model, ref=level_ref)
            occlude_median = partial(
                _occluded_at_median_one_by_one, model, noise, ColumnMedian(*noise.shape)
            )
        model.predict(level_ref)  # warm-up, see above
        prepared = PreparedModel(
            model=model,
            rules=compiled,
            columns=columns,
            signals=m.signals,
            normal_mean=mean,
            step_noise=noise,
            level_ref=level_ref,
            occlude_normal=occlude_normal,
            occlude_median=occlude_median,
            keep_one=keep_one,
            sha256=model.sha256,
            version=m.version,
            contract=report,
            acquisition_mismatch=report is not None and report.mismatch,
            input_bounds=m.input_stats.bounds(m.signals) if m.input_stats is not None else None,
        )
        # The first attribution in a process also pays one-time costs (ms: the batched
        # interpreter's first invoke allocates): pay them here, not on the first alarm.
        if compiled.top_k:
            for label in compiled.labels:
                if label != NORMAL:
                    _occlusion(prepared, level_ref, label, 1.0)  # right after its predict
        return prepared

    def prepare_rules(self, rules: RuleSet) -> PreparedModel:
        """The serving model under new ``rules``, for :meth:`swap` (a config update).

        Only the rules are compiled: the model is neither run nor touched, so this is safe
        from another thread while it serves (:meth:`prepare` would run it, and its buffers
        are the serving window's). Raises :class:`ModelMismatch` if the rules do not fit.
        """
        active = self._active
        m = active.model.manifest
        try:
            compiled = rules.compile(m.labels, self.perception.signals, m.thresholds)
        except RulesError as exc:
            raise ModelMismatch(f"model {m.name} {m.version}: {exc}") from None
        return replace(active, rules=compiled)

    def swap(self, prepared: PreparedModel) -> Scorer:
        """Install ``prepared`` between two windows; returns the model it replaced.

        One reference assignment: :meth:`process` reads the reference once per window, so
        this may run on another thread than ``process`` (e.g. an OTA worker).
        """
        if prepared.rules.signals != self.perception.signals:
            raise ModelMismatch("prepared for another stage (different perception signals)")
        old = self._active
        self._active = prepared
        self.stats.swaps += 1
        return old.model

    def use_kernels(self, prepared: PreparedModel, k: Kernels) -> bool:
        """Put the serving model, if it is still ``prepared``, and its health monitor on the
        compiled kernels ``k`` (checked by the caller: edge_agent.warm). On the loop, between
        two windows. False when another model serves now (it was loaded with the kernels
        already, or without them by the config) or the model cannot use them."""
        model = prepared.model
        if self._active is not prepared or not isinstance(model, LoadedModel):
            return False
        model.use_kernels(k)
        if self._seen is prepared:
            self.health.use_kernel(k.input_out_mask)
        return True

    def swap_model(self, model: Scorer) -> Scorer:
        """:meth:`prepare` then :meth:`swap`. On :class:`ModelMismatch` the old model stays."""
        try:
            prepared = self.prepare(model)
        except ModelMismatch:
            self.stats.swaps_refused += 1
            raise
        return self.swap(prepared)

    # -- the hot path ---------------------------------------------------------------------

    def process(  # noqa: PLR0915 - one window through the stage (features, model, rules, attribution) on the hot path
        self,
        window: Window,
        now_ns: int,
        perception_ms: float = 0.0,
        memory_ms: float = 0.0,
    ) -> Decision:
        """Decide about one window. ``now_ns`` (UNIX ns) becomes the decision's ``t_ns``."""
        t0 = self.timer()
        active = self._active  # read once: a swap never splits a window
        notices: list[Notice] = []
        if active is not self._seen:
            # First window of a swapped-in model. Alarm states of labels it does not have
            # could never clear: drop them (done here, not in swap(), so that swap() stays
            # a single assignment). Its inputs are watched against its own statistics.
            self._seen = active
            self.tracker.forget((*active.rules.labels, DROPOUT))
            notices += self.health.reset(window.end_ns, "another model serves")
            self.health = _health_of(active, self.health_spec)
        rules = active.rules
        breaker = self.breaker
        mode = breaker.mode
        allowed, fired = rules.masks(window.values)
        # One look at the stale flags, shared by the dropout rule and the held columns.
        any_stale = True in window.stale.tolist()
        finding = dropout_finding(window.signals, window.stale) if any_stale else None
        if finding is not None:
            fired.append(finding)
        levels: dict[str, Level] = {DROPOUT: Level.BELOW if finding is None else Level.ABOVE}
        probabilities: dict[str, float] = {}
        top: tuple[tuple[str, float], ...] = ()
        attribution = "none"
        tracker = self.tracker
        health = self.health
        ran = breaker.should_run()
        unchanged = False
        if ran:
            held = self._held_signals(window, any_stale)
            values, plist = _score(active, window, held)
            label, score, quiet = rules.verdict(plist, allowed)
            if held is not None and active.columns is not None:
                held = held[active.columns]
            got = health.observe(values, held, label if label != NORMAL else None, window.end_ns)
            if got:
                notices += got
            ood = health.ood.active
            if ood:
                # Out of distribution: every model label is masked (see edge_agent.ood).
                if label != NORMAL:
                    self.stats.ood_masked += 1
                label, score, quiet = NORMAL, float(plist[0]), True
                allowed = [True] + [False] * (len(allowed) - 1)
                fired.append(_ood_firing(ood))
            # Every label below its band and every alarm clear (the usual window): the
            # tracker would change nothing, so its input is not built nor fed.
            unchanged = quiet and finding is None and tracker.settled()
            if not unchanged:
                levels.update(rules.levels(plist, allowed))
            probabilities = dict(zip(rules.labels, plist, strict=True))
            self._held = (label, score)
            if label != NORMAL and rules.top_k:
                top, attribution = _occlusion(active, values, label, score)
        else:
            label, score = self._held
            ood = health.ood.active
            if ood:
                fired.append(_ood_firing(ood))
        # Remembered whether or not the model ran: the next window needs it either way.
        self._prev_seq = window.seq
        self._prev_stale = window.stale if finding is not None else None
        raised: tuple[str, ...] = ()
        cleared: tuple[str, ...] = ()
        if unchanged:
            alarms = tracker.active()
        else:
            alarms, raised, cleared = tracker.update(levels)
        elapsed_us = (self.timer() - t0) / 1000.0
        breaker.record(elapsed_us if ran else None, warming=self.warming)

        st = self.stats
        st.decisions += 1
        st.model_runs += ran
        st.attributions += attribution != "none"
        st.labels[label] += 1
        st.by_model[active.sha256] += ran
        st.reasoning_us.append(elapsed_us)
        st.perception_us.append(perception_ms * 1000.0)
        self._trace += 1
        return Decision(
            trace_id=f"{self._trace_prefix}{self._trace:016x}",
            t_ns=now_ns,
            window_seq=window.seq,
            window_start_ns=window.start_ns,
            model_sha256=active.sha256,
            model_version=active.version,
            model_ran=ran,
            label=label,
            score=score,
            probabilities=probabilities,
            alarms=alarms,
            raised=raised,
            cleared=cleared,
            rules_fired=tuple(fired),
            top_signals=top,
            attribution=attribution,
            mode=mode,
            stage_latency_ms={
                "perception": perception_ms,
                "memory": memory_ms,
                "reasoning": elapsed_us / 1000.0,
            },
            ood=ood,
            alarm_storm=health.storm.active,
            acquisition_mismatch=active.acquisition_mismatch,
            notices=tuple(notices) if notices else (),
        )

    def evaluate(self, window: Window) -> Evaluation:
        """Score ``window`` as :meth:`process` would, changing nothing in the stage.

        For probes (the health API): the same column selection, stale neutralisation, model
        run, masks, winner and (off the normal path) occlusion, but no alarm tracker, breaker,
        counters, trace id or memory of the previous window. So the model runs even when the
        breaker has degraded the stage, and the held columns are those of this window alone:
        process() also neutralises a signal that was stale at the end of the previous window,
        and a probe window has no previous one.
        """
        t0 = self.timer()
        active = self._active
        rules = active.rules
        allowed, fired = rules.masks(window.values)
        finding = dropout_finding(window.signals, window.stale)
        if finding is not None:
            fired.append(finding)
        held = window.stale | np.isnan(window.values[0])
        values, plist = _score(active, window, held if held.any() else None)
        label, score = rules.winner(plist, allowed)
        top: tuple[tuple[str, float], ...] = ()
        attribution = "none"
        if label != NORMAL and rules.top_k:
            top, attribution = _occlusion(active, values, label, score)
        return Evaluation(
            label=label,
            score=score,
            probabilities=dict(zip(rules.labels, plist, strict=True)),
            top_signals=top,
            attribution=attribution,
            rules_fired=tuple(fired),
            model_sha256=active.sha256,
            latency_ms=(self.timer() - t0) / 1e6,
        )

    def _held_signals(self, window: Window, any_stale: bool) -> npt.NDArray[np.bool_] | None:
        """Signals whose column is (partly) a held value, or None when there are none.

        ``stale`` is the state at the window's last point (``any_stale``: one of them is
        set). A signal stale at the end of the previous window and fresh again now was
        still held at the start of this one.
        """
        stale = window.stale
        # Not seen yet at the window's start (the agent just started, a source joined late):
        # NaN up to its first sample, then a jump, which reads as a spike. Neutralise it too.
        # (A sum of the first row is NaN when one of its values is: one cheap test first.)
        first = window.values[0]
        if math.isnan(sum(first.tolist())):
            missing = np.isnan(first)
            if missing.any():
                stale = stale | missing
                any_stale = True
        prev = self._prev_stale
        if prev is not None and window.seq == self._prev_seq + 1:
            return stale | prev
        return stale if any_stale else None

    # -- reporting ------------------------------------------------------------------------

    def _health_snapshot(self) -> dict[str, object]:
        """The serving model's health: its input contract, distribution and storms."""
        active = self._active
        out = self.health.snapshot()
        ood = out["ood"]
        assert isinstance(ood, dict)
        ood["masked_alarm_windows"] = self.stats.ood_masked
        contract = active.contract
        out["acquisition"] = (
            contract.to_json()
            if contract is not None
            else {"checked": False, "status": "unchecked", "errors": [], "notes": []}
        )
        return out

    def snapshot(self) -> dict[str, object]:
        """JSON-ready counters, the breaker, the serving model and latency percentiles."""
        st = self.stats
        m = self._active.model.manifest
        return {
            "decisions": st.decisions,
            "model_runs": st.model_runs,
            "attributions": st.attributions,
            "labels": dict(st.labels),
            "alarms_active": sorted(self.tracker.active()),
            "alarms_raised": self.tracker.raised_total,
            "alarms_cleared": self.tracker.cleared_total,
            "breaker": self.breaker.snapshot(),
            "model": {
                "name": m.name,
                "version": m.version,
                "sha256": self._active.sha256,
                # Features and quantization compiled (models.kernels) or on numpy.
                "jit": self.model_jit,
                **_selftest_fields(self._active.model),
            },
            "by_model": dict(st.by_model),
            "swaps": st.swaps,
            "swaps_refused": st.swaps_refused,
            "model_health": self._health_snapshot(),
            "latency_us": {
                "perception": percentiles(st.perception_us),
                "reasoning": percentiles(st.reasoning_us),
            },
        }


def _selftest_fields(model: Scorer) -> dict[str, object]:
    """What serves and what its known-answer self-test found (:mod:`models.selftest`):
    ``backend``, ``kernels`` (xnnpack | builtin), ``selftest`` (passed | absent |
    untested) and ``selftest_fallback`` (why the delegate was not used, else None)."""
    result = getattr(model, "selftest", None)
    status = result.status() if result is not None else {}
    return {
        "backend": status.get("backend", getattr(model, "backend", "unknown")),
        "kernels": status.get("kernels", getattr(model, "kernels", "unknown")),
        "selftest": status.get("result", "untested"),
        "selftest_fallback": status.get("fallback"),
    }


def _health_of(prepared: PreparedModel, spec: HealthSpec) -> ModelHealth:
    """The health monitors of a freshly serving model: its training ranges, the compiled
    out-of-distribution kernel when the model runs compiled (else the numpy reference)."""
    k = kernels() if getattr(prepared.model, "jit", False) else None
    return ModelHealth(
        prepared.signals,
        prepared.input_bounds,
        k.input_out_mask if k is not None else None,
        spec,
    )


def _ood_firing(signals: Sequence[str]) -> RuleFiring:
    return RuleFiring(
        "model_out_of_distribution",
        f"model labels masked: {', '.join(signals)} outside the training distribution",
    )


def _score(
    active: PreparedModel, window: Window, held: npt.NDArray[np.bool_] | None
) -> tuple[FloatArray, list[float]]:
    """The model's view of ``window`` (``held`` columns neutralised) and its probabilities:
    the part shared by process() and evaluate()."""
    values = window.values if active.columns is None else window.values[:, active.columns]
    if held is not None:
        values = _neutralise_stale(active, values, held, active.columns)
    plist: list[float] = active.model.predict(values).tolist()
    return values, plist


def _neutralise_stale(
    active: PreparedModel,
    values: FloatArray,
    stale: npt.NDArray[np.bool_],
    columns: npt.NDArray[np.intp] | None,
) -> FloatArray:
    """``values`` with every stale signal replaced by its median plus normal step noise.

    Perception holds a dead signal's last value, and a flat column is what the model calls
    ``stuck``: the ``dropout`` rule reports the signal, the model judges the live ones.
    """
    flags = stale if columns is None else stale[columns]
    x = np.array(values, dtype=np.float32, copy=True)
    mean = active.normal_mean
    for i in np.flatnonzero(flags).tolist():
        col = x[:, i]
        finite = col[~np.isnan(col)]
        level = float(np.median(finite)) if finite.size else float(mean[i])
        x[:, i] = level + active.step_noise[:, i]
    return x


#: Labels that are faults of a signal's level rather than of its dynamics: occlusion
#: replaces the signal with its normal mean instead of the window's own median.
LEVEL_LABELS = frozenset({"drift"})


def _occlusion(
    active: PreparedModel, values: FloatArray, label: str, base: float
) -> tuple[tuple[tuple[str, float], ...], str]:
    """The top signals for ``label`` and how they were found, ``occlusion`` or
    ``keep_one`` (see the module docstring).

    Call it right after the model scored ``values`` (the occlusion reuses that run).
    """
    if label in LEVEL_LABELS:
        rows = active.occlude_normal(values)
    else:
        x = values
        if math.isnan(np.add.reduce(x, axis=None)):
            # A never-seen signal (NaN) sits at its normal mean, as the model's features see it.
            x = np.where(np.isnan(x), active.normal_mean, x)
        rows = active.occlude_median(values, x)
    probs: list[float] = rows[:, active.rules.labels.index(label)].tolist()
    drops: list[tuple[str, float]] = []
    for name, p in zip(active.signals, probs, strict=True):
        if base - p > 0.0:
            drops.append((name, base - p))
    if not drops and active.keep_one is not None:
        k = active.rules.labels.index(label)
        alone: list[float] = active.keep_one()[:, k].tolist()
        threshold = active.rules.thresholds[k]
        kept = [(n, p) for n, p in zip(active.signals, alone, strict=True) if p >= threshold]
        if kept:
            kept.sort(key=_second, reverse=True)
            return tuple(kept[: active.rules.top_k]), "keep_one"
    drops.sort(key=_second, reverse=True)  # stable: ties keep the signal order
    return tuple(drops[: active.rules.top_k]), "occlusion"


_second = operator.itemgetter(1)


def _occluded_one_by_one(model: Scorer, values: FloatArray, ref: FloatArray) -> FloatArray:
    """Occlusion for a scorer without ``level_occlusion``: one ``predict()`` per signal."""
    x = np.array(values, dtype=np.float32, copy=True)
    rows = []
    for i in range(x.shape[1]):
        saved = x[:, i].copy()
        x[:, i] = ref[:, i]
        rows.append(model.predict(x))
        x[:, i] = saved
    return np.stack(rows)


def _occluded_at_median_one_by_one(
    model: Scorer, noise: FloatArray, median: ColumnMedian, values: FloatArray, x: FloatArray
) -> FloatArray:
    return _occluded_one_by_one(model, values, median(x) + noise)


def _occlusion_constants(m: ModelManifest) -> tuple[FloatArray, FloatArray]:
    """Normal means, and i.i.d. noise of std ``diff_scale / sqrt(2)`` (fixed seed).

    Such noise has step differences of std ``diff_scale``: the normal step noise the
    model's diff channels are scaled by, so an occluded signal looks neither stuck nor noisy.
    When the manifest records the acquisition the model was trained for
    (``training.acquisition``), the noise is shaped like it: a source slower than the grid
    holds each value for its period, and its steps are at least its deadband or half its
    resolution (a polled, deadbanded or coarse signal does not change at every step).
    """
    rng = np.random.default_rng(0)
    mean = np.asarray([m.mean[s] for s in m.signals], dtype=np.float32)
    step = np.asarray(m.features.diff_scale, dtype=np.float64) / np.sqrt(2.0)
    noise = rng.standard_normal((m.window, len(m.signals))) * step
    acquisition = m.training.get("acquisition") if isinstance(m.training, Mapping) else None
    per_signal = acquisition.get("signals") if isinstance(acquisition, Mapping) else None
    if isinstance(per_signal, Mapping):
        grid_ms = 1000.0 / m.rate_hz
        for i, name in enumerate(m.signals):
            a = per_signal.get(name)
            if not isinstance(a, Mapping):
                continue
            hold = max(1, round(float(a.get("period_ms", grid_ms)) / grid_ms))
            if hold == 1:
                continue
            size = max(step[i], float(a.get("deadband", 0.0)), float(a.get("quantum", 0.0)) / 2)
            blocks = rng.standard_normal(-(-m.window // hold)) * size
            noise[:, i] = np.repeat(blocks, hold)[: m.window]
    return mean, noise.astype(np.float32)


def model_info(model: Scorer) -> Mapping[str, str]:
    """Name, version and sha256 of ``model``, for logs."""
    m = model.manifest
    return {"name": m.name, "version": m.version, "sha256": model.sha256}


__all__ = [
    "LATENCY_HISTORY",
    "LEVEL_LABELS",
    "DropOldestQueue",
    "Evaluation",
    "ModelMismatch",
    "PreparedModel",
    "ReasoningStage",
    "Scorer",
    "StageStats",
    "model_info",
    "percentiles",
]
