"""The pure plant model: determinism, physics sanity, anomalies, the anomaly grammar."""

import itertools
import math
import random
import statistics
import time

import pytest

from drivers.errors import DriverConfigError
from drivers.sim.plant import (
    NOISE_STD,
    SIGNALS,
    STEP_S,
    Anomaly,
    MotorPlant,
    parse_anomaly,
    step_index,
)

pytestmark = pytest.mark.peers

SEED = 3  # runs from t = 6 s to past 200 s; steady 45 Hz in [30, 61)
START, DURATION = 40.0, 20.0


def _ts(start_s: float, stop_s: float) -> list[float]:
    """Every 100 Hz step time in [start_s, stop_s)."""
    return [k * STEP_S for k in range(step_index(start_s), step_index(stop_s))]


def test_same_seed_gives_identical_values() -> None:
    ts = [i * 0.37 for i in range(1500)]
    a, b = MotorPlant(SEED), MotorPlant(SEED)
    assert [a.values_at(t) for t in ts] == [b.values_at(t) for t in ts]
    assert [a.state_at(t) for t in ts] == [b.state_at(t) for t in ts]


def test_different_seeds_differ() -> None:
    a, b = MotorPlant(1), MotorPlant(2)
    assert [a.values_at(t) for t in range(10, 100)] != [b.values_at(t) for t in range(10, 100)]


def test_answers_do_not_depend_on_query_order_or_frequency() -> None:
    anomalies = [
        Anomaly("stuck", "speed", 50, 30),
        Anomaly("spike", "current", 120, 10, 8),
        Anomaly("noise", "vibration", 200, 40, 5),
    ]
    ts = [k * 0.07 for k in range(0, 4300)]  # 0 .. 301 s
    forward_plant = MotorPlant(SEED, anomalies)
    forward = {t: forward_plant.values_at(t) for t in ts}

    shuffled_plant = MotorPlant(SEED, anomalies)
    shuffled = list(ts)
    random.Random(1).shuffle(shuffled)
    assert {t: shuffled_plant.values_at(t) for t in shuffled} == forward

    backward_plant = MotorPlant(SEED, anomalies)
    sparse = ts[::97][::-1]  # far future first, then back in time, rarely
    assert {t: backward_plant.values_at(t) for t in sparse} == {t: forward[t] for t in sparse}


def test_values_hold_for_the_whole_100hz_step() -> None:
    plant = MotorPlant(SEED)
    assert plant.values_at(42.0) == plant.values_at(42.004) == plant.values_at(42.0099)
    assert plant.values_at(42.0) != plant.values_at(42.01)
    with pytest.raises(ValueError, match="plant time must be a finite number >= 0"):
        plant.values_at(-0.5)


def test_physics_is_plausible() -> None:
    plant = MotorPlant(SEED)
    ts = _ts(0, 600)[::10]
    rows = [plant.values_at(t) for t in ts]
    clean = [plant.clean_at(t) for t in ts]
    assert all(385 < r["voltage"] < 415 for r in rows)
    assert all(0 <= r["current"] < 30 for r in rows)
    # Speed follows frequency (4 poles: 30 rpm/Hz) with a slip of tens of rpm: below
    # synchronous speed when driving; while decelerating a light load it is braked
    # regeneratively and runs slightly above.
    for c, s in zip(clean, (plant.state_at(t) for t in ts), strict=True):
        if c["frequency"] > 5:
            slip = 30 * c["frequency"] - c["speed"]
            assert (-20 < slip < 80) if s.ramp_state == 2 else (0 < slip < 80)
    # The winding starts at ambient and warms with the load.
    assert rows[0]["temperature"] == pytest.approx(plant.ambient_c, abs=0.3)
    assert clean[-1]["temperature"] > plant.ambient_c + 10
    speeds = [c["speed"] for c in clean]
    vibrations = [c["vibration"] for c in clean]
    assert statistics.correlation(speeds, vibrations) > 0.9
    # A duty cycle: several setpoints, ramps both ways, at least one stop after the start.
    states = [plant.state_at(t) for t in ts]
    assert len({s.frequency_setpoint for s in states}) >= 5
    assert {s.ramp_state for s in states} == {0, 1, 2}
    assert not states[0].running


def test_noise_has_the_documented_spread() -> None:
    plant = MotorPlant(SEED)
    ts = _ts(35, 55)
    for signal in ("voltage", "current", "speed", "vibration"):
        residual = [plant.values_at(t)[signal] - plant.clean_at(t)[signal] for t in ts]
        assert statistics.pstdev(residual) == pytest.approx(NOISE_STD[signal], rel=0.1)


