"""The one error tree of ``edge_agent``.

::

    AgentError
    └── ConfigError      the config file is wrong; ``errors`` lists every problem found

Errors of the drivers stay in their own tree (:class:`drivers.errors.DriverError`); the
agent reports them per source and keeps running.
"""


class AgentError(Exception):
    """Root of every error raised by ``edge_agent``."""


class ConfigError(AgentError):
    """The config cannot be used. Each entry of ``errors`` names the key path, the bad
    value and what was expected, e.g.
    ``sources.modbus[0].registers[3].type: expected one of 'bool', 'int16', ...; got 'int33'``.
    """

    def __init__(self, source: str, errors: list[str]) -> None:
        self.source = source
        self.errors = errors
        lines = "\n".join(f"  {e}" for e in errors)
        super().__init__(f"{source}: {len(errors)} error(s) in config\n{lines}")
