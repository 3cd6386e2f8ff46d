"""Telling a running Mosquitto to read its ACL and revocation list again: SIGHUP.

A reload applies the rewritten ACL to every open connection: a device dropped from it can
publish and read nothing from then on, and its next connection is refused by the CRL, while
the rest of the fleet stays connected. Why a reload and not a restart or the dynamic
security plugin: :func:`reload_broker`.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from fleet.errors import PkiError


@dataclass(frozen=True)
class Reload:
    """A broker to reload: ``pid`` for a process signalled directly (checked to be a running
    ``mosquitto``), ``unit`` for a systemd unit. Made by :func:`prepare_reload` before
    anything is changed, so a wrong target is refused while nothing has happened yet."""

    pid: int | None = None
    unit: str | None = None


def prepare_reload(text: str) -> Reload:
    """``pid:1234``, ``pidfile:/run/mosquitto.pid`` or ``systemd:mosquitto``; PkiError for
    anything else, a pid file that cannot be read or a process that is not mosquitto."""
    kind, sep, value = text.partition(":")
    if not sep or not value or kind not in ("pid", "pidfile", "systemd"):
        raise PkiError(
            f"--reload {text!r}: expected pid:PID, pidfile:PATH or systemd:UNIT "
            "(e.g. systemd:mosquitto)"
        )
    if kind == "systemd":
        return Reload(unit=value)
    if kind == "pid":
        if not value.isdigit():
            raise PkiError(f"--reload {text!r}: {value!r} is not a process id")
        pid = int(value)
    else:
        path = Path(value)
        try:
            found = path.read_text().strip()
        except OSError as exc:
            raise PkiError(f"{path}: cannot read the broker's pid file: {exc.strerror}") from exc
        if not found.isdigit():
            raise PkiError(f"{path}: not a pid file (it holds {found[:40]!r})")
        pid = int(found)
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except FileNotFoundError:
        raise PkiError(f"--reload {text!r}: no process {pid}; is the broker running?") from None
    except OSError:
        name = "mosquitto"  # no /proc to ask: trust the operator's pid
    if name != "mosquitto":
        raise PkiError(f"--reload {text!r}: process {pid} is {name!r}, not mosquitto")
    return Reload(pid=pid)


def reload_broker(target: Reload) -> str:
    """Make the broker read its config, ACL and CRL again; returns what was done, for the
    operator. PkiError if it could not be done.

    Why a reload and not a restart or the dynamic security plugin (measured on Mosquitto
    2.0.11, ``tests/test_fleet_broker.py``): a reload applies the rewritten ACL to every
    connection already open, so a device dropped from it gets PUBACK 135 (not authorized) for
    its very next publish and nothing it sends after the reload reaches a subscriber, while
    every other device and the ingest stay connected and lose nothing. A restart would cut
    off the whole fleet to stop one device (every agent reconnecting, the ingest's shared
    subscriptions gone until it resubscribes). The dynamic security plugin
    (``mosquitto_dynamic_security.so``, shipped with 2.0.11) could disconnect the client as
    well, but it would replace the ACL file with a JSON store edited over ``$CONTROL`` by an
    admin identity with a password: a second source of truth for who may publish where, next
    to the CA's register this module derives the ACL from.

    The revoked device stays connected (the CRL is checked only at a handshake) but can
    publish and read nothing; its next connection is refused by the CRL.
    """
    if target.unit is not None:
        cmd = ["systemctl", "reload", target.unit]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PkiError(f"{' '.join(cmd)}: {exc}") from None
        if done.returncode != 0:
            why = (done.stderr or done.stdout).strip().splitlines()
            raise PkiError(f"{' '.join(cmd)} failed: {why[-1] if why else done.returncode}")
        return f"ran `{' '.join(cmd)}` (SIGHUP to the broker)"
    assert target.pid is not None
    try:
        os.kill(target.pid, signal.SIGHUP)
    except OSError as exc:
        raise PkiError(f"cannot signal the broker (pid {target.pid}): {exc.strerror}") from exc
    return f"sent SIGHUP to mosquitto (pid {target.pid})"