def _split(a: Anomaly, margin_s: float = 2.0) -> tuple[list[float], list[float]]:
    inside = _ts(a.start_s, a.end_s)
    outside = _ts(a.start_s - margin_s, a.start_s) + _ts(a.end_s, a.end_s + margin_s)
    return inside, outside


@pytest.mark.parametrize("kind", ["drift", "spike", "stuck", "dropout", "noise"])
def test_anomaly_changes_nothing_outside_its_interval(kind: str) -> None:
    magnitude = {"drift": 5.0, "spike": 8.0, "noise": 6.0}.get(kind, 0.0)
    a = Anomaly(kind, "current", START, DURATION, magnitude)  # type: ignore[arg-type]
    base, faulty = MotorPlant(SEED), MotorPlant(SEED, [a])
    inside, outside = _split(a)
    assert all(faulty.values_at(t) == base.values_at(t) for t in outside)
    assert any(faulty.values_at(t) != base.values_at(t) for t in inside)
    # Other signals never see it.
    others = [s for s in SIGNALS if s != "current"]
    for t in inside[::25]:
        assert {s: faulty.values_at(t)[s] for s in others} == {
            s: base.values_at(t)[s] for s in others
        }


def test_drift_ramps_from_zero_to_magnitude() -> None:
    a = Anomaly("drift", "temperature", START, DURATION, 5.0)
    base, faulty = MotorPlant(SEED), MotorPlant(SEED, [a])
    inside, _ = _split(a)
    offsets = [
        faulty.values_at(t)["temperature"] - base.values_at(t)["temperature"] for t in inside
    ]
    assert offsets[0] == pytest.approx(0.0, abs=1e-9)
    assert offsets[len(offsets) // 2] == pytest.approx(2.5, abs=0.01)
    assert offsets[-1] == pytest.approx(5.0, abs=0.01)
    assert all(b >= a - 1e-9 for a, b in itertools.pairwise(offsets))


def test_spikes_are_short_large_and_start_at_once() -> None:
    a = Anomaly("spike", "current", START, DURATION, 10.0)
    base, faulty = MotorPlant(SEED), MotorPlant(SEED, [a])
    inside, _ = _split(a)
    excursion = [faulty.values_at(t)["current"] - base.values_at(t)["current"] for t in inside]
    spiking = [i for i, e in enumerate(excursion) if e != 0.0]
    assert spiking[:10] == list(range(10))  # the first spike opens the interval
    assert len(spiking) == 10 * int(DURATION)  # one 100 ms spike per second
    assert all(6.0 <= excursion[i] <= 10.0 for i in spiking)


def test_stuck_freezes_the_value_at_start() -> None:
    a = Anomaly("stuck", "speed", START, DURATION)
    base, faulty = MotorPlant(SEED), MotorPlant(SEED, [a])
    inside, _ = _split(a)
    frozen = base.values_at(START)["speed"]
    assert {faulty.values_at(t)["speed"] for t in inside} == {frozen}
    assert len({base.values_at(t)["speed"] for t in inside}) > 100


def test_dropout_removes_the_key() -> None:
    a = Anomaly("dropout", "temperature", START, DURATION)
    base, faulty = MotorPlant(SEED), MotorPlant(SEED, [a])
    inside, outside = _split(a)
    for t in inside[::10]:
        values = faulty.values_at(t)
        assert "temperature" not in values
        assert values == {k: v for k, v in base.values_at(t).items() if k != "temperature"}
    assert all("temperature" in faulty.values_at(t) for t in outside)


def test_noise_burst_multiplies_the_noise() -> None:
    a = Anomaly("noise", "vibration", START, DURATION, 6.0)
    base, faulty = MotorPlant(SEED), MotorPlant(SEED, [a])
    inside, _ = _split(a)
    residual = [faulty.values_at(t)["vibration"] - base.clean_at(t)["vibration"] for t in inside]
    assert statistics.pstdev(residual) == pytest.approx(6.0 * NOISE_STD["vibration"], rel=0.1)


def test_active_anomalies_labels_exactly_the_interval() -> None:
    drift = Anomaly("drift", "temperature", 30, 20, 5)
    stuck = Anomaly("stuck", "speed", 45, 10)
    plant = MotorPlant(SEED, [drift, stuck])
    assert plant.active_anomalies(29.99) == []
    assert plant.active_anomalies(30.0) == [drift]
    assert plant.active_anomalies(47.0) == [drift, stuck]
    assert plant.active_anomalies(49.99) == [drift, stuck]
    assert plant.active_anomalies(50.0) == [stuck]
    assert plant.active_anomalies(55.0) == []
    assert drift.active_at(30.0)
    assert not drift.active_at(50.0)


def test_anomalies_combine_independently_of_their_order() -> None:
    drift = Anomaly("drift", "current", START, DURATION, 3)
    noise = Anomaly("noise", "current", START + 5, DURATION, 4)
    spike = Anomaly("spike", "current", START, 5, 9)
    unrelated = Anomaly("drift", "voltage", 0, 500, -20)
    one, two = MotorPlant(SEED, [drift, noise, spike]), MotorPlant(SEED, [spike, noise, drift])
    three = MotorPlant(SEED, [unrelated, spike, noise, drift])
    for t in _ts(START, START + DURATION + 5)[::7]:
        assert one.values_at(t) == two.values_at(t)
        assert one.values_at(t)["current"] == three.values_at(t)["current"]


def test_queries_are_fast() -> None:
    plant = MotorPlant(SEED, [Anomaly("noise", "current", 10, 20, 3)])
    started = time.perf_counter()
    for t in _ts(0, 60):
        plant.values_at(t)
    assert time.perf_counter() - started < 2.0  # ~30 us per query; budget is generous


# -- anomaly grammar ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("drift:temperature@30+20x5", Anomaly("drift", "temperature", 30, 20, 5)),
        ("spike:current@0+1.5x-4", Anomaly("spike", "current", 0, 1.5, -4)),
        ("  noise:vibration@.5+10.x3  ", Anomaly("noise", "vibration", 0.5, 10, 3)),
        ("stuck:speed@12.25+3", Anomaly("stuck", "speed", 12.25, 3)),
        ("dropout:frequency@60+5", Anomaly("dropout", "frequency", 60, 5)),
    ],
)
def test_parse_anomaly(text: str, expected: Anomaly) -> None:
    parsed = parse_anomaly(text)
    assert parsed == expected
    assert parse_anomaly(str(parsed)) == parsed


