"""The measurements behind the input contract's tolerances (``models/contract.py``).

The committed model is run on back-to-back normal windows of the simulator (held-out
plant seeds, never trained on) made through the training acquisition
(``models.dataset.FIELD_BUSES``) with one parameter of one signal changed: the period,
the resolution, a deadband, the heartbeat, the source kind. For each, the share of
windows the model alarms on (window level, before hysteresis) is printed next to the
baseline's; a change the contract tolerates must stay within the baseline's run-to-run
noise. Then the two Modbus-only profiles of issue 20 (all six signals polled at 100 ms,
and at 10 ms).

    .venv/bin/python scripts/contract_evidence.py [--minutes 20] [--draws 3] [--json]

~3 min with the defaults (4 runs of 20 min, 3 draws each: 22,500 windows per case) on
2 cores. The last line with ``--json`` is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from drivers.sim.plant import STEP_HZ, MotorPlant  # noqa: E402
from models import load_model  # noqa: E402
from models.acquisition import Acquisition, SignalAcquisition  # noqa: E402
from models.dataset import FIELD_BUSES, SIGNALS, WINDOW, _rows, acquire, warmup_steps  # noqa: E402

#: Held-out continuous runs (models.train.CONT_TEST's seeds and starts).
RUNS = ((250_001, 0.0), (250_002, 300.0), (250_003, 900.0), (250_004, 1800.0))
#: The median change of each signal in training (training.input_stats.step_median).
MEDIAN_STEP = {
    "voltage": 0.8,
    "current": 0.08,
    "frequency": 0.02,
    "speed": 1.5,
    "temperature": 0.1,
    "vibration": 0.05,
}


class Runner:
    def __init__(self, minutes: float, draws: int) -> None:
        self.model = load_model()
        self.draws = draws
        self.n_windows = int(minutes * 60 * STEP_HZ / WINDOW)
        self._rows: dict[tuple[int, float, int], np.ndarray] = {}

    def rows(self, seed: int, start_s: float, warm: int) -> np.ndarray:
        key = (seed, start_s, warm)
        if key not in self._rows:
            first = math.floor(start_s * STEP_HZ)
            self._rows[key] = _rows(MotorPlant(seed), first - warm, warm + self.n_windows * WINDOW)
        return self._rows[key]

    def alarm_share(self, acq: Acquisition) -> tuple[float, dict[str, int]]:
        warm = max(warmup_steps(acq), 200)
        counts: dict[str, int] = {}
        total = 0
        for draw in range(self.draws):
            for seed, start in RUNS:
                rows = self.rows(seed, start, warm)
                rng = np.random.default_rng([seed, 7, draw])
                flat = acquire(rows, self.n_windows * WINDOW, acq, rng)
                for x in flat.reshape(self.n_windows, WINDOW, len(SIGNALS)):
                    label = self.model.decide(self.model.predict(x))
                    counts[label] = counts.get(label, 0) + 1
                    total += 1
        return 1.0 - counts.get("normal", 0) / total, counts


def changed(name: str, **kw: object) -> Acquisition:
    """FIELD_BUSES with one signal changed; it gets a schedule of its own."""
    signals = dict(FIELD_BUSES.signals)
    kw.setdefault("source", f"changed {name}")
    signals[name] = replace(signals[name], **kw)  # type: ignore[arg-type]
    return Acquisition(f"{name} {kw}", signals)


def modbus_only(period_ms: float) -> Acquisition:
    """The issue's register map: the simulator's Modbus types, one block, every signal."""
    quantum = {"voltage": 0.0, "current": 0.0, "frequency": 0.01, "speed": 1.0}
    quantum.update({"temperature": 0.1, "vibration": 0.01})
    return Acquisition(
        f"modbus-only {period_ms:g} ms",
        {
            s: SignalAcquisition(
                source="modbus block",
                period_ms=period_ms,
                quantum=quantum[s],
                jitter_ms=1.0,
                synced=False,
            )
            for s in SIGNALS
        },
    )


def cases() -> list[tuple[str, str, Acquisition]]:
    # The noise floor: the same acquisition, with one signal on a schedule of its own (its
    # phase and delays drawn anew, as every changed case below gets).
    out: list[tuple[str, str, Acquisition]] = [
        ("null", f"{name} unchanged, own schedule", changed(name)) for name in SIGNALS
    ]
    for name in SIGNALS:
        a = FIELD_BUSES.signals[name]
        for f in (0.8, 0.9, 0.95, 1.1, 1.25, 1.5, 2.0):
            p = a.period_ms * f
            if max(p, 10.0) == max(a.period_ms, 10.0):
                continue
            out.append(
                (
                    "period",
                    f"{name} {a.period_ms:g} -> {p:g} ms (x{f:g})",
                    changed(name, period_ms=p),
                )
            )
    for name in SIGNALS:
        a = FIELD_BUSES.signals[name]
        med = MEDIAN_STEP[name]
        for k in (0.3, 0.6, 0.7, 1.0, 1.5):
            q = k * med
            if q <= a.quantum:
                continue
            out.append(
                (
                    "resolution",
                    f"{name} quantum {a.quantum:g} -> {q:.3g} ({k:g} median change)",
                    changed(name, quantum=q),
                )
            )
    for name in SIGNALS:
        a = FIELD_BUSES.signals[name]
        if a.deadband:
            for db in (0.0, 0.08, 0.16, 0.24, 1.0):
                out.append(
                    (
                        "deadband",
                        f"{name} deadband {a.deadband:g} -> {db:g}",
                        changed(name, deadband=db),
                    )
                )
            for hb in (300.0, 500.0, 1000.0):
                out.append(
                    (
                        "hold",
                        f"{name} heartbeat {a.heartbeat_ms:g} -> {hb:g} ms",
                        changed(name, heartbeat_ms=hb),
                    )
                )
            continue
        for k in (0.3, 0.45, 0.65):
            db = k * MEDIAN_STEP[name]
            out.append(
                (
                    "deadband",
                    f"{name} deadband 0 -> {db:.3g} ({k:g} median change)",
                    changed(name, deadband=db, heartbeat_ms=150.0),
                )
            )
    for name in SIGNALS:
        a = FIELD_BUSES.signals[name]
        if a.synced:
            out.append(
                (
                    "source",
                    f"{name} can -> modbus poll, same period",
                    changed(name, synced=False, jitter_ms=1.0),
                )
            )
        else:
            out.append(
                (
                    "source",
                    f"{name} modbus -> can frame, same period",
                    changed(name, synced=True, jitter_ms=0.7),
                )
            )
    # The three signals of DRIVE_STATUS polled together over Modbus (one block) at 10 ms.
    group = dict(FIELD_BUSES.signals)
    for name in ("current", "frequency", "speed"):
        group[name] = replace(group[name], source="modbus block", synced=False, jitter_ms=1.0)
    out.append(
        (
            "source",
            "current+frequency+speed: one modbus poll, same period",
            Acquisition("drive status over modbus", group),
        )
    )
    out.append(("profile", "modbus only, 100 ms", modbus_only(100.0)))
    out.append(("profile", "modbus only, 10 ms", modbus_only(10.0)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="per held-out run (4 runs)")
    parser.add_argument(
        "--draws", type=int, default=3, help="acquisition draws (phases, delays) per run"
    )
    parser.add_argument("--json", action="store_true", help="a JSON object on the last line")
    args = parser.parse_args(argv)
    runner = Runner(args.minutes, args.draws)
    started = time.monotonic()
    base, counts = runner.alarm_share(FIELD_BUSES)
    windows = runner.n_windows * len(RUNS) * runner.draws
    print(f"baseline (training acquisition): {base:.2%} of {windows} windows alarm {counts}")
    results = [{"aspect": "baseline", "case": "training acquisition", "alarm_share": base}]
    for aspect, text, acq in cases():
        share, counts = runner.alarm_share(acq)
        print(f"{aspect:10s} {text:55s} {share:7.2%}  x{share / base:5.1f}  {counts}", flush=True)
        results.append({"aspect": aspect, "case": text, "alarm_share": round(share, 5)})
    print(f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
    if args.json:
        print(json.dumps({"windows": windows, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
