"""The one error tree of ``ota``, drawn on its root :class:`OtaError`: the root of each
branch says who is at fault.

Every error carries ``code`` (a short stable name for status reports and the fleet's retry
policy) and ``permanent`` (true when retrying the same bundle cannot succeed).
"""

from __future__ import annotations


class OtaError(Exception):
    """Root of every error raised by ``ota``.

    ::

        OtaError
         ├── BundleRejected          the bundle is at fault; never retried (``permanent``)
         │    ├── MalformedBundle    tar layout, sizes, manifest JSON or schema
         │    ├── SignatureInvalid   signatures missing, malformed, unknown keys, threshold unmet
         │    ├── BundleExpired      the manifest's ``expires`` has passed
         │    ├── Incompatible       device type or agent version outside ``compat``
         │    │    ├── ProbationUnreachable  the probation cannot score its minimum number
         │    │    │                 of windows at this device's window rate
         │    │    └── ModelContractUnmet  the model was trained for another acquisition
         │    │                      than this device's config delivers
         │    ├── PermissionDenied   the kind's permission or a ``required_permissions`` entry
         │    │                      is not granted by the device policy
         │    ├── RollbackRejected   ``counter`` below the committed floor of its kind
         │    │    └── AlreadyInstalled  ``counter`` equal to the floor: nothing to do
         │    └── PayloadMismatch    a payload's length or sha256 (or its delta result) differs
         ├── TrustError              the device's trust root is missing, invalid, expired, or a
         │                           new root was refused (the TUF rule); nothing is accepted
         ├── FetchError              the transport failed (transient: retried with backoff)
         │    ├── FetchStalled       no byte arrived within the stall timeout
         │    └── FetchTooLarge      the peer sent more than the declared length (permanent)
         ├── ApplyError              the device could not stage or activate a verified bundle
         │    ├── StorageError       writing the store or a slot failed (disk full, I/O)
         │    └── ActivationError    the new version could not be switched in (load, swap)
         │         └── ModelSelfTestFailed  the model gave wrong answers for its golden
         │                           windows on every kernel set here: never served
         └── IllegalTransition       an event the journal's state does not accept (a bug, or a
                                     stale command); ``ota.machine.step`` raises it
    """

    code = "ota_error"
    permanent = False


class BundleRejected(OtaError):
    """The bundle itself is refused; fetching or applying it again cannot help."""

    code = "rejected"
    permanent = True


class MalformedBundle(BundleRejected):
    """The bundle's layout is wrong: tar members, sizes, manifest syntax or schema."""

    code = "malformed"


class SignatureInvalid(BundleRejected):
    """Signatures are missing or malformed, made by unknown keys, or below the threshold."""

    code = "bad_signature"


class BundleExpired(BundleRejected):
    """The manifest's ``expires`` is in the past."""

    code = "expired"


class Incompatible(BundleRejected):
    """The bundle is not for this device: device type or agent version outside ``compat``."""

    code = "incompatible"


class ProbationUnreachable(Incompatible):
    """The bundle's probation is too short to score ``min_windows`` at this device's window
    rate: it could only end in "no signal", so it is refused before it is staged."""

    code = "probation_unreachable"


class ModelContractUnmet(Incompatible):
    """The bundle's model was trained for inputs this device's config does not deliver
    (its ``training.acquisition`` against the device's sources): refused before it is
    staged, the reason naming each signal. Permanent for this device and config."""

    code = "model_contract"


class PermissionDenied(BundleRejected):
    """The device policy does not grant a permission the bundle requires."""

    code = "permission_denied"


class RollbackRejected(BundleRejected):
    """The bundle's counter is below the committed anti-rollback floor of its kind."""

    code = "downgrade"


class AlreadyInstalled(RollbackRejected):
    """The bundle's counter equals the committed floor: this version is already installed."""

    code = "already_installed"


class PayloadMismatch(BundleRejected):
    """A payload's length or sha256, or the result of its delta patch, is not as declared."""

    code = "payload_mismatch"


class TrustError(OtaError):
    """The trust root is missing, unreadable, invalid or expired, or a rotation was refused.

    Without a trust root the device accepts nothing (fail closed).
    """

    code = "trust"
    permanent = True


class FetchError(OtaError):
    """Fetching a bundle failed in transport: connection, HTTP/CoAP status, resume refused."""

    code = "fetch"


class FetchStalled(FetchError):
    """No data arrived within the stall timeout."""

    code = "fetch_stalled"


class FetchTooLarge(FetchError):
    """The peer sent more bytes than the declared length; the transfer was cut there."""

    code = "fetch_too_large"
    permanent = True


class ApplyError(OtaError):
    """A verified bundle could not be staged or activated on this device."""

    code = "apply"


class StorageError(ApplyError):
    """Writing the content store, the journal or a slot failed (disk full, I/O error)."""

    code = "storage"


class FloorsUnknown(StorageError):
    """The anti-rollback floors could be read from neither the journal nor the floors file:
    every install is refused until an operator restores them (the device, not the bundle,
    is at fault; the same offer succeeds once they are back)."""

    code = "floors_unknown"


class ActivationError(ApplyError):
    """The new version could not be switched in (the model or config did not load)."""

    code = "activation"


class ModelSelfTestFailed(ActivationError):
    """The bundle's model loaded but failed its known-answer self-test (its manifest's
    golden windows, :mod:`models.selftest`) on the delegate and on the builtin kernels:
    refused before probation, the serving model stays. Permanent: the same bundle gives
    the same wrong answers on this device (a corrupt model, or arithmetic this hardware
    or runtime gets wrong)."""

    code = "self_test"
    permanent = True


class IllegalTransition(OtaError):
    """An event that the current state does not accept (a bug, or a stale command)."""

    code = "illegal_transition"
    permanent = True
