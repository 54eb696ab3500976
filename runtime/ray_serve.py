"""Scale out: N engines as one Ray Serve deployment behind the same OpenAI-compatible API (``serve --ray``).

Each replica is a Ray actor that opens the bundle, pins itself to its share of its node's cores and
serves :func:`.server.create_app` over that engine, so routes, schemas, errors, streaming, the API key
and ``/metrics`` are the single-process server's own, and each replica batches its requests as
``serve --max-batch`` does. Ray Serve's proxy spreads requests over the replicas, restarts a replica
that dies or fails its health check, scales between ``replicas`` and ``max_replicas`` by the
requests in flight, and drains a replica (no new requests, in-flight ones finish) before it stops.

The bundle is read from the same path on every node (docs/ray.md says how it gets there). Ray and its
Serve library are an optional extra (``pip install 'specdeploy[ray]'``), imported only here.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .errors import SpecDeployError
from .server import ServerConfig, create_app

try:
    import ray
    from ray import serve
except ImportError as _exc:
    raise SpecDeployError(
        f"`specdeploy serve --ray` needs the ray extra ({_exc.name} is missing): pip install 'specdeploy[ray]'."
    ) from None

log = logging.getLogger("specdeploy.ray")
APP_NAME = "specdeploy"


@dataclass(frozen=True)
class RayConfig:
    """How many replicas, their cores and how Ray Serve looks after them."""

    replicas: int = 2  # the count; with max_replicas above it, the fewest (autoscaling)
    max_replicas: int | None = None
    target_ongoing: int = 8  # autoscaling target: requests in flight per replica
    upscale_delay_s: float = 10.0  # load above target this long adds replicas (a replica loads in seconds)
    downscale_delay_s: float = 120.0  # load below target this long removes replicas, drained first
    cpus_per_replica: int = 1  # logical CPUs Ray reserves for a replica; also its cores and threads
    address: str | None = None  # None: start a local Ray on this machine; "auto" or ray://...: join a cluster
    health_period_s: float = 5.0
    health_timeout_s: float = 30.0
    constructor_retries: int = 2  # a replica that cannot open the bundle fails the deploy after this many tries

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None and self.max_replicas > self.replicas


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica opens: the bundle, the engine options, the server's settings."""

    bundle: str
    load: dict[str, Any] = field(default_factory=dict)  # backend, draft, tree, allow_inexact, max_batch
    server: ServerConfig = field(default_factory=ServerConfig)
    cpus: int = 1


def _claim_cores(cpus: int) -> tuple[IO | None, list[int] | None]:
    """Claim a free share of ``cpus`` of this node's cores: (the lock file to keep open, the cores).

    The lock goes with the process, so a replica that dies frees its share for its replacement. Where
    every share is taken (more replicas than shares on this node), the replica runs unpinned: (None, None).
    """
    cores = sorted(os.sched_getaffinity(0))
    folder = Path(tempfile.gettempdir()) / f"specdeploy-cores-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    for i in range(len(cores) // max(cpus, 1)):
        handle = open(folder / f"slot-{cpus}x{i}.lock", "w")  # noqa: SIM115 - held for the replica's life
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        return handle, cores[i * cpus : (i + 1) * cpus]
    return None, None


def _pin(cores: list[int]) -> None:
    """Pin every thread of this process (Linux sets affinity per thread; new threads inherit it)."""
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cores)


@serve.ingress()
class SpecDeployReplica:
    """One engine behind the single-process server's ASGI app, pinned to its share of the node's cores."""

    def __init__(self, spec: ReplicaSpec):
        from .engine import load

        self._cores_lock, cores = _claim_cores(spec.cpus)
        if cores is not None:
            _pin(cores)  # before the engine makes its thread pool, which inherits it
        threads = spec.load.get("threads") or spec.cpus
        log.info("replica pid %d on cores %s, %d threads", os.getpid(), cores or "(unpinned)", threads)
        self.engine = load(spec.bundle, **{**spec.load, "threads": threads})
        self.spec = spec

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(self.engine, self.spec.server)  # its lifespan closes the engine when Serve drains it

    def check_health(self) -> None:
        if self.engine.closed:
            raise SpecDeployError("This replica's engine is closed.")


