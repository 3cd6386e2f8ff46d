"""The interface every source implements, and the factory that picks one by spec.

Modules that import python-can / cantools / pymodbus are imported only when a source of
that kind is opened (python-can's ``BACKENDS`` pattern), so a Modbus-only gateway never
loads cantools.
"""

from collections.abc import Mapping
from importlib import import_module
from typing import Protocol, runtime_checkable

from drivers.buffer import SampleBuffer
from drivers.specs import CanSpec, ModbusSpec, ReplaySpec

SourceSpec = CanSpec | ModbusSpec | ReplaySpec


@runtime_checkable
class Source(Protocol):
    """A producer of samples.

    ``run`` puts samples into ``sink`` until it is cancelled. It handles its own faults
    (reconnect, backoff) and raises only :class:`drivers.errors.DriverError` for faults it
    cannot ride out, e.g. a DBC that disappeared. ``stats`` is a flat snapshot of counters
    (frames, errors, reconnects ...) for logs, ``/v1/status`` and metrics, with ``up``: 1
    while the source reaches what it reads (a bus open, a unit answering, a capture read),
    0 otherwise, whatever came in before; and, for a source that rides faults out,
    ``last_error``: the latest of them.
    """

    name: str

    async def run(self, sink: SampleBuffer) -> None: ...

    def stats(self) -> Mapping[str, int | float | str]: ...


# spec type -> (module, class); the module is imported on first use.
_BACKENDS: dict[type[object], tuple[str, str]] = {
    CanSpec: ("drivers.can.reader", "CanSource"),
    ModbusSpec: ("drivers.modbus.poller", "ModbusSource"),
    ReplaySpec: ("drivers.can.replay", "ReplaySource"),
}


def open_source(spec: SourceSpec) -> Source:
    """Build the source for ``spec``. Raises ``DriverConfigError`` for an unusable spec."""
    module_name, class_name = _BACKENDS[type(spec)]
    cls = getattr(import_module(module_name), class_name)
    source = cls(spec)
    assert isinstance(source, Source)
    return source
