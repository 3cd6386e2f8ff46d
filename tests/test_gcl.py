"""The gate control list: validation messages, timeline math and the taprio command."""

from typing import Any

import pytest
from pydantic import ValidationError

from edge_agent.errors import ConfigError
from edge_agent.gcl import (
    STAGES,
    GateControlList,
    GateEntry,
    ScheduleSection,
    format_command,
    render_taprio,
    window_close_phase_ns,
)

MS = 1_000_000


def three() -> list[dict[str, Any]]:
    """Three entries, one per stage, over the default classes (a fresh copy to edit)."""
    return [
        {"name": "sense", "duration_us": 3_000, "gates": ["perception", "best_effort"]},
        {"name": "store", "duration_us": 3_000, "gates": ["memory"]},
        {"name": "think", "duration_us": 4_000, "gates": ["reasoning", "uplink", "best_effort"]},
    ]


def section(**overrides: Any) -> ScheduleSection:
    return ScheduleSection.model_validate({"cycle_us": 10_000, "entries": three(), **overrides})


def errors_of(**overrides: Any) -> list[str]:
    return section(**overrides).check()


def test_defaults_are_valid_and_match_the_design() -> None:
    s = ScheduleSection()
    assert s.check() == []
    assert s.notes(rate_hz=100.0) == []
    gcl = GateControlList.from_section(s)
    assert [(e.name, e.offset_ns, e.duration_ns, e.mask) for e in gcl.entries] == [
        ("compute", 0, 6 * MS, 0b01),
        ("uplink", 6 * MS, 4 * MS, 0b11),
    ]
    assert gcl.entries[0].stages == STAGES
    assert gcl.entries[1].stages == ()
    assert [(c.name, c.priority, c.queues) for c in gcl.classes] == [
        ("best_effort", 0, 1),
        ("uplink", 3, 1),
    ]
    assert (gcl.cycle_ns, gcl.base_time_ns, gcl.spin_ns) == (10 * MS, 0, 200_000)
    assert gcl.priority("uplink") == 3


def test_durations_must_sum_to_the_cycle() -> None:
    assert errors_of(cycle_us=12_000) == [
        "schedule.entries: durations sum to 10000 us; expected cycle_us (12000 us)"
    ]


def test_every_stage_needs_a_window() -> None:
    entries = three()
    entries[1]["gates"] = ["best_effort"]
    assert errors_of(entries=entries) == [
        "schedule.entries: stage 'memory' has no entry; "
        "expected at least one entry whose gates include 'memory'"
    ]


def test_every_traffic_class_needs_a_window() -> None:
    entries = three()
    entries[2]["gates"] = ["reasoning", "best_effort"]
    assert errors_of(entries=entries) == [
        "schedule.entries: traffic class 'uplink' has no entry; "
        "expected at least one entry whose gates include 'uplink'"
    ]


def test_zero_length_entry_is_named() -> None:
    entries = [
        {"name": "sense", "duration_us": 6_000, "gates": ["perception", "best_effort"]},
        {"name": "store", "duration_us": 0, "gates": ["memory"]},
        {"name": "think", "duration_us": 4_000, "gates": ["reasoning", "uplink"]},
    ]
    assert errors_of(entries=entries) == [
        "schedule.entries[1].duration_us: zero-length entry 'store'; expected > 0"
    ]


def test_unknown_gate_names_the_entry_and_the_gate() -> None:
    entries = three()
    entries[2]["gates"] = ["reasonin", "uplink", "best_effort"]
    errors = errors_of(entries=entries)
    assert errors[0] == (
        "schedule.entries[2].gates: unknown gate 'reasonin'; expected one of "
        "perception, memory, reasoning, best_effort, uplink (entry 'think')"
    )
    # ... and, as a consequence, reasoning never runs.
    assert errors[1:] == [
        "schedule.entries: stage 'reasoning' has no entry; "
        "expected at least one entry whose gates include 'reasoning'"
    ]


def test_a_gate_listed_twice() -> None:
    entries = three()
    entries[1]["gates"] = ["memory", "memory"]
    assert errors_of(entries=entries) == [
        "schedule.entries[1].gates: gate 'memory' is listed twice (entry 'store')"
    ]


def test_entry_names_are_unique() -> None:
    entries = three()
    entries[2]["name"] = "sense"
    assert errors_of(entries=entries) == [
        "schedule.entries[2].name: 'sense' is already used by schedule.entries[0]"
    ]


