"""Field-bus drivers: the only package that imports python-can, cantools and pymodbus.

Everything a driver hands out is ours: :class:`Sample` values into a bounded
:class:`SampleBuffer`, and errors from the :class:`DriverError` tree. No exception of
python-can, cantools or pymodbus leaves this package.
"""

from drivers.buffer import SampleBuffer
from drivers.errors import DriverError
from drivers.sample import Sample

__all__ = ["DriverError", "Sample", "SampleBuffer"]
