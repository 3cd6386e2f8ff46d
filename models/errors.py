"""The one error tree of ``models``.

Foreign exceptions (``ValueError``/``RuntimeError`` from an interpreter, ``OSError``,
``json.JSONDecodeError``) are turned into these inside :mod:`models.runtime`.
"""


class ModelError(Exception):
    """Root of every error raised by ``models``.

    ::

        ModelError
        ├── ModelRejected        the artifact cannot be trusted or used: corrupt, truncated or
        │                        oversize file, sha256 or tensor shape/quantization different
        │                        from manifest.json, a manifest key missing or of the wrong type.
        │                        The caller keeps the model it already runs.
        ├── BackendUnavailable   no TFLite interpreter to run it: the requested backend
        │                        (argument or EDGEFLEET_TFLITE_BACKEND) is not installed or unknown
        └── KernelsStopped       the compiled kernels' load was asked to stop (the process is
                                 leaving); nothing was recorded, a later load starts again
    """


class ModelRejected(ModelError):
    """A model directory (manifest.json + model file) failed a check; ``path`` says which."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


class BackendUnavailable(ModelError):
    """The TFLite interpreter backend asked for (or any, when none is) cannot be imported."""


class KernelsStopped(ModelError):
    """:func:`models.kernels.kernels` stopped between two compile steps, as asked."""


__all__ = ["BackendUnavailable", "KernelsStopped", "ModelError", "ModelRejected"]
