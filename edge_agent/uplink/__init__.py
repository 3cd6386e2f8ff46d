"""Device-side MQTT uplink: a durable outbox drained to the broker with QoS 1.

:mod:`.config` holds the ``[uplink]`` section, :mod:`.outbox` the SQLite outbox and the
boot session (``boot_id``/``seq``), :mod:`.publisher` the :class:`Uplink` service.
"""