def test_class_names_unique_not_a_stage_and_one_per_priority() -> None:
    tsn = {
        "classes": [
            {"name": "best_effort", "priority": 0},
            {"name": "uplink", "priority": 3},
            {"name": "uplink", "priority": 4},
            {"name": "memory", "priority": 3},
        ]
    }
    assert errors_of(tsn=tsn) == [
        "schedule.tsn.classes[2].name: 'uplink' is already used by schedule.tsn.classes[1]",
        "schedule.tsn.classes[3].name: 'memory' is a pipeline stage; "
        "expected a name other than perception, memory, reasoning",
        "schedule.tsn.classes[3].priority: 3 is already used by schedule.tsn.classes[1] "
        "('uplink'); expected one class per priority",
    ]


def test_too_many_queues() -> None:
    tsn = {
        "classes": [
            {"name": "best_effort", "priority": 0, "queues": 10},
            {"name": "uplink", "priority": 3, "queues": 7},
        ]
    }
    assert errors_of(tsn=tsn) == [
        "schedule.tsn.classes: 17 TX queues in total; expected at most 16"
    ]


def test_cycle_range_and_base_time() -> None:
    entries = [
        {"name": "all", "duration_us": 50, "gates": [*STAGES, "best_effort", "uplink"]},
    ]
    assert errors_of(cycle_us=50, entries=entries, base_time_ns=-1) == [
        "schedule.cycle_us: expected between 100 and 1000000 (100 us to 1 s); got 50",
        "schedule.base_time_ns: expected >= 0; got -1",
    ]


def test_schema_rejects_wrong_types_and_unknown_keys() -> None:
    with pytest.raises(ValidationError) as info:
        ScheduleSection.model_validate({"cycle_us": "10000", "colour": 1, "spin_us": 5000})
    locs = sorted(tuple(map(str, e["loc"])) for e in info.value.errors())
    assert locs == [("colour",), ("cycle_us",), ("spin_us",)]


def test_from_section_refuses_an_invalid_schedule() -> None:
    with pytest.raises(ConfigError) as info:
        GateControlList.from_section(section(cycle_us=12_000))
    assert info.value.errors == [
        "schedule.entries: durations sum to 10000 us; expected cycle_us (12000 us)"
    ]


def test_hand_built_lists_must_tile_the_cycle() -> None:
    gap = GateEntry("a", 0, 4 * MS, frozenset({"perception"}), 0)
    late = GateEntry("b", 5 * MS, 5 * MS, frozenset({"memory"}), 0)
    with pytest.raises(ValueError, match="expected offset 4000000 ns"):
        GateControlList(10 * MS, 0, (gap, late), ())


def test_notes_warn_about_cycles_that_do_not_divide_a_second() -> None:
    everything = [*STAGES, "best_effort", "uplink"]
    s = ScheduleSection.model_validate(
        {"cycle_us": 3_000, "entries": [{"name": "x", "duration_us": 3_000, "gates": everything}]}
    )
    assert s.check() == []
    assert s.notes() == [
        "schedule.cycle_us: 3000 does not divide 1 s, so taprio (CLOCK_TAI) and the agent "
        "(CLOCK_REALTIME) run the schedule 1000 us apart; pick a cycle that divides 1000000"
    ]
    assert len(s.notes(rate_hz=100.0)) == 2
    realtime = s.model_copy(update={"tsn": s.tsn.model_copy(update={"clockid": "CLOCK_REALTIME"})})
    assert realtime.notes() == []


# -- timeline ---------------------------------------------------------------------------------

BASE = 1_700_000_000_000_000_000 + 4 * MS


def gcl3() -> GateControlList:
    return GateControlList.from_section(section(base_time_ns=BASE))


def test_cycle_start_after_and_before_the_base() -> None:
    g = gcl3()
    assert g.cycle_start(BASE) == BASE
    assert g.cycle_start(BASE + 10 * MS - 1) == BASE
    assert g.cycle_start(BASE + 10 * MS) == BASE + 10 * MS
    assert g.cycle_start(BASE - 1) == BASE - 10 * MS
    assert g.cycle_start(BASE - 10 * MS) == BASE - 10 * MS
    assert g.cycle_start(BASE - 25 * MS) == BASE - 30 * MS


