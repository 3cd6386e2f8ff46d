"""What the tests (and benches) share: real peers, free ports, configs, model copies.

The peers (:mod:`.mosquitto`, :mod:`.modbus_peer`, :mod:`.can_peer`, :mod:`.pg`,
:mod:`.netns`, :mod:`.tcp_proxy`) start real processes or sockets the tests talk to;
``tests/conftest.py`` exposes the common ones as fixtures. Nothing here mocks EdgeFleet's
own code.
"""
