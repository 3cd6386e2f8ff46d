"""The reasoning stage's circuit breaker: a pure state machine over measured latencies.

The stage has a latency budget per window (``budget_ms`` in the config). Falling behind is
worse than answering with less: windows would queue up, go stale, and be dropped anyway.
So when the stage overruns its budget ``trip_after`` windows in a row, the breaker *opens*
and the model stops running on every window, until it is fast again (the modes and the
table: :class:`Breaker`). No clock: latencies are arguments.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from edge_agent.rules import Mode

DegradedMode = Literal["every_k", "rules_only"]


@dataclass(frozen=True, slots=True)
class BreakerSpec:
    """Budget and thresholds; see the module docstring."""

    budget_us: float = 2000.0
    trip_after: int = 3
    recover_after: int = 5
    mode: DegradedMode = "every_k"
    k: int = 4
    probe_every: int = 10

    def __post_init__(self) -> None:
        if self.budget_us <= 0:
            raise ValueError(f"budget_us must be > 0, got {self.budget_us}")
        if self.trip_after < 1 or self.recover_after < 1:
            raise ValueError("trip_after and recover_after must be >= 1")
        if self.k < 2 or self.probe_every < 2:
            raise ValueError("k and probe_every must be >= 2 (1 would never degrade anything)")

    @property
    def run_every(self) -> int:
        """While open: the model runs on one window in this many."""
        return self.k if self.mode == "every_k" else self.probe_every


class State(enum.Enum):
    CLOSED = "closed"  # the model runs on every window
    OPEN = "open"  # degraded: the model runs on one window in ``run_every``


class Outcome(enum.Enum):
    UNDER = "under"  # the model ran within budget
    OVER = "over"  # the model ran and the stage overran its budget
    SKIPPED = "skipped"  # the model did not run (open breaker): no latency evidence
    #: the model ran while the agent itself was warming up (its compiled kernels loading
    #: beside the pipeline): a slow window then says nothing about the model
    EXCUSED = "excused"


#: (state, outcome) -> (next state, what happens to the counters). The counter actions:
#: ``reset`` zeroes the streak, ``count`` extends it; the streak counts overruns while
#: closed and in-budget runs while open. Reaching the limit flips the state (see Breaker).
_TRANSITIONS: Mapping[tuple[State, Outcome], tuple[State, str]] = {
    (State.CLOSED, Outcome.UNDER): (State.CLOSED, "reset"),
    (State.CLOSED, Outcome.OVER): (State.CLOSED, "count"),
    # The caller runs the model on every window while closed; a skip is its own choice
    # (e.g. no model loaded) and says nothing about latency.
    (State.CLOSED, Outcome.SKIPPED): (State.CLOSED, "keep"),
    (State.OPEN, Outcome.UNDER): (State.OPEN, "count"),
    (State.OPEN, Outcome.OVER): (State.OPEN, "reset"),
    (State.OPEN, Outcome.SKIPPED): (State.OPEN, "keep"),
    (State.CLOSED, Outcome.EXCUSED): (State.CLOSED, "keep"),
    (State.OPEN, Outcome.EXCUSED): (State.OPEN, "keep"),
}


class Breaker:
    """Mutable but pure: fed latencies, it answers whether to run the model and the mode.

    Open, by ``mode``:

    * ``every_k``: the model scores every ``k``-th window; the others get rules only;
    * ``rules_only``: the model scores only a probe window every ``probe_every`` windows,
      just enough to notice when it is fast again; every other window gets rules only.

    While open, every model run is a probe: ``recover_after`` runs in a row within budget close
    the breaker again (one overrun starts the count over). The table :data:`_TRANSITIONS` is
    the whole machine; the caller asks :meth:`Breaker.should_run` before a window and reports
    the outcome with :meth:`Breaker.record` after it. No clock: latencies are arguments.

    ::

        closed ──over x trip_after──> open ──under x recover_after (model runs only)──> closed
    """

    def __init__(self, spec: BreakerSpec) -> None:
        self.spec = spec
        self.state = State.CLOSED
        self.streak = 0
        self.since_run = 0
        self.trips = 0
        self.recoveries = 0
        self.overruns = 0  # total windows over budget, whatever the state
        self.excused = 0  # of those, the ones run while warming (not fed to the machine)

    @property
    def mode(self) -> Mode:
        """``full`` while closed, else the configured degraded mode."""
        return "full" if self.state is State.CLOSED else self.spec.mode

    def should_run(self) -> bool:
        """Whether the model should score the next window."""
        if self.state is State.CLOSED:
            return True
        return self.since_run + 1 >= self.spec.run_every

    def record(self, latency_us: float | None, *, warming: bool = False) -> Mode:
        """Report one window: the stage's latency if the model ran, None if it did not.

        ``warming``: the agent's own start-up work ran beside this window (see
        :attr:`Outcome.EXCUSED`); an overrun is counted (``overruns``, ``excused``) but
        neither trips nor holds open the breaker. Returns the mode for the *next* window.
        """
        if (
            self.state is State.CLOSED
            and self.streak == 0
            and latency_us is not None
            and latency_us <= self.spec.budget_us
        ):
            # The steady state, every window: closed, in budget, nothing counted. The
            # table below would keep it as it is.
            self.since_run = 0
            return "full"
        if latency_us is None:
            outcome = Outcome.SKIPPED
            self.since_run += 1
        else:
            over = latency_us > self.spec.budget_us
            outcome = Outcome.OVER if over else Outcome.UNDER
            self.overruns += over
            self.since_run = 0
            if warming and over:
                outcome = Outcome.EXCUSED
                self.excused += 1
        state, action = _TRANSITIONS[(self.state, outcome)]
        if action == "reset":
            self.streak = 0
        elif action == "count":
            self.streak += 1
        if state is State.CLOSED and self.streak >= self.spec.trip_after:
            state, self.streak, self.since_run = State.OPEN, 0, 0
            self.trips += 1
        elif state is State.OPEN and self.streak >= self.spec.recover_after:
            state, self.streak = State.CLOSED, 0
            self.recoveries += 1
        self.state = state
        return self.mode

    def snapshot(self) -> dict[str, object]:
        """JSON-ready state and counters for ``status()``."""
        return {
            "state": self.state.value,
            "mode": self.mode,
            "streak": self.streak,
            "trips": self.trips,
            "recoveries": self.recoveries,
            "overruns": self.overruns,
            "excused": self.excused,
            "budget_us": self.spec.budget_us,
        }


__all__ = ["Breaker", "BreakerSpec", "DegradedMode", "Outcome", "State"]
