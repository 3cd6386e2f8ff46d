"""Modbus TCP/RTU polling. pymodbus is imported only in :mod:`drivers.modbus.client`."""
