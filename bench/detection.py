"""Detection quality per event, through the agent's own path, per acquisition profile.

Hours of simulated plant time (:class:`drivers.sim.plant.MotorPlant`, plant seeds no model
was trained, validated or tested on) with seeded anomaly schedules (every label on every
signal in a shuffled round, onsets at random phases, long stretches of undisturbed running;
:func:`bench.detection_score.make_schedule`), run faster than real time through what the
agent runs on a window:

* acquisition as the config's sources deliver each signal (``edge_agent.acquisition``:
  poll or frame period, resolution, range, deadband and heartbeat; the simulated sources
  of :func:`models.dataset.acquire_samples`, stamped at arrival);
* perception's :class:`~edge_agent.perception.Aligner` with the config's ``[perception]``
  (:func:`edge_agent.simwindows.plant_windows`);
* the :class:`~edge_agent.reasoning.ReasoningStage` built as ``edge_agent.service.build_stage``
  builds it from the config: its model, rules, hysteresis, breaker, the input contract and
  the run-time out-of-distribution and alarm-storm watch. Its clock is the simulated one
  (``now`` = window end + ``lateness_ms``, the stage's timer too, so the breaker sees every
  window within budget: latency is ``bench.reasoning``'s business, not this bench's).

The memory stage sits between perception and reasoning in the agent but changes no window,
so it is left out. Each plant is one device: a fresh stage, its own timeline of
``--minutes`` from plant time 10 s, walked in pieces of 640 s (1000 windows).

Profiles (``bench/data/detection`` holds the Modbus-only configs):

* ``default``: ``examples/agent.toml`` (CAN at 10-20 ms, voltage and temperature over Modbus);
* ``modbus_100ms``, ``modbus_10ms``: issue 20's register map, every signal polled over Modbus.

Each runs the model its config names (the shipped one) unless ``--model PROFILE=DIR`` gives
another; :data:`TRAINED` adds ``modbus_100ms_trained`` / ``modbus_10ms_trained`` (the same
configs with a model ``models.train --acquisition-from`` trained for them) where that model
is in ``models/``. A profile whose contract ``check-config`` refuses for that model is
still measured, as ``[reasoning] acquisition = "accept-mismatch"`` would run it, and marked
``"accepted": false`` with the reason.

    python -m bench.detection [--quick] [--json] [--workers N] [--profiles a,b]

JSON (last stdout line): ``profiles``: per profile ``accepted`` (and ``refused`` with the
reason), ``model``, ``hours`` simulated, ``undisturbed_hours``, ``false_alarms``,
``false_alarms_per_hour`` (+ ``_upper95``, ``_by_label``), ``events`` per label,
``event_recall`` per label (every signal; ``event_recall_in_scope`` leaves out what the
model card excludes: temperature drift), ``recall_by_signal``,
``event_recall_while_active`` (its own alarm raised at any time before the event ended
+ ``grace_s``: slow, not missed), ``delay_p50_s`` and ``delay_p90_s`` per label (detected
events), ``signal_named`` (the detecting alarm named the anomalous signal),
``wrong_kind`` (another label raised instead), ``alarms_after_end`` (events after which an
alarm was still or again up between ``grace_s`` and ``guard_s`` past the end),
``notices`` (out of distribution and alarm storms raised), ``targets`` (met or not),
``seconds`` (wall time); and the run's parameters. Targets (issue 20):
<= 0.04 false alarms per device-hour on every accepted profile; recall >= 0.9 for spike,
stuck and noise within 5 s, >= 0.8 for drift within 30 s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bench import detection_score as ds
from drivers.sim.plant import SIGNALS, Anomaly, MotorPlant
from edge_agent.acquisition import config_acquisition, contract_check
from edge_agent.config import AgentConfig, load_config
from edge_agent.reasoning import ReasoningStage
from edge_agent.simwindows import T0_NS, plant_windows
from models import load_model
from models.acquisition import Acquisition

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data" / "detection"
PROFILES: dict[str, Path] = {
    "default": REPO / "examples" / "agent.toml",
    "modbus_100ms": DATA / "modbus-only-100ms.toml",
    "modbus_10ms": DATA / "modbus-only-10ms.toml",
}
#: Profiles run with a model trained for their config (``python -m models.train
#: --acquisition-from CONFIG``): name -> (the profile whose config it reads, the model's
#: folder). Measured when the folder holds a model.
TRAINED: dict[str, tuple[str, Path]] = {
    "modbus_100ms_trained": ("modbus_100ms", REPO / "models" / "motor_drive_modbus_only_100ms"),
    "modbus_10ms_trained": ("modbus_10ms", REPO / "models" / "motor_drive_modbus_only_10ms"),
}
#: Plant seeds: none of models.train's (training 1-600, validation 100001+, test 200001+,
#: out of scope 210001+, continuous runs 150001+, 160001+, 250001+) nor the test suite's
#: held-out ones (tests/test_model_card.py: 300001+, 350001).
FIRST_SEED = 400_001
START_S = 10.0
PIECE_S = 640.0  # 1000 windows of 0.64 s
GUARD_S = 20.0  # an event's zone runs this long past its end (alarms cleared, OOD back)
GRACE_S = 5.0  # hysteresis (clear_after = 3 windows) has cleared an alarm by then


@dataclass(frozen=True, slots=True)
class Job:
    profile: str
    config: Path
    model_dir: Path | None
    seed: int
    minutes: float
    schedule_seed: int
    jit: bool | None


@dataclass(frozen=True, slots=True)
class RunResult:
    """One plant (device) of one profile: what was injected and what the stage said."""

    events: list[ds.Event]
    raises: list[ds.Raise]
    records: list[tuple[float, tuple[str, ...], tuple[str, ...]]]
    notices: list[tuple[float, str, str, tuple[str, ...]]]
    start_s: float
    end_s: float
    windows: int
    seconds: float


def profile_acquisition(cfg: AgentConfig, name: str) -> Acquisition:
    """What ``cfg``'s sources deliver for each plant signal, as training describes it."""
    delivered = config_acquisition(cfg.sources)
    missing = [s for s in SIGNALS if s not in delivered]
    if missing:
        raise SystemExit(f"bench.detection: profile {name}: no source gives {', '.join(missing)}")
    return Acquisition(name, {s: delivered[s].acquisition for s in SIGNALS})


