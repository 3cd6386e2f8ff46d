"""The one error tree of ``edge_agent``, drawn on its root :class:`AgentError`.

Errors of the drivers stay in their own tree (:class:`drivers.errors.DriverError`); the
agent reports them per source and keeps running.
"""


class AgentError(Exception):
    """Root of every error raised by ``edge_agent``.

    ::

        AgentError
        ├── ConfigError      the config file is wrong; ``errors`` lists every problem found
        ├── ReasoningError   the model cannot serve this agent: it failed to load, or it does
        │   │                not fit the perception signals / window / rules
        │   ├── ModelMismatch  the model does not fit (signals, window, rate, rule labels);
        │   │                  a swap is refused and the old model keeps serving
        │   └── RulesError     a rule names a label or signal the model or perception lacks
        ├── ServiceError     a service the agent needs cannot start (the health API's port
        │                    is taken); fatal at start, with this message
        ├── StatePathError   a folder or file the config makes the agent write cannot be made
        │                    or written (``agent.state_dir`` under /proc, a file in its place)
        └── ProbeError       (also a ValueError) a health probe sent by a client is malformed;
            │                ``where`` is the JSON path of the fault (``payload.current``)
            └── ProbeTooLarge  its body is over the size cap (HTTP 413 rather than 400)

    ``ProbeError`` is the client's fault, not the agent's: the health API answers it with 400
    (or 413) and the agent carries on.
    """


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


class ServiceError(AgentError):
    """The agent cannot start one of its services (at start: fatal, with this message)."""


class StatePathError(AgentError):
    """A place the agent writes cannot be used; the message is one line, the config key
    first (``agent.state_dir: cannot create /proc/x: ...``). Fatal at start."""


class ReasoningError(AgentError):
    """The reasoning stage cannot run with this model (at start: fatal, with this message)."""


class RulesError(ReasoningError):
    """The rules do not fit the model or the perception signals (unknown label or signal)."""


class ModelMismatch(ReasoningError):
    """A model does not fit this agent: signals, window, rate or rule labels differ.

    Raised by :meth:`edge_agent.reasoning.ReasoningStage.prepare` (so by a swap, too); the
    serving model stays.
    """


class SelfTestFailed(ReasoningError):
    """A model gave wrong answers for its golden windows on every kernel set the runtime
    has (:mod:`models.selftest`): it is not served. At start the agent exits 2; a hot swap
    or an OTA install keeps the serving model."""


class ProbeError(AgentError, ValueError):
    """A health probe cannot be accepted; ``where`` names the faulty part of its JSON body.

    ``where`` is ``body`` for the body as a whole (size, encoding, syntax, not an object),
    a top-level key (``timestamp_ns``) or a dotted path into the payload (``payload.current``).
    """

    def __init__(self, where: str, message: str) -> None:
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}")


class ProbeTooLarge(ProbeError):
    """The probe's body is larger than the configured cap; it was not parsed."""
