"""CAN: live bus reader and capture replay, both decoding through a DBC.

:mod:`drivers.can.reader` (``CanSource``) and :mod:`drivers.can.replay` (``ReplaySource``)
are imported by :func:`drivers.source.open_source` only when a CAN or replay source is
configured, so this package does not import python-can or cantools itself.
"""