def build(
    cfg: AgentConfig, model_dir: Path | None, jit: bool | None, clock: list[int]
) -> tuple[ReasoningStage, bool, str]:
    """The stage as ``build_stage`` makes it, on the simulated clock; (stage, accepted,
    refusal reason). A refused contract runs as ``accept-mismatch`` would."""
    rc = cfg.reasoning
    model = load_model(model_dir or rc.model_dir, backend=rc.backend, threads=rc.threads, jit=jit)
    report = contract_check(cfg)(model.manifest)
    if report.refused:
        cfg = replace(cfg, reasoning=replace(rc, acquisition="accept-mismatch"))
    stage = ReasoningStage(
        model,
        rc.rules,
        perception=cfg.perception,
        breaker=rc.breaker,
        timer=lambda: clock[0],
        contract=contract_check(cfg),
    )
    return stage, not report.refused, "; ".join(str(f) for f in report.errors)


def schedule(job: Job) -> list[ds.Event]:
    rng = np.random.default_rng([job.schedule_seed, job.seed])
    return ds.make_schedule(
        rng,
        start_s=START_S,
        end_s=START_S + job.minutes * 60.0,
        signals=SIGNALS,
        quiet_s=min(300.0, job.minutes * 60.0 / 4),
        guard_s=GUARD_S,
    )


def run_plant(job: Job, events: Sequence[ds.Event] | None = None) -> RunResult:
    """Simulate one device of one profile for ``job.minutes``, with ``events`` (default:
    the job's seeded schedule)."""
    started = time.perf_counter()
    cfg = load_config(job.config)
    acq = profile_acquisition(cfg, job.profile)
    clock = [T0_NS]
    stage, _, _ = build(cfg, job.model_dir, job.jit, clock)
    events = list(events) if events is not None else schedule(job)
    anomalies = [
        Anomaly(e.label, e.signal, e.onset_s, round(e.end_s - e.onset_s, 2), e.magnitude)  # type: ignore[arg-type]
        for e in events
    ]
    plant = MotorPlant(job.seed, anomalies)
    late_ns = round(cfg.perception.lateness_ms * 1e6)
    end_s = START_S + job.minutes * 60.0
    raises: list[ds.Raise] = []
    records: list[tuple[float, tuple[str, ...], tuple[str, ...]]] = []
    notices: list[tuple[float, str, str, tuple[str, ...]]] = []
    windows = 0
    t = START_S
    while t < end_s - 1e-9:
        piece = min(PIECE_S, end_s - t)
        for w in plant_windows(
            seed=job.seed,
            anomalies=anomalies,
            start_s=t,
            seconds=piece,
            spec=cfg.perception,
            acquisition=acq,
            acquisition_seed=job.schedule_seed,
            plant=plant,
        ):
            now = w.end_ns + late_ns
            clock[0] = now
            d = stage.process(w, now)
            windows += 1
            t_s = (now - T0_NS) / 1e9
            if d.raised or d.cleared:
                records.append((t_s, d.raised, d.cleared))
                names = tuple(s for s, _ in d.top_signals)
                raises += [ds.Raise(t_s, label, names) for label in d.raised]
            for n in d.notices:
                notices.append((t_s, n.kind, n.state, n.signals))
        t += piece
    return RunResult(
        events, raises, records, notices, START_S, end_s, windows, time.perf_counter() - started
    )