def test_next_opening_walks_entries_and_crosses_cycles() -> None:
    g = gcl3()
    names = [e.name for e in g.entries]
    assert names == ["sense", "store", "think"]
    open_ns, close_ns, entry = g.next_opening(BASE)
    assert (open_ns - BASE, close_ns - BASE, entry.name) == (0, 3 * MS, "sense")
    open_ns, close_ns, entry = g.next_opening(BASE + 1)
    assert (open_ns - BASE, close_ns - BASE, entry.name) == (3 * MS, 6 * MS, "store")
    open_ns, close_ns, entry = g.next_opening(BASE + 6 * MS + 1)
    assert (open_ns - BASE, close_ns - BASE, entry.name) == (10 * MS, 13 * MS, "sense")
    # Before the base the schedule runs as if it had always been running.
    open_ns, close_ns, entry = g.next_opening(BASE - 5 * MS)
    assert (open_ns - BASE, close_ns - BASE, entry.name) == (-4 * MS, 0, "think")
    # Walking close to close visits every entry once per cycle, in order.
    cursor, seen = BASE, []
    for _ in range(7):
        open_ns, cursor, entry = g.next_opening(cursor)
        seen.append((open_ns - BASE) // MS)
    assert seen == [0, 3, 6, 10, 13, 16, 20]


def test_current_entry() -> None:
    g = gcl3()
    assert g.current(BASE)[2].name == "sense"
    o, c, e = g.current(BASE + 5 * MS)
    assert (o - BASE, c - BASE, e.name) == (3 * MS, 6 * MS, "store")
    o, c, e = g.current(BASE - 1)
    assert (o - BASE, c - BASE, e.name) == (-4 * MS, 0, "think")
    assert g.current(BASE + 6 * MS)[2].name == "think"


def test_gates_of_and_priority() -> None:
    g = gcl3()
    assert [e.name for e in g.gates_of("best_effort")] == ["sense", "think"]
    assert [e.name for e in g.gates_of("memory")] == ["store"]
    assert g.priority("best_effort") == 0
    with pytest.raises(KeyError, match="no traffic class 'video'"):
        g.priority("video")


def test_default_base_is_the_window_close_phase() -> None:
    assert window_close_phase_ns(10 * MS, lateness_ms=20.0) == 0
    assert window_close_phase_ns(10 * MS, lateness_ms=23.5) == 3_500_000
    g = GateControlList.from_section(section(), default_base_ns=3_500_000)
    assert g.base_time_ns == 3_500_000
    assert (
        GateControlList.from_section(section(base_time_ns=7), default_base_ns=5).base_time_ns == 7
    )


# -- taprio ------------------------------------------------------------------------------------


def test_render_default_list_exactly() -> None:
    g = GateControlList.from_section(ScheduleSection(), default_base_ns=1_000_000)
    assert format_command(render_taprio(g)) == (
        "tc qdisc replace dev eth0 parent root handle 100 taprio num_tc 2 "
        "map 0 0 0 1 0 0 0 0 0 0 0 0 0 0 0 0 queues 1@0 1@1 base-time 1000000 "
        "sched-entry S 01 6000000 sched-entry S 03 4000000 clockid CLOCK_TAI"
    )
    assert render_taprio(g, "enp3s0")[4] == "enp3s0"


def test_render_three_classes_map_queues_and_masks() -> None:
    s = ScheduleSection.model_validate(
        {
            "cycle_us": 1_000,
            "base_time_ns": 1_528_743_495_910_289_987,
            "entries": [
                {"name": "a", "duration_us": 300, "gates": ["perception", "memory", "bulk"]},
                {"name": "b", "duration_us": 300, "gates": ["reasoning", "control"]},
                {"name": "c", "duration_us": 400, "gates": ["video"]},
            ],
            "tsn": {
                "interface": "enp1s0",
                "clockid": "CLOCK_REALTIME",
                "classes": [
                    {"name": "bulk", "priority": 1, "queues": 2},
                    {"name": "control", "priority": 3},
                    {"name": "video", "priority": 2, "queues": 1},
                ],
            },
        }
    )
    g = GateControlList.from_section(s)
    assert g.priority_map() == (0, 0, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    assert g.tx_queues == 4
    assert format_command(render_taprio(g)) == (
        "tc qdisc replace dev enp1s0 parent root handle 100 taprio num_tc 3 "
        "map 0 0 2 1 0 0 0 0 0 0 0 0 0 0 0 0 queues 2@0 1@2 1@3 "
        "base-time 1528743495910289987 "
        "sched-entry S 01 300000 sched-entry S 02 300000 sched-entry S 04 400000 "
        "clockid CLOCK_REALTIME"
    )


def test_masks_are_hex_with_two_digits_minimum() -> None:
    classes = [{"name": f"c{i}", "priority": i} for i in range(12)]
    entries = [
        {"name": "all", "duration_us": 500, "gates": [*STAGES, *(c["name"] for c in classes)]},
        {"name": "none", "duration_us": 500, "gates": ["memory"]},
    ]
    g = GateControlList.from_section(
        ScheduleSection.model_validate(
            {"cycle_us": 1_000, "entries": entries, "tsn": {"classes": classes}}
        )
    )
    argv = render_taprio(g)
    masks = [argv[i + 2] for i, a in enumerate(argv) if a == "sched-entry"]
    assert masks == ["fff", "00"]
