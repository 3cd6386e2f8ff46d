"""Stop early, with one line, on a Python older than the project needs."""

import sys

if sys.version_info < (3, 11):  # noqa: UP036 - this script runs before the venv exists
    sys.exit(
        f"EdgeFleet needs Python >= 3.11, this is {sys.version.split()[0]}; "
        "run: sudo apt-get install -y python3.11 python3.11-venv, then make PYTHON=python3.11"
    )
