"""The pure rollout planner: selectors, tiers, cumulative waves, the order per rollout.

The wave sizes are checked against a small reference written here with exact fractions, so
a float rounding in the planner (``ceil(0.1 * 30)`` is 4) shows up as a difference.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from fleet.errors import PlanError
from fleet.rollout.plan import (
    TIERS,
    Candidate,
    parse_fraction,
    parse_selector,
    parse_waves,
    plan,
)

STANDARD = (0.01, 0.1, 0.5, 1.0)


def fleet_of(n: int, *, canary: int = 0, critical: int = 0, site: str = "s1") -> list[Candidate]:
    out = []
    for i in range(n):
        tier = "canary" if i < canary else "critical" if i >= n - critical else "normal"
        out.append(Candidate(f"dev-{i:04d}", site=site, device_type="gw", tier=tier))
    return out


def reference_sizes(n: int, non_critical: int, waves: tuple[str, ...]) -> list[int]:
    """The documented rule with exact arithmetic: wave k brings the total to ceil(pct * n),
    at least one more, never past the non-critical devices before the last wave."""
    sizes, taken = [], 0
    for k, text in enumerate(waves):
        pct = Fraction(text.removesuffix("%")) / 100
        last = k == len(waves) - 1
        target = n if last else min(max(math.ceil(pct * n), taken + 1), non_critical)
        if target > taken:
            sizes.append(target - taken)
            taken = target
    return sizes


# -- selectors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {}),
        ("   ", {}),
        ("site=plant-a", {"site": ("plant-a",)}),
        (
            "site=a,device_type=gw|jetson,group=line.3",
            {"site": ("a",), "device_type": ("gw", "jetson"), "group": ("line.3",)},
        ),
        (" site = a , tier=canary ", {"site": ("a",), "tier": ("canary",)}),
        ("device=*", {"device": ("*",)}),
    ],
)
def test_parse_selector_accepts(text: str, expected: dict[str, tuple[str, ...]]) -> None:
    assert parse_selector(text) == expected


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("site", ["item 1", "'site'"]),
        ("site=a,colour=red", ["item 2", "'colour=red'", "site, device_type"]),
        ("site=a,", ["item 2", "''"]),
        ("site=a,group=", ["item 2", "group", "''"]),
        ("site=a b", ["item 1", "site", "'a b'"]),
        ("site=a,device_type=gw|", ["item 2", "'device_type=gw|'", "value ''"]),
        ("site=a,group=g,site=b", ["item 3", "site", "twice"]),
        ("group=" + "x" * 129, ["item 1", "group"]),
    ],
)
def test_parse_selector_errors_name_the_item(text: str, names: list[str]) -> None:
    with pytest.raises(PlanError) as info:
        parse_selector(text)
    for name in names:
        assert name in str(info.value), (name, str(info.value))


def test_selector_every_key_must_match_and_values_are_alternatives() -> None:
    devices = [
        Candidate("a1", site="a", device_type="gw", group="l1"),
        Candidate("a2", site="a", device_type="jetson", group="l2"),
        Candidate("b1", site="b", device_type="gw", group="l1"),
        Candidate("b2", site="b", device_type="plc", group="", tier="canary"),
    ]
    cases = {
        "": {"a1", "a2", "b1", "b2"},
        "site=a": {"a1", "a2"},
        "site=a,device_type=gw": {"a1"},
        "device_type=gw|plc": {"a1", "b1", "b2"},
        "group=l1,site=b": {"b1"},
        "group=*": {"a1", "a2", "b1", "b2"},
        "tier=canary": {"b2"},
        "device=a2|b2": {"a2", "b2"},
        "site=c": set(),
    }
    for text, want in cases.items():
        waves = plan("r1", devices, parse_selector(text), (1.0,))
        assert {d for w in waves for d in w} == want, text


# -- wave and fraction parsing ---------------------------------------------------------------


def test_parse_waves() -> None:
    assert parse_waves("1%,10%,50%,100%") == STANDARD
    assert parse_waves("100%") == (1.0,)
    assert parse_waves(" 25 , 100 ") == (0.25, 1.0)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("", ["item 1", "percentage"]),
        ("1%,x%,100%", ["item 2", "'x%'"]),
        ("10%,5%,100%", ["item 2", "'5%'", "rise"]),
        ("10%,10%,100%", ["item 2", "rise"]),
        ("0%,100%", ["item 1", "'0%'"]),
        ("50%,150%", ["item 2", "'150%'"]),
        ("nan%,100%", ["item 1"]),
        ("10%,50%", ["last wave must be 100%"]),
    ],
)
def test_parse_waves_errors(text: str, names: list[str]) -> None:
    with pytest.raises(PlanError) as info:
        parse_waves(text)
    for name in names:
        assert name in str(info.value), (name, str(info.value))


def test_parse_fraction() -> None:
    assert parse_fraction("5%", what="--max-failure") == 0.05
    assert parse_fraction("0", what="x") == 0.0
    assert parse_fraction("100%", what="x") == 1.0
    for bad in ("five", "-1%", "101%", "nan"):
        with pytest.raises(PlanError, match="--max-failure"):
            parse_fraction(bad, what="--max-failure")


# -- wave sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "sizes"),
    [
        (1, [1]),
        (5, [1, 1, 1, 2]),
        (7, [1, 1, 2, 3]),
        (100, [1, 9, 40, 50]),
        (1000, [10, 90, 400, 500]),
    ],
)
def test_wave_sizes_standard(n: int, sizes: list[int]) -> None:
    waves = plan("r1", fleet_of(n), {}, STANDARD)
    assert [len(w) for w in waves] == sizes
    assert sum(sizes) == n


@pytest.mark.parametrize(
    ("n", "waves", "sizes"),
    [
        (30, "10%,100%", [3, 27]),
        # 0.07 * 100 is 7.000000000000001 in floats: still 7 devices, not 8.
        (100, "7%,100%", [7, 93]),
        (100, "14%,28%,55%,100%", [14, 14, 27, 45]),
        (3, "10%,20%,30%,100%", [1, 1, 1]),
        (2, "50%,100%", [1, 1]),
    ],
)
def test_wave_sizes_are_exact_percentages(n: int, waves: str, sizes: list[int]) -> None:
    assert [len(w) for w in plan("r1", fleet_of(n), {}, parse_waves(waves))] == sizes


def test_no_devices_no_waves() -> None:
    assert plan("r1", [], {}, STANDARD) == []
    assert plan("r1", fleet_of(5), {"site": ("elsewhere",)}, STANDARD) == []


def test_critical_only_in_the_last_wave_even_when_that_makes_earlier_waves_small() -> None:
    # 3 normal, 7 critical: the early waves may hold at most the 3 normal devices.
    devices = fleet_of(10, critical=7)
    waves = plan("r1", devices, {}, STANDARD)
    assert [len(w) for w in waves] == [1, 1, 1, 7]
    only_critical = plan("r1", fleet_of(4, critical=4), {}, STANDARD)
    assert [len(w) for w in only_critical] == [4]


def test_unknown_tier_is_refused_naming_the_device() -> None:
    devices = [*fleet_of(3), Candidate("odd", site="s1", device_type="gw", tier="Critical")]
    with pytest.raises(PlanError, match=r"odd.*'Critical'"):
        plan("r1", devices, {}, STANDARD)


def test_duplicate_device_is_refused_naming_it() -> None:
    devices = [*fleet_of(3), Candidate("dev-0001", site="s2", device_type="gw")]
    with pytest.raises(PlanError, match="dev-0001"):
        plan("r1", devices, {}, STANDARD)


def _random_waves(rng: random.Random) -> tuple[str, ...]:
    k = rng.randint(1, 6)
    cuts = sorted(rng.sample(range(1, 100), k - 1)) if k > 1 else []
    return (*(f"{c}%" for c in cuts), "100%")


def test_plan_properties_random() -> None:
    """Every device in exactly one wave; tiers in order; criticals last; every wave non-empty;
    sizes as the exact rule says; the same plan for the same rollout id."""
    for seed in range(400):
        rng = random.Random(seed)
        n = rng.choice([1, 2, 3, 5, 7, 13, 50, 100, 257, 1000])
        devices = [
            Candidate(
                f"d{rng.randrange(10**9):09d}-{i}",
                site=rng.choice("ab"),
                device_type="gw",
                tier=rng.choices(TIERS, weights=(1, 8, 2))[0],
            )
            for i in range(n)
        ]
        rng.shuffle(devices)
        wave_text = _random_waves(rng)
        rid = f"rollout-{seed}"
        waves = plan(rid, devices, {}, parse_waves(",".join(wave_text)))
        ctx = (seed, n, wave_text)

        flat = [d for w in waves for d in w]
        assert sorted(flat) == sorted(c.device for c in devices), ctx
        assert len(flat) == len(set(flat)), ctx
        assert all(waves), ctx
        assert len(waves) <= len(wave_text), ctx

        tier = {c.device: TIERS.index(c.tier) for c in devices}
        assert [tier[d] for d in flat] == sorted(tier[d] for d in flat), ctx  # canary first
        for w in waves[:-1]:
            assert all(tier[d] != TIERS.index("critical") for d in w), ctx

        non_critical = sum(c.tier != "critical" for c in devices)
        assert [len(w) for w in waves] == reference_sizes(n, non_critical, wave_text), ctx

        # Stable across calls and input order (a restarted fleet service plans the same).
        again = plan(rid, list(reversed(devices)), {}, parse_waves(",".join(wave_text)))
        assert again == waves, ctx


def test_each_wave_adds_a_device_while_any_are_left() -> None:
    """With no critical device, the plan has one wave per requested wave until every device
    is in: a wave whose percentage rounds to the previous total still takes one device."""
    for n in range(1, 60):
        for wave_text in [("1%", "2%", "3%", "100%"), ("1%", "10%", "50%", "100%")]:
            waves = plan("r", fleet_of(n), {}, parse_waves(",".join(wave_text)))
            assert len(waves) == min(n, len(wave_text)), (n, wave_text)


def test_canary_devices_come_first() -> None:
    devices = fleet_of(100, canary=3, critical=10)
    waves = plan("r1", devices, {}, STANDARD)
    assert len(waves[0]) == 1
    assert waves[0][0] in {"dev-0000", "dev-0001", "dev-0002"}
    assert set(waves[1][:2]) <= {"dev-0000", "dev-0001", "dev-0002"}
    assert set(waves[-1]) >= {f"dev-{i:04d}" for i in range(90, 100)}


def test_order_is_per_rollout_id() -> None:
    devices = fleet_of(50)
    first = {rid: plan(rid, devices, {}, (1.0,))[0] for rid in (f"r{i}" for i in range(20))}
    assert plan("r3", devices, {}, (1.0,))[0] == first["r3"]
    assert len({tuple(order) for order in first.values()}) == 20
    # Not always the same devices in the first 1 % either.
    leaders = {plan(rid, devices, {}, (0.02, 1.0))[0][0] for rid in first}
    assert len(leaders) > 5
