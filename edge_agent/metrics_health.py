"""Prometheus families of the serving model's health (``reasoning.model_health``).

Read from the status at scrape time like every other count (:mod:`edge_agent.metrics`);
kept apart because the model's input contract, its training distribution and its alarm
storms are one idea (:mod:`edge_agent.ood`, :mod:`edge_agent.acquisition`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

_Samples = Iterable[tuple[Sequence[str], Any]]


class Families(Protocol):
    """What :class:`edge_agent.metrics._Out` offers (the families of one scrape)."""

    def counter(self, name: str, doc: str, labels: Sequence[str], samples: _Samples) -> None: ...
    def gauge(self, name: str, doc: str, labels: Sequence[str], samples: _Samples) -> None: ...
    def one_counter(self, name: str, doc: str, raw: Any) -> None: ...
    def one_gauge(self, name: str, doc: str, raw: Any) -> None: ...


def _at(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def health_families(health: Any, out: Families) -> None:
    """The families of ``reasoning.model_health`` (absent keys export nothing)."""
    ood = _at(health, "ood")
    if _at(ood, "checked") is True:
        out.one_gauge(
            "edgefleet_model_out_of_distribution",
            "1 while some model input is outside its training distribution (model labels masked).",
            _at(ood, "active"),
        )
        out.gauge(
            "edgefleet_model_input_flagged_share",
            "Per model input, the share of the recent horizon's windows outside the training "
            "ranges (out of distribution at the on share).",
            ["signal"],
            (((str(s),), v) for s, v in (_at(ood, "flagged_share") or {}).items()),
        )
        out.one_counter(
            "edgefleet_model_out_of_distribution_events_total",
            "model_out_of_distribution notices raised.",
            _at(ood, "events"),
        )
        out.one_counter(
            "edgefleet_model_alarms_masked_total",
            "Windows whose model alarm was masked because the inputs were out of distribution.",
            _at(ood, "masked_alarm_windows"),
        )
    storm = _at(health, "alarm_storm")
    out.one_gauge(
        "edgefleet_model_alarm_storm",
        "1 while the model alarms on most windows (alarm_storm).",
        _at(storm, "active"),
    )
    out.one_gauge(
        "edgefleet_model_alarm_share",
        "The share of the recent horizon's windows the model alarmed on.",
        _at(storm, "share"),
    )
    out.one_counter(
        "edgefleet_model_alarm_storm_events_total",
        "alarm_storm notices raised.",
        _at(storm, "events"),
    )
    status = _at(health, "acquisition", "status")
    if isinstance(status, str):
        out.one_gauge(
            "edgefleet_model_acquisition_mismatch",
            "1 while a model runs whose input contract this config does not meet "
            "([reasoning] acquisition = accept-mismatch).",
            status == "mismatch_accepted",
        )


__all__ = ["Families", "health_families"]