def test_anomaly_prints_in_cli_form() -> None:
    assert str(Anomaly("drift", "temperature", 30, 20, 5)) == "drift:temperature@30+20x5"
    assert str(Anomaly("stuck", "speed", 12.5, 3)) == "stuck:speed@12.5+3"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "drift:temperature",
            "bad anomaly 'drift:temperature': expected KIND:SIGNAL@START+DURATION[xMAGNITUDE], "
            "e.g. 'drift:temperature@30+20x5'",
        ),
        (
            "melt:temperature@30+20x5",
            "bad anomaly 'melt:temperature@30+20x5': unknown kind 'melt'; "
            "expected one of drift, spike, stuck, dropout, noise",
        ),
        (
            "drift:pressure@30+20x5",
            "bad anomaly 'drift:pressure@30+20x5': unknown signal 'pressure'; "
            "expected one of voltage, current, frequency, speed, temperature, vibration",
        ),
        (
            "drift:temperature@-3+20x5",
            "bad anomaly 'drift:temperature@-3+20x5': start '-3' is not a decimal number of "
            "seconds",
        ),
        (
            "drift:temperature@30+20",
            "bad anomaly 'drift:temperature@30+20': drift needs a magnitude (append xMAGNITUDE)",
        ),
        (
            "stuck:speed@30+20x5",
            "bad anomaly 'stuck:speed@30+20x5': stuck takes no magnitude (drop 'x5')",
        ),
        (
            "drift:temperature@30+20xabc",
            "bad anomaly 'drift:temperature@30+20xabc': magnitude 'abc' is not a number",
        ),
        (
            "drift:temperature@30+0x5",
            "bad anomaly 'drift:temperature@30+0x5': anomaly duration 0.0 s must be > 0",
        ),
        (
            "noise:current@1+2x-3",
            "bad anomaly 'noise:current@1+2x-3': noise magnitude -3.0 is a std multiplier and "
            "must be >= 0",
        ),
    ],
)
def test_parse_anomaly_rejects(text: str, message: str) -> None:
    with pytest.raises(DriverConfigError) as caught:
        parse_anomaly(text)
    assert str(caught.value) == message


def test_anomaly_validates_its_fields() -> None:
    with pytest.raises(DriverConfigError, match="anomaly start -1 s must be >= 0"):
        Anomaly("drift", "current", -1, 5, 1)
    with pytest.raises(DriverConfigError, match="anomaly magnitude inf must be finite"):
        Anomaly("drift", "current", 1, 5, math.inf)
