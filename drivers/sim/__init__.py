"""Plant simulators: real Modbus TCP / CAN peers for tests, the demo and training data.

:mod:`drivers.sim.plant` is the pure model (no I/O; cheap to import, safe to use from the
training pipeline). :mod:`drivers.sim.server` puts it on the buses and imports pymodbus,
python-can and cantools, so it is imported only where a simulator is started.
"""

from drivers.sim.plant import (
    ANOMALY_KINDS,
    SIGNALS,
    Anomaly,
    DriveState,
    MotorPlant,
    parse_anomaly,
)

__all__ = ["ANOMALY_KINDS", "SIGNALS", "Anomaly", "DriveState", "MotorPlant", "parse_anomaly"]