def build_application(spec: ReplicaSpec, config: RayConfig) -> Any:
    """The Ray Serve application: ``config``'s replicas of :class:`SpecDeployReplica` over ``spec``."""
    scale: dict[str, Any]
    if config.autoscaling:
        scale = {"autoscaling_config": {"min_replicas": config.replicas, "max_replicas": config.max_replicas,
                                        "target_ongoing_requests": config.target_ongoing,
                                        "upscale_delay_s": config.upscale_delay_s,
                                        "downscale_delay_s": config.downscale_delay_s}}
    else:
        scale = {"num_replicas": config.replicas}
    deployment = serve.deployment(
        SpecDeployReplica,
        name="engine",
        ray_actor_options={"num_cpus": config.cpus_per_replica},
        # A replica takes as many requests as it decodes at once; the rest wait at Serve's router for the
        # first free row on any replica (Serve prefers the proxy's node until its replicas are full), and
        # past --max-queue waiting, a request gets a 503, as from the single-process server.
        max_ongoing_requests=max(1, int(spec.load.get("max_batch") or 1)),
        max_queued_requests=spec.server.max_queue,
        health_check_period_s=config.health_period_s,
        health_check_timeout_s=config.health_timeout_s,
        graceful_shutdown_wait_loop_s=1.0,
        graceful_shutdown_timeout_s=spec.server.shutdown_timeout,
        max_constructor_retry_count=config.constructor_retries,
        **scale,
    )
    return deployment.bind(spec)


def _replica_error(exc: BaseException) -> str:
    """The replica's own error (the last line of the traceback Serve keeps), else Serve's first line."""
    message = ""
    with contextlib.suppress(Exception):  # Serve's status holds the replica's traceback as text
        message = serve.status().applications[APP_NAME].deployments["engine"].message
    for line in reversed(message.splitlines()):
        if "Error: " in line:
            return line.split("Error: ", 1)[1].strip()
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _check_port(host: str, port: int) -> None:
    """One sentence now, before Ray starts, when the proxy could not listen at ``host:port``."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise SpecDeployError(f"Cannot listen on {host}:{port}: {exc.strerror}.") from None


def run_ray(spec: ReplicaSpec, config: RayConfig, say=print) -> None:
    """Start (or join) Ray, deploy, serve on ``spec.server``'s host and port until SIGINT/SIGTERM, then drain.

    A local Ray started here stops with it, its processes included; a cluster joined with ``address``
    keeps running, without this application.
    """
    stop = threading.Event()
    local = config.address is None
    if local:  # the proxy will listen on this machine
        _check_port(spec.server.host, spec.server.port)
        # Serve gives its proxy 5 s to answer its readiness check, three times, then kills it; with every
        # core busy (engines loading, other work) a proxy can take longer than that to start.
        os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
    ray.init(address=config.address, include_dashboard=False, log_to_driver=False,
             **({"num_cpus": os.cpu_count(), "object_store_memory": 256 * 2**20} if local else {}))
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, whose crash handler would abort on SIGTERM
        signal.signal(sig, lambda *_: stop.set())
    try:
        try:
            # One proxy, on the head node: the deployment's one endpoint (Serve's default, a proxy on every
            # node at the same port, needs one port per node and a load balancer in front).
            serve.start(proxy_location="HeadOnly", http_options={"host": spec.server.host, "port": spec.server.port})
        except Exception as exc:  # noqa: BLE001 - Serve's proxy actor failing to start, in Ray's words
            raise SpecDeployError(f"Ray Serve's HTTP proxy did not start on {spec.server.host}:{spec.server.port}: "
                                  f"{(str(exc).splitlines() or [type(exc).__name__])[0]}") from None
        n = (f"{config.replicas}..{config.max_replicas} replicas (autoscaling)" if config.autoscaling
             else f"{config.replicas} replicas")
        say(f"[ray] deploying {n}, {config.cpus_per_replica} core(s) each, on "
            f"{'a local Ray' if local else config.address}")
        try:
            serve.run(build_application(spec, config), name=APP_NAME, route_prefix="/")
        except Exception as exc:  # noqa: BLE001 - Serve reports a replica's failure in its own words
            raise SpecDeployError(f"The Ray Serve deployment failed: {_replica_error(exc)}") from None
        say(f"[ray] serving on http://{spec.server.host}:{spec.server.port}")
        while not stop.wait(0.5):
            pass
        say("[ray] draining: in-flight requests finish, then the replicas stop")
    finally:
        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)  # blocks while the replicas drain
        if local:  # a joined cluster keeps Serve for its other applications
            with contextlib.suppress(Exception):
                serve.shutdown()
        ray.shutdown()
