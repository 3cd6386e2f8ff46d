"""The measurements behind the run-time out-of-distribution and alarm-storm thresholds.

``models/input_stats.py`` (MARGINS) and ``edge_agent/ood.py`` (horizons and shares) state
numbers; this prints the evidence for them, with the committed model and its
``training.input_stats``:

1. held-out continuous normal running (``models.train.CONT_TEST``: 4 plant seeds never
   trained on, 1 h each, the training acquisition): per signal, the share of windows
   flagged outside the training ranges and the largest share within any 30 s horizon
   (the OOD rule needs 60 %); the largest share of model alarms within any 60 s (a storm
   needs 50 %);
2. the Modbus-only profiles of issue 20 (every signal polled at 100 ms, at 10 ms): the
   share of windows flagged per signal;
3. the trained anomalies (held-out test windows): how often the anomalous signal is
   flagged, so a fault the model knows is seen by the statistics too, while it lasts at
   most 10 s in training;
4. scenarios through the reasoning stage itself (perception's windows of the simulator,
   ``edge_agent.simwindows``): a current sensor stuck for 120 s, vibration drifting off
   scale, a 10 s stuck fault, the Modbus-100 ms profile: when ``model_out_of_distribution``
   and ``alarm_storm`` are raised and cleared.

    .venv/bin/python scripts/ood_evidence.py [--hours 1] [--json]

~3 min on 2 cores with the defaults.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from drivers.sim.plant import Anomaly  # noqa: E402
from edge_agent.ood import OOD_HORIZON_S, STORM_HORIZON_S  # noqa: E402
from edge_agent.reasoning import ReasoningStage  # noqa: E402
from edge_agent.rules import RuleSet  # noqa: E402
from edge_agent.simwindows import plant_windows  # noqa: E402
from models import load_model  # noqa: E402
from models.dataset import (  # noqa: E402
    LABELS,
    RATE_HZ,
    SIGNALS,
    WINDOW,
    continuous_normal,
    generate,
)
from models.input_stats import window_stats  # noqa: E402
from scripts.contract_evidence import modbus_only  # noqa: E402

TEST_RUNS = ((250_001, 0.0), (250_002, 300.0), (250_003, 900.0), (250_004, 1800.0))
WINDOW_S = WINDOW / RATE_HZ


def flagged(windows: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """``(N, n)`` bool: the vectorised :func:`models.input_stats.out_of_training`."""
    st = window_stats(windows)
    lo, hi = st[..., 0], st[..., 1]
    with np.errstate(invalid="ignore"):
        out = (
            (lo < bounds[:, 0])
            | (hi > bounds[:, 1])
            | (st[..., 2] < bounds[:, 2])
            | (st[..., 2] > bounds[:, 3])
            | (st[..., 3] > bounds[:, 4])
            | (st[..., 4] < bounds[:, 5])
            | (st[..., 4] > bounds[:, 6])
        )
    return out & np.isfinite(lo)


def max_share(flags: np.ndarray, horizon_s: float) -> np.ndarray:
    """Per column, the largest share of set rows within any run of ``horizon_s``."""
    k = max(1, round(horizon_s / WINDOW_S))
    c = np.cumsum(np.vstack([np.zeros((1, flags.shape[1])), flags]), axis=0)
    if len(flags) < k:
        return np.asarray(c[-1] / max(1, len(flags)))
    return np.asarray(((c[k:] - c[:-k]) / k).max(axis=0))


def scenario(model: object, name: str, **kw: object) -> dict[str, object]:
    stage = ReasoningStage(model, RuleSet())  # type: ignore[arg-type]
    events: list[str] = []
    alarms = 0
    t0 = None
    for w in plant_windows(**kw):  # type: ignore[arg-type]
        d = stage.process(w, w.end_ns)
        t0 = t0 if t0 is not None else w.start_ns
        alarms += len(d.raised)
        for n in d.notices:
            t = (w.end_ns - t0) / 1e9 + float(kw.get("start_s", 0.0))  # type: ignore[arg-type]
            events.append(f"{t:6.1f}s {n.kind} {n.state} {','.join(n.signals)}")
    print(f"  {name}: alarms raised {alarms}; " + ("; ".join(events) or "no notice"))
    return {"scenario": name, "alarms_raised": alarms, "notices": events}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=1.0, help="per held-out normal run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    started = time.monotonic()
    model = load_model()
    m = model.manifest
    assert m.input_stats is not None, "the model has no training.input_stats"
    bounds = m.input_stats.bounds(m.signals).astype(np.float64)
    out: dict[str, object] = {}

    print(f"1. held-out normal running, {len(TEST_RUNS)} x {args.hours:g} h")
    n = round(args.hours * 3600 / WINDOW_S)
    flags, alarms = [], []
    for seed, start in TEST_RUNS:
        w = continuous_normal(seed, start, n)
        flags.append(flagged(w, bounds))
        probs = [model.predict(x) for x in w]
        alarms.append(np.array([[model.decide(p) != "normal"] for p in probs]))
    f = np.concatenate(flags)
    share = {s: round(float(f[:, i].mean()), 5) for i, s in enumerate(SIGNALS)}
    worst = np.max([max_share(x, OOD_HORIZON_S) for x in flags], axis=0)
    storm = max(float(max_share(a, STORM_HORIZON_S)[0]) for a in alarms)
    print(f"  flagged share per signal: {share}")
    worst_by = dict(zip(SIGNALS, worst.round(3).tolist(), strict=True))
    print(f"  largest flagged share in any {OOD_HORIZON_S:g} s: {worst_by}")
    print(f"  largest model-alarm share in any {STORM_HORIZON_S:g} s: {storm:.3f}")
    out["normal"] = {
        "windows": len(f),
        "flagged_share": share,
        "max_horizon_share": worst_by,
        "max_storm_share": round(storm, 3),
    }

    print("2. Modbus-only profiles (10 min)")
    for period in (100.0, 10.0):
        w = continuous_normal(250_001, 0.0, round(600 / WINDOW_S), modbus_only(period))
        fl = flagged(w, bounds)
        s = {name: round(float(fl[:, i].mean()), 3) for i, name in enumerate(SIGNALS)}
        print(f"  {period:g} ms: flagged share {s}")
        out[f"modbus_{period:g}ms"] = s

    print("3. trained anomalies (held-out test windows, 30 plant seeds)")
    ws = generate(range(200_001, 200_031), 40, rng_seed=7)
    fl = flagged(ws.values, bounds)
    for li, label in enumerate(LABELS[1:], start=1):
        sel = ws.labels == li
        hit = fl[sel, ws.signal[sel]]
        print(f"  {label}: the anomalous signal flagged on {hit.mean():.0%} of {sel.sum()} windows")
        out[f"anomaly_{label}"] = round(float(hit.mean()), 3)

    print("4. scenarios through the reasoning stage")
    out["scenarios"] = [
        scenario(model, "normal 10 min", seed=11, seconds=600.0, start_s=30.0),
        scenario(
            model,
            "current stuck 120 s from 60 s",
            seed=11,
            seconds=300.0,
            start_s=30.0,
            anomalies=[Anomaly("stuck", "current", 60.0, 120.0)],
        ),
        scenario(
            model,
            "vibration drifting +10 mm/s over 120 s from 60 s",
            seed=11,
            seconds=300.0,
            start_s=30.0,
            anomalies=[Anomaly("drift", "vibration", 60.0, 120.0, 10.0)],
        ),
        scenario(
            model,
            "current stuck 10 s from 60 s (a trained fault)",
            seed=11,
            seconds=180.0,
            start_s=30.0,
            anomalies=[Anomaly("stuck", "current", 60.0, 10.0)],
        ),
        scenario(
            model,
            "Modbus-only at 100 ms, 3 min",
            seed=11,
            seconds=180.0,
            start_s=30.0,
            acquisition=modbus_only(100.0),
        ),
    ]
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
