"""Judging a probation: pure, from what the agent observed and the clock.

The new version passes only on evidence: by the deadline it must have scored at least
``min_windows`` windows with the model, raised no inference error, kept the reasoning
stage's P99 under the manifest's ``p99_us`` and within ``regression_pct`` of the same
device's P99 before the update, kept resident memory within ``memory_pct`` of its
baseline, and answered the health API. No signal is a failure, never a pass.

Why the regression rule compares medians: :func:`judge`; a probation that cannot be
scored is refused up front: :func:`unreachable`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ota.manifest import Probation

#: The regression rule judges a median of at least this many windows; fewer is noise.
REGRESSION_MIN_WINDOWS = 20

#: This many failed health checks in a row fail the probation before its deadline.
HEALTH_STREAK = 3

#: Median differences below this are not called a regression, whatever the percentage.
SLACK_US = 50.0


@dataclass(frozen=True)
class Baseline:
    """The device before the update: reasoning latency per window and resident memory."""

    p50_us: float | None
    rss_bytes: int | None
    #: reported to the fleet (its regression check), not judged here
    p99_us: float | None = None


@dataclass(frozen=True)
class Observation:
    """What the agent saw since the new version went live."""

    windows: int
    model_runs: int
    errors: int
    p50_us: float | None
    p99_us: float | None
    rss_bytes: int | None
    health_ok: int
    health_failed: int
    #: consecutive failed health checks up to now (0: the last one answered)
    health_streak: int = 0
    last_error: str = ""
    #: windows the reasoning stage's breaker kept the new version out of (over its
    #: latency budget), when the old version was not degraded before the update
    degraded: int = 0


Verdict = Literal["pending", "pass", "fail"]

#: Relative float slack in the window arithmetic: 7 s at 10/7 windows/s is 10 windows.
_EPS = 1e-9


def min_seconds(min_windows: int, windows_per_s: float) -> int:
    """The shortest whole-second probation that scores ``min_windows`` at this rate.

    Windows close every ``1 / windows_per_s`` seconds, so any span of ``T`` seconds holds
    at least ``floor(T * windows_per_s)`` of them.
    """
    return max(1, math.ceil(min_windows / windows_per_s * (1 - _EPS)))


def unreachable(
    limits: Probation, windows_per_s: float, *, where: str = "", raise_what: str = ""
) -> str:
    """Why ``limits`` cannot pass on a device that scores ``windows_per_s``, or ``""``.

    ``where`` follows the rate (" on this device"); ``raise_what`` names the knob in the
    advice (default ``probation.seconds``; the fleet's CLI says ``--probation-seconds``).

    A probation that cannot score ``min_windows`` at the device's window rate could only end
    in "no signal"; :func:`unreachable` says so up front, so such a bundle is refused before it
    is staged (and at ``fleet bundle build`` when the target's rate is known), never rolled
    back after the fact.
    """
    expected = limits.seconds * windows_per_s
    if expected >= limits.min_windows * (1 - _EPS):
        return ""
    need = min_seconds(limits.min_windows, windows_per_s)
    return (
        f"probation {limits.seconds} s scores ~{expected:.1f} windows at "
        f"{windows_per_s:.3g} windows/s{where}; at least {limits.min_windows} needed: raise "
        f"{raise_what or 'probation.seconds'} to >= {need}"
    )


def judge(
    obs: Observation,
    baseline: Baseline,
    limits: Probation,
    *,
    started_ns: int,
    now_ns: int,
) -> tuple[Verdict, str]:
    """``("pending", "")`` until the deadline unless a hard limit already failed.

    The regression rule compares *medians* per window (the new version's over the probation
    against the device's own over its last windows before the update), with an absolute slack
    (:data:`SLACK_US`). A probation of a few seconds sees a few to a few hundred windows: their
    P99 is their maximum, one scheduler hiccup, and a 50 µs stage on a shared gateway moves by
    more than 15 % from one second to the next anyway; rolling back on that noise would make
    every update a coin toss. A model that really is slower (the demo's broken v3) moves the
    median by far more. Below :data:`REGRESSION_MIN_WINDOWS` windows the rule is not judged
    (the pass says so): an agent that makes one window every 0.64 s needs a probation of
    13 s or more for it. The manifest's ``p99_us`` stays a hard limit on the P99.
    """
    if obs.errors:
        return "fail", f"inference failed {obs.errors} time(s): {obs.last_error}".rstrip(": ")
    enough = obs.model_runs >= limits.min_windows
    if enough and limits.p99_us and obs.p99_us is not None and obs.p99_us > limits.p99_us:
        return "fail", (
            f"reasoning P99 {obs.p99_us:.0f} µs is over the bundle's limit of {limits.p99_us} µs"
        )
    if obs.health_streak >= HEALTH_STREAK:
        return "fail", f"health API silent during probation ({obs.health_streak} checks in a row)"
    if obs.degraded:
        # Over the stage's budget so often that the breaker ran it on fewer windows: a
        # regression, however few windows it then scored (the median rule needs 20).
        return "fail", (
            f"latency regression: the reasoning stage went over its budget and its breaker "
            f"kept the new version out of {obs.degraded} window(s)"
        )
    if now_ns - started_ns < limits.seconds * 1_000_000_000:
        return "pending", ""
    if not enough:
        return "fail", (
            f"no signal: {obs.model_runs} window(s) scored by the new version in "
            f"{limits.seconds} s; at least {limits.min_windows} needed"
        )
    if obs.health_ok == 0 or obs.health_streak:
        return "fail", (
            f"health API silent during probation ({obs.health_failed} failed check(s), "
            f"{obs.health_ok} answered, the last one {'failed' if obs.health_streak else 'ok'})"
        )
    judged = obs.model_runs >= REGRESSION_MIN_WINDOWS
    if judged and obs.p50_us is not None and baseline.p50_us is not None:
        allowed = max(
            baseline.p50_us * (1 + limits.regression_pct / 100), baseline.p50_us + SLACK_US
        )
        if obs.p50_us > allowed:
            return "fail", (
                f"latency regression: reasoning median {obs.p50_us:.0f} µs per window against "
                f"{baseline.p50_us:.0f} µs before the update (allowed {allowed:.0f} µs: "
                f"+{limits.regression_pct} %)"
            )
    if obs.rss_bytes is not None and baseline.rss_bytes:
        allowed_rss = baseline.rss_bytes * (1 + limits.memory_pct / 100)
        if obs.rss_bytes > allowed_rss:
            return "fail", (
                f"memory regression: {obs.rss_bytes / 2**20:.1f} MiB resident against "
                f"{baseline.rss_bytes / 2**20:.1f} MiB before the update (+{limits.memory_pct} %)"
            )
    note = "" if judged else " (too few windows to judge a latency regression)"
    return "pass", (
        f"{obs.model_runs} windows{note}, median {obs.p50_us or 0:.0f} µs, "
        f"P99 {obs.p99_us or 0:.0f} µs, health {obs.health_ok} ok"
    )
