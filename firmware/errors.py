"""The errors of ``firmware``: leaves of ``ota``'s ``ApplyError`` branch, so one tree (drawn
on :class:`SlotError`). Each class carries ``code`` and ``permanent`` like every
``OtaError``.
"""

from __future__ import annotations

from ota.errors import ActivationError, ApplyError, StorageError


class SlotError(ApplyError):
    """Root of every error raised by ``firmware``'s A/B slots and boot launcher.

    ::

        ota.ApplyError
         ├── firmware.SlotError          root of everything firmware raises (catch-all for slots)
         │
         ├── ota.StorageError
         │    ├── StagingError           (also a SlotError) installing a wheel into the inactive
         │    │    │                     slot failed; the staging dir is gone, nothing else changed
         │    │    ├── WheelRefused      a member is unsafe or the wheel is not an agent build
         │    │    │                     (path, type, size, zip bomb, version); ``permanent``
         │    │    └── SlotBusy          the active build is still on probation: its rollback
         │    │                          target lives in the inactive slot
         │    └── StateFileError         (also a SlotError) state.json is unreadable, corrupt or
         │                               cannot be written
         └── ota.ActivationError
              ├── SlotNotReady           (also a SlotError) activate / mark_good / rollback asked
              │                          for a slot or state that does not allow it
              └── RollbackUnavailable    (also a SlotError) no usable previous slot: the device
                                         stayed on the current one and recorded why
    """

    code = "slot"


class StagingError(SlotError, StorageError):
    """A wheel could not be staged into the inactive slot (disk full, I/O, unsafe member).

    The staging directory has been removed; the active slot and state.json are untouched.
    """

    code = "staging"


class WheelRefused(StagingError):
    """The wheel is unsafe to unpack or is not an agent build; the same wheel never will be."""

    code = "wheel_refused"
    permanent = True


class SlotBusy(StagingError):
    """The active build is on probation (``trying``); the inactive slot is its way back."""

    code = "slot_busy"


class StateFileError(SlotError, StorageError):
    """state.json is unreadable, corrupt (syntax, schema, invariants) or cannot be written."""

    code = "slot_state"


class SlotNotReady(SlotError, ActivationError):
    """The slot or the state does not allow the step (e.g. activating an empty slot)."""

    code = "slot_not_ready"


class RollbackUnavailable(SlotError, ActivationError):
    """Rollback was asked for but the previous slot is missing, empty or damaged.

    The device stays on the current slot (marked ``bad``, reason in state.json) rather than
    flipping to nothing; ``reason`` says why, for the status report.
    """

    code = "rollback_unavailable"
    permanent = True

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
