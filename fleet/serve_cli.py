"""``fleet serve``: the ingest workers, and beside them on one event loop the rollout
service and the HTTP API (:mod:`fleet.services`), until SIGTERM or Ctrl-C."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from fleet.cli_common import (
    ENV_MQTT_PASSWORD,
    EXIT_FAILURE,
    EXIT_USAGE,
    JsonOpt,
    StoreOpt,
    err,
    fail,
    store_url,
)
from fleet.errors import FleetError, IngestError, RetentionError, RolloutError
from fleet.leader import NodeBeat, check_alone, default_node
from fleet.metrics import FleetMetrics, store_state
from fleet.retention import KINDS, apply_retention, describe, parse_retention
from fleet.rollout.service import check_artifact_url
from fleet.services import ApiService, build_api, service_failure, start_services
from fleet.store import OperatorStore, open_store

if TYPE_CHECKING:
    from fleet.api.server import HttpListen
    from fleet.ingest import IngestConfig
    from fleet.rollout.service import RolloutService

log = logging.getLogger(__name__)
_fail = fail
#: How often the history is prepared (partitions ahead) and ``--retention`` applied.
RETENTION_EVERY_S = 600


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=None, separators=(",", ":")))


def serve(
    store: StoreOpt = None,
    broker: Annotated[str, typer.Option(help="MQTT broker host:port.")] = "127.0.0.1:1883",
    workers: Annotated[int, typer.Option(min=1, max=64, help="Ingest workers.")] = 1,
    connect_timeout: Annotated[
        float,
        typer.Option(
            min=0,
            help="Exit (code 3) if the workers have not reached the broker within this many "
            "seconds of the start (0: keep trying); later outages are ridden out.",
        ),
    ] = 30.0,
    status_interval: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds between status lines on stderr: workers connected, counts (0: none).",
        ),
    ] = 60.0,
    auto_register: Annotated[
        bool,
        typer.Option(
            "--auto-register/--no-auto-register",
            help="Add unknown devices to the registry (else quarantine their messages).",
        ),
    ] = True,
    duration: Annotated[
        float | None, typer.Option(help="Stop after this many seconds (default: run forever).")
    ] = None,
    group: Annotated[str, typer.Option(help="Shared-subscription group.")] = "ingest",
    client_id: Annotated[
        str,
        typer.Option(
            help="Prefix of the workers' MQTT client ids, PREFIX-GROUP-N, each a persistent "
            "session the store records (default: fleet-ingest-HOSTNAME).",
        ),
    ] = "",
    batch_max: Annotated[int, typer.Option(help="Messages per store transaction.")] = 500,
    batch_ms: Annotated[int, typer.Option(help="Longest wait to fill a batch (ms).")] = 50,
    gap_grace: Annotated[
        float,
        typer.Option(
            min=0,
            max=86_400,
            help="A hole in a device's seqs is logged as a gap once it is this old (s).",
        ),
    ] = 30.0,
    gap_check: Annotated[
        float, typer.Option(min=0, max=3_600, help="How often to look for new gaps (s; 0: off).")
    ] = 5.0,
    username: Annotated[str | None, typer.Option(help="MQTT user name.")] = None,
    password_env: Annotated[
        str, typer.Option(help="Environment variable holding the MQTT password.")
    ] = ENV_MQTT_PASSWORD,
    tls_ca: Annotated[Path | None, typer.Option(help="CA bundle to verify the broker.")] = None,
    tls_cert: Annotated[Path | None, typer.Option(help="Client certificate (PEM).")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="Client key (PEM).")] = None,
    rollouts: Annotated[
        bool,
        typer.Option(
            "--rollouts/--no-rollouts", help="Run the artifact server and the rollout orchestrator."
        ),
    ] = True,
    artifacts: Annotated[
        Path, typer.Option(envvar="FLEET_ARTIFACTS", help="Directory of published bundles.")
    ] = Path("artifacts"),
    artifact_host: Annotated[str, typer.Option(help="Address the artifact server binds.")] = (
        "127.0.0.1"
    ),
    artifact_port: Annotated[int, typer.Option(help="Artifact HTTP port (0: any).")] = 8700,
    coap_port: Annotated[int, typer.Option(help="Artifact CoAP port (0: any).")] = 5683,
    advertise: Annotated[
        str,
        typer.Option(
            help="Host name devices use for the artifact server (default: the bind address)."
        ),
    ] = "",
    artifact_url: Annotated[
        str,
        typer.Option(
            help="Base URL of the HTTP(S) offers, e.g. a load balancer in front of every node "
            "(https://bundles.plant:8700); default http://ADVERTISE:ARTIFACT-PORT."
        ),
    ] = "",
    http: Annotated[
        str,
        typer.Option(
            help="Serve the API (/api/v1), /metrics and the console on HOST:PORT ('off': none)."
        ),
    ] = "127.0.0.1:8780",
    http_cert: Annotated[
        Path | None, typer.Option(help="Serve --http over TLS with this certificate (PEM).")
    ] = None,
    http_key: Annotated[Path | None, typer.Option(help="The key of --http-cert (PEM).")] = None,
    root: Annotated[
        Path | None,
        typer.Option(help="Check bundles uploaded through the API against this root.json."),
    ] = None,
    node_id: Annotated[
        str,
        typer.Option(
            help="This node's name among the fleet serve nodes on one store (default: the "
            "host name); on PostgreSQL the nodes elect one to run the rollouts.",
        ),
    ] = "",
    retention: Annotated[
        str,
        typer.Option(
            help="Delete history older than this every 10 min: KIND=AGE pairs, e.g. "
            f"telemetry=30d,decisions=180d (kinds: {', '.join(KINDS)}). Default: keep "
            "everything.",
        ),
    ] = "",
    as_json: JsonOpt = False,
) -> None:
    """Ingest devices' MQTT uplink into the store until stopped (SIGTERM / Ctrl-C); with
    --rollouts (the default) also serve bundles and run the rollouts; with --http (the
    default) serve the API and the console."""
    # Imported on use: the read-only commands never load paho.
    from fleet.ingest import IngestConfig, parse_broker  # noqa: PLC0415
    from fleet.ingest import serve as run  # noqa: PLC0415

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        host, port = parse_broker(broker)
        config = IngestConfig(
            store_url=store_url(store),
            broker_host=host,
            broker_port=port,
            group=group,
            client_id=client_id,
            auto_register=auto_register,
            batch_max=batch_max,
            batch_ms=batch_ms,
            gap_grace_s=gap_grace,
            gap_check_s=gap_check,
            username=username,
            password=os.environ.get(password_env) if username else None,
            tls_ca=str(tls_ca) if tls_ca else None,
            tls_cert=str(tls_cert) if tls_cert else None,
            tls_key=str(tls_key) if tls_key else None,
        )
        check_artifact_url(artifact_url)
        keep = parse_retention(retention)
    except (IngestError, RolloutError, RetentionError) as exc:
        _fail(str(exc), EXIT_USAGE)
    node = node_id or default_node()
    try:
        node_store, beat = _join_nodes(config.store_url, node)
    except FleetError as exc:
        _fail(str(exc), EXIT_FAILURE)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    service_error: list[BaseException] = []
    try:
        listen = _listen(http, http_cert, http_key)
    except FleetError as exc:
        _fail(str(exc), EXIT_USAGE)
    metrics = FleetMetrics(store_state(config.store_url)) if listen else None
    try:
        api = (
            _api(config.store_url, listen, artifacts.resolve(), root, metrics)
            if listen and metrics
            else None
        )
    except FleetError as exc:
        _fail(str(exc), EXIT_FAILURE)
    log.info("%s", describe(keep))
    threading.Thread(
        target=_history_loop, args=(config.store_url, keep, stop), name="history", daemon=True
    ).start()
    service = start_services(
        stop,
        service_error,
        rollouts=_rollout_service(
            config,
            artifacts=artifacts.resolve(),
            http=(artifact_host, artifact_port),
            coap_port=coap_port,
            advertise=advertise,
            artifact_url=artifact_url,
            node=node,
        )
        if rollouts
        else None,
        api=api,
    )
    try:
        stats = run(
            config,
            workers=workers,
            duration=duration,
            stop=stop,
            connect_timeout=connect_timeout or None,
            status_interval=status_interval or None,
            on_workers=metrics.update_ingest if metrics else None,
            on_stats=lambda t: beat.beat(t.stored, t.received),
            node=node,
        )
    except FleetError as exc:
        _fail(str(exc), EXIT_FAILURE)
    finally:
        stop.set()
        if service is not None:
            service.join(timeout=5)
        beat.gone()
        node_store.close()
    if service_error:
        _fail(service_failure(service_error[0]), EXIT_FAILURE)
    per_worker = [s.as_dict() for s in stats]
    if as_json:
        _print_json({"workers": per_worker})
        return
    _print_worker_summary(per_worker)


def _rollout_service(
    config: IngestConfig,
    *,
    artifacts: Path,
    http: tuple[str, int],
    coap_port: int,
    advertise: str,
    artifact_url: str,
    node: str,
) -> RolloutService:
    """The artifact server and rollout orchestrator's settings, with the ingest's broker and
    credentials."""
    from fleet.rollout.service import RolloutService  # noqa: PLC0415

    return RolloutService(
        store_url=config.store_url,
        artifacts=artifacts,
        broker_host=config.broker_host,
        broker_port=config.broker_port,
        http_host=http[0],
        http_port=http[1],
        coap_port=coap_port,
        advertise=advertise,
        artifact_url=artifact_url,
        username=config.username,
        password=config.password,
        tls_ca=config.tls_ca,
        tls_cert=config.tls_cert,
        tls_key=config.tls_key,
        node=node,
    )


def _history_loop(url: str, keep: dict[str, int], stop: threading.Event) -> None:
    """At start and every ``RETENTION_EVERY_S`` until ``stop``, on a store handle of its
    own: make the coming days' partitions (PostgreSQL), apply the retention and log what
    went, then fold the runs of stored seqs the gap query reads (:mod:`fleet.store.runs`).
    A store failure is logged and tried again next time."""
    store: OperatorStore | None = None
    try:
        while not stop.is_set():
            try:
                store = store or open_store(url)
                made = store.prepare_history(time.time_ns())
                if made:
                    log.info("history: %d day partitions made ahead", made)
                gone = apply_retention(store, keep, time.time_ns(), stop=stop)
                folded = store.compact_runs()
                if folded:
                    log.info("history: %d rows of stored seq runs folded", folded)
            except FleetError as exc:
                log.error("retention: %s (tried again in %d s)", exc, RETENTION_EVERY_S)
            else:
                if any(gone.values()):
                    done = ", ".join(f"{n} {k}" for k, n in gone.items())
                    log.info("retention: deleted %s", done)
            stop.wait(RETENTION_EVERY_S)
    finally:
        if store is not None:
            store.close()


def _join_nodes(url: str, node: str) -> tuple[OperatorStore, NodeBeat]:
    """Record this node on the store (its own handle, for the heartbeats; the caller
    closes it), refusing a second node on SQLite or a node id in use (FleetError, one
    line)."""
    st = open_store(url)
    try:
        st.migrate()
        now = time.time_ns()
        check_alone(st, url, node, now)
        return st, NodeBeat(st, node, now)
    except BaseException:
        st.close()
        raise


def _listen(http: str, cert: Path | None, key: Path | None) -> HttpListen | None:
    """``--http`` and its TLS files (None for ``off``); raises FleetError naming the option."""
    if http.strip().lower() == "off":
        return None
    from fleet.api.server import HttpListen, parse_listen  # noqa: PLC0415 - FastAPI on use

    if (cert is None) != (key is None):
        raise FleetError("--http-cert and --http-key go together")
    for option, path in (("--http-cert", cert), ("--http-key", key)):
        if path is not None and not path.is_file():
            raise FleetError(f"{option} {path}: no such file")
    host, port = parse_listen(http)
    return HttpListen(host, port, cert, key)


def _api(
    url: str, listen: HttpListen, artifacts: Path, root: Path | None, metrics: FleetMetrics
) -> ApiService:
    """The API on its bound socket, its store migrated first (no request meets a schema
    older than the code). Raises FleetError (``ApiPortInUse``, a store failure)."""
    st = open_store(url)
    try:
        st.migrate()
    finally:
        st.close()
    return build_api(
        url, listen, artifacts=artifacts, root_json=root, metrics=metrics,
        render_metrics=metrics.render,
    )  # fmt: skip


def _print_worker_summary(per_worker: list[dict[str, Any]]) -> None:
    for i, s in enumerate(per_worker):
        q = sum(s["quarantined"].values())
        err.print(
            f"worker {i}: received {s['received']}, stored {s['stored']}, duplicates "
            f"{s['duplicates']}, conflicts {s['conflicts']} (quarantined), quarantined {q}, "
            f"batches {s['batches']}, dropped {s['dropped']} (redelivered), dropped QoS 0 "
            f"{s['dropped_qos0']} (lost), gaps {s['gaps']} ({s['gap_seqs']} messages never "
            "arrived)",
            markup=False,
        )
