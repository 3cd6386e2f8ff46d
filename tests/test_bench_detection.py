"""``bench.detection`` (issue 20, item 4): the scoring rules on constructed inputs, and a
tiny real run of the bench (the simulator through acquisition, perception's Aligner and the
reasoning stage with the committed model) that must detect an injected spike."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from bench import detection
from bench import detection_score as ds
from drivers.sim.plant import SIGNALS


def ev(label: str, onset: float, end: float, signal: str = "current") -> ds.Event:
    return ds.Event(label, signal, onset, end)


def test_an_event_is_detected_only_by_its_own_label_within_its_horizon() -> None:
    events = [
        ev("spike", 100.0, 106.0),
        ev("stuck", 200.0, 208.0),
        ev("drift", 300.0, 330.0),
        ev("noise", 400.0, 405.0),
    ]
    raises = [
        ds.Raise(99.9, "spike"),  # before onset: not caused by it
        ds.Raise(101.3, "spike", ("current", "speed")),
        ds.Raise(102.0, "spike"),  # a later raise does not change the delay
        ds.Raise(201.0, "noise"),  # the wrong kind within the horizon
        ds.Raise(205.5, "stuck"),  # 5.5 s > 5 s: too late
        ds.Raise(325.0, "drift", ("speed",)),  # drift has 30 s
        ds.Raise(405.01, "noise"),  # just past 5 s
    ]
    m = ds.match_events(events, raises, slack_s=5.0)
    assert [x.detected for x in m] == [True, False, True, False]
    # Slow is not missed: raised while the event lasted (+ slack), past the horizon.
    assert [x.eventually_s for x in m] == pytest.approx([1.3, 5.5, 25.0, 5.01])
    assert ds.match_events(events[3:], raises)[0].eventually_s is None
    assert m[0].delay_s == pytest.approx(1.3)
    assert m[0].signal_named
    assert m[1].wrong == ("noise",)
    assert m[2].delay_s == pytest.approx(25.0)
    assert not m[2].signal_named
    assert m[3].wrong == ()


def test_false_alarms_count_only_outside_the_protected_zones() -> None:
    events = [ev("spike", 100.0, 110.0), ev("stuck", 125.0, 130.0)]
    zones = ds.zones(events, guard_s=20.0)
    assert zones == [(100.0, 150.0)]  # [100, 130] and [125, 150] merged
    raises = [ds.Raise(50.0, "noise"), ds.Raise(140.0, "stuck"), ds.Raise(150.5, "drift")]
    assert [r.t_s for r in ds.false_alarms(raises, zones)] == [50.0, 150.5]
    assert ds.undisturbed_seconds(0.0, 3600.0, zones) == pytest.approx(3550.0)
    # A zone reaching past the run's end only counts inside it.
    assert ds.undisturbed_seconds(0.0, 120.0, zones) == pytest.approx(100.0)


def test_alarm_spans_and_alarms_still_up_after_the_end() -> None:
    records = [
        (10.0, ("spike",), ()),
        (12.0, ("stuck",), ("spike",)),
        (30.0, (), ("stuck",)),
        (80.0, ("noise",), ()),
    ]
    spans = ds.spans(records)
    assert spans == [
        ds.Span("spike", 10.0, 12.0),
        ds.Span("stuck", 12.0, 30.0),
        ds.Span("noise", 80.0, math.inf),
    ]
    events = [ev("spike", 2.0, 3.0), ev("stuck", 11.0, 20.0), ev("noise", 75.0, 78.0)]
    # spike: nothing up in [8, 23] but its alarm from 10 on and the stuck one, so it counts (any
    # label); stuck: up until 30 > 20 + 5; noise: never cleared.
    assert ds.after_end(events, spans, grace_s=5.0, guard_s=20.0) == [True, True, True]
    assert ds.after_end(events, spans, grace_s=5.0, guard_s=5.5) == [False, True, True]
    quiet = [ev("drift", 40.0, 50.0)]
    assert ds.after_end(quiet, spans, grace_s=5.0, guard_s=20.0) == [False]


def test_summary_recall_delays_rates_and_targets() -> None:
    matches = [
        ds.Match(ev("spike", 0, 5), 1.0, True, eventually_s=1.0),
        ds.Match(ev("spike", 0, 5), 3.0, False, eventually_s=3.0),
        ds.Match(ev("spike", 0, 5, "temperature"), None, wrong=("noise",)),
        ds.Match(ev("drift", 0, 20, "temperature"), None),
        ds.Match(ev("drift", 0, 20), 10.0, True, eventually_s=10.0),
    ]
    matches[2] = ds.Match(matches[2].event, None, wrong=("noise",), eventually_s=7.0)
    false = [ds.Raise(1.0, "stuck")]
    out = ds.summarize(matches, false, 7200.0, [False, False, True, False, False], SIGNALS)
    assert out["event_recall"] == {"drift": 0.5, "spike": 0.667}
    assert out["event_recall_in_scope"] == {"drift": 1.0, "spike": 0.667}
    assert out["event_recall_while_active"] == {"drift": 0.5, "spike": 1.0}
    assert out["recall_by_signal"]["spike"]["temperature"] == 0.0  # type: ignore[index]
    assert out["recall_by_signal"]["spike"]["voltage"] is None  # type: ignore[index]
    assert out["delay_p50_s"] == {"drift": 10.0, "spike": 2.0}
    assert out["delay_p90_s"]["spike"] == pytest.approx(2.8)  # type: ignore[index]
    assert out["false_alarms_per_hour"] == 0.5
    assert out["false_alarms_by_label"] == {"stuck": 1}
    assert out["alarms_after_end"] == {"drift": 0, "spike": 1}
    assert out["wrong_kind"] == {"drift": {}, "spike": {"noise": 1}}
    assert out["signal_named"] == {"drift": 1.0, "spike": 0.5}
    met = ds.targets_met(out)
    assert met == {
        "recall_drift": False,
        "recall_spike": False,
        "recall_stuck": False,  # no stuck event: not met
        "recall_noise": False,
        "false_alarms_per_hour": False,
    }
    assert ds.targets_met(out, in_scope=True)["recall_drift"]


def test_poisson_upper_bound() -> None:
    assert ds.poisson_upper95(0, 1.0) == pytest.approx(2.996, abs=1e-3)
    assert ds.poisson_upper95(1, 10.0) == pytest.approx(0.4744, abs=1e-3)
    assert ds.poisson_upper95(0, 0.0) == math.inf


def test_a_schedule_cycles_every_label_and_signal_and_leaves_gaps() -> None:
    rng = np.random.default_rng(3)
    order: list[tuple[str, str]] = []
    events = ds.make_schedule(
        rng, start_s=10.0, end_s=7200.0, signals=SIGNALS, quiet_s=300.0, order=order
    )
    assert events[0].onset_s >= 310.0 + 20.0
    pairs = {(e.label, e.signal) for e in events}
    assert len(pairs) == len(ds.EVENT_LABELS) * len(SIGNALS)
    for a, b in itertools.pairwise(events):
        assert b.onset_s - a.end_s >= 20.0 + 5.0 - 0.01
    assert events[-1].end_s + 20.0 <= 7200.0
    for e in events:
        lo, hi = ds.DURATION_S[e.label]
        assert lo - 0.01 <= e.end_s - e.onset_s <= hi + 0.01
    # Onsets at random phases against the 0.64 s window grid.
    phases = np.array([(e.onset_s - 10.0) % 0.64 for e in events])
    assert phases.min() < 0.1
    assert phases.max() > 0.54


def test_a_tiny_real_run_detects_an_injected_spike_and_nothing_else() -> None:
    job = detection.Job("default", detection.PROFILES["default"], None, 300_001, 1.5, 20, None)
    # A current spike train (8 A, 100 ms once a second) for 8 s. Whether two windows in a
    # row hold a whole spike each (raise_after = 2) depends on the onset's phase: this one
    # is detected in ~2.3 s; others of the same plant take 6-7 s (the bench counts those).
    spike = ds.Event("spike", "current", 60.2, 68.2, 8.0)
    result = detection.run_plant(job, [spike])
    assert result.windows == 140  # whole windows of 0.64 s in 90 s
    figures = detection.score([result])
    assert figures["event_recall"] == {"spike": 1.0}
    delay = figures["delay_p50_s"]["spike"]  # type: ignore[index]
    assert 1.28 <= delay <= 5.0  # two windows at least
    assert figures["signal_named"] == {"spike": 1.0}
    assert figures["false_alarms"] == 0
    assert figures["alarms_after_end"] == {"spike": 0}
    # Without the spike the same plant raises nothing.
    quiet = detection.run_plant(job, [])
    assert quiet.raises == []


def test_the_bench_prints_its_figures_and_marks_a_refused_profile(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--json", "--seeds", "1", "--minutes", "3", "--profiles", "default,modbus_100ms"]
    assert detection.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    default, modbus = out["profiles"]["default"], out["profiles"]["modbus_100ms"]
    for fig in (default, modbus):
        for key in ("false_alarms_per_hour", "event_recall", "delay_p50_s", "delay_p90_s"):
            assert key in fig
        assert fig["hours"] == pytest.approx(0.05)
    assert default["accepted"] is True
    assert "refused" not in default
    assert modbus["accepted"] is False
    assert "current: windows will look stuck" in modbus["refused"]
    # The undisturbed start of a Modbus-100 ms plant is an alarm storm, and it is flagged.
    assert modbus["notices"].get("model_out_of_distribution", 0) >= 1