def score(results: Sequence[RunResult]) -> dict[str, object]:
    """The figures of one profile over all its plants."""
    matches: list[ds.Match] = []
    false: list[ds.Raise] = []
    after: list[bool] = []
    undisturbed = 0.0
    for r in results:
        zones = ds.zones(r.events, GUARD_S)
        matches += ds.match_events(r.events, r.raises, slack_s=GRACE_S)
        false += ds.false_alarms(r.raises, zones)
        undisturbed += ds.undisturbed_seconds(r.start_s, r.end_s, zones)
        after += ds.after_end(r.events, ds.spans(r.records), grace_s=GRACE_S, guard_s=GUARD_S)
    out = ds.summarize(matches, false, undisturbed, after, SIGNALS)
    notices: dict[str, int] = {}
    for r in results:
        for _, kind, state, _ in r.notices:
            if state == "raised":
                notices[kind] = notices.get(kind, 0) + 1
    out["notices"] = notices
    out["targets"] = ds.targets_met(out)
    out["targets_in_scope"] = ds.targets_met(out, in_scope=True)
    return out


def available() -> dict[str, tuple[Path, Path | None]]:
    """Every profile that can run here: name -> (config, model folder; None: the config's)."""
    out: dict[str, tuple[Path, Path | None]] = {n: (c, None) for n, c in PROFILES.items()}
    for name, (base, model) in TRAINED.items():
        if (model / "manifest.json").is_file():
            out[name] = (PROFILES[base], model)
    return out


def measure(
    profiles: dict[str, tuple[Path, Path | None]],
    *,
    seeds: int,
    minutes: float,
    workers: int,
    schedule_seed: int,
    jit: bool | None = None,
    progress: bool = True,
) -> dict[str, dict[str, object]]:
    """Run every profile (name -> (config, model folder)) on ``seeds`` plants of
    ``minutes`` each."""
    names = list(profiles)
    jobs = [
        Job(name, *profiles[name], FIRST_SEED + i, minutes, schedule_seed, jit)
        for name in names
        for i in range(seeds)
    ]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            results = list(pool.map(run_plant, jobs))
    else:
        results = [run_plant(j) for j in jobs]
    out: dict[str, dict[str, object]] = {}
    for name in names:
        mine = [r for j, r in zip(jobs, results, strict=True) if j.profile == name]
        config, model_dir = profiles[name]
        cfg = load_config(config)
        stage, accepted, reason = build(cfg, model_dir, jit, [T0_NS])
        m = stage.model.manifest
        fig: dict[str, object] = {
            "config": str(config.relative_to(REPO)),
            "model": {
                "dir": str(model_dir) if model_dir is not None else "the config's",
                "name": m.name,
                "version": m.version,
                "sha256": stage.model.sha256[:16],
                "trained_for": m.acquisition.name if m.acquisition is not None else None,
            },
            "accepted": accepted,
        }
        if not accepted:
            fig["refused"] = f"check-config refuses this model for this config: {reason}"
        fig["hours"] = round(sum(r.end_s - r.start_s for r in mine) / 3600.0, 3)
        fig["windows"] = sum(r.windows for r in mine)
        fig.update(score(mine))
        fig["seconds"] = round(sum(r.seconds for r in mine), 1)
        out[name] = fig
        if progress:
            print(_line(name, fig), file=sys.stderr)
    return out


def _line(name: str, fig: dict[str, object]) -> str:
    return (
        f"{name}: accepted={fig['accepted']} hours={fig['hours']} "
        f"false/h={fig['false_alarms_per_hour']} ({fig['false_alarms']} in "
        f"{fig['undisturbed_hours']} h) recall={fig['event_recall']} "
        f"p50={fig['delay_p50_s']} p90={fig['delay_p90_s']} after_end={fig['alarms_after_end']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 plants x 20 min per profile")
    parser.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    parser.add_argument("--seeds", type=int, help="plants per profile (default 3 quick, 12)")
    parser.add_argument("--minutes", type=float, help="per plant (default 20 quick, 60)")
    parser.add_argument("--workers", type=int, default=1, help="processes (default 1)")
    parser.add_argument("--schedule-seed", type=int, default=20)
    table = available()
    parser.add_argument("--profiles", default=",".join(table), help="comma-separated")
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        help="PROFILE=DIR: run PROFILE's config with the model in DIR instead",
    )
    args = parser.parse_args(argv)
    for item in args.model:
        name, sep, path = item.partition("=")
        if not sep or name not in table:
            parser.error(
                f"--model {item!r}: expected PROFILE=DIR with PROFILE one of {list(table)}"
            )
        table[name] = (table[name][0], Path(path))
    names = [n.strip() for n in args.profiles.split(",") if n.strip()]
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"unknown profile {unknown[0]!r}; expected some of {', '.join(table)}")
    seeds = args.seeds or (3 if args.quick else 12)
    minutes = args.minutes or (20.0 if args.quick else 60.0)
    started = time.perf_counter()
    profiles = measure(
        {n: table[n] for n in names},
        seeds=seeds,
        minutes=minutes,
        workers=args.workers,
        schedule_seed=args.schedule_seed,
        progress=not args.json,
    )
    out = {
        "profiles": profiles,
        "quick": args.quick,
        "plants_per_profile": seeds,
        "minutes_per_plant": minutes,
        "schedule_seed": args.schedule_seed,
        "horizon_s": dict(ds.HORIZON_S),
        "guard_s": GUARD_S,
        "grace_s": GRACE_S,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
