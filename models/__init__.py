"""Model artifacts and the runtime that runs them on a device.

``load_model()`` loads and checks the committed default model (``models/motor_drive``: an
INT8 TFLite anomaly classifier and its ``manifest.json``) or any other model directory;
:mod:`models.errors` holds the error tree. Training (``models.train``) needs TensorFlow and is
never imported here.
"""

from models import errors
from models.runtime import DEFAULT_MODEL_DIR, LoadedModel, ModelManifest, load_model

__all__ = ["DEFAULT_MODEL_DIR", "LoadedModel", "ModelManifest", "errors", "load_model"]
