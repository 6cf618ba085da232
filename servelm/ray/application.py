"""The Ray Serve application: one model deployment per config deployment (ModelReplica, routed by the
PrefixAffinityRouter) behind one ingress (servelm's ASGI app), and `servelm serve --ray`, which runs it.

Replicas: `num_replicas` (default 1), or autoscaling between `min_replicas` and `max_replicas` on requests
in flight per replica (aiming at the engine's `max_num_seqs`). Each replica asks Ray for `threads` CPUs
(default 1): set `threads` so that the replicas a node holds do not share cores.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from servelm.compose import Plan
from servelm.config import DeploymentSpec
from servelm.fleet import FleetLimits
from servelm.http.app import AppOptions
from servelm.tracing import TraceSettings

log = logging.getLogger("servelm.ray")

APP_NAME = "servelm"
INGRESS_NAME = "servelm-ingress"
INGRESS_MAX_ONGOING = 4096  # HTTP requests one ingress replica holds at once (generation waits on the replicas)
REPLICA_QUEUE_FACTOR = 4  # a replica takes up to this many times max_num_seqs requests; more wait in the router
# Ray Serve's throughput-optimized mode (gRPC between deployments, routing on the caller's loop): about half the
# ingress's CPU per streamed token here (0.6 ms instead of 1.2). Set on every node of an existing cluster.
THROUGHPUT_OPTIMIZED = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
ROUTING_STATS_PERIOD_S = 1.0
CONSTRUCTOR_TRIES = 3  # a replica that cannot start (a missing model file) fails the deployment after this many


def build_application(plan: Plan) -> Any:
    """The bound Ray Serve application of a plan (pass it to serve.run): its deployments' replicas and the ingress.
    Its on-demand deployments' replicas start without their model, loaded when a request names it within
    --models-max and --models-memory-mib; requests in flight may take --shutdown-timeout to finish when the
    application stops; with --otlp-traces-endpoint the ingress's spans and the replicas' join one trace per
    request."""
    from ray import serve

    from servelm.ray.ingress import IngressDeployment, IngressPlan

    settings, tracing = plan.settings, plan.trace_settings()
    for s in [*plan.specs, *plan.on_demand]:
        if getattr(s, "backend", "llamacpp") != "llamacpp":
            raise ValueError(f"deployment {s.name!r}: only llama.cpp deployments run under --ray for now (the "
                             "ingress tokenizes with a tokenizer-only copy of a GGUF)")
    timeout = settings.shutdown_timeout
    deployments = {s.name: model_deployment(s, plan.verbose_llama, timeout, tracing=tracing) for s in plan.specs}
    deployments.update({s.name: model_deployment(s, plan.verbose_llama, timeout, on_demand=True, tracing=tracing)
                        for s in plan.on_demand})
    ingress_plan = IngressPlan(
        specs=[s.model_dump(mode="json") for s in plan.specs],
        on_demand=[s.model_dump(mode="json") for s in plan.on_demand],
        models=FleetLimits.of(settings),
        tracing=tracing,
        aliases={a: s.name for s in [*plan.specs, *plan.on_demand] for a in s.aliases},
        endpoints={e.name: [(r.deployment, r.weight) for r in e.routes] for e in plan.endpoints},
        app=AppOptions.from_settings(settings, plan.keys, plan.mcp_servers),
        log_level=settings.log_level,
    )
    ingress = serve.deployment(IngressDeployment).options(
        name=INGRESS_NAME, num_replicas=1, max_ongoing_requests=INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0},  # its work is HTTP and tokenizing: it must not take a replica's core
        logging_config={"enable_access_log": False},  # servelm.access writes one line per request
        max_constructor_retry_count=CONSTRUCTOR_TRIES,
        graceful_shutdown_timeout_s=timeout,
    )
    return ingress.bind(ingress_plan, deployments)


def model_deployment(spec: DeploymentSpec, verbose_llama: bool = False, shutdown_timeout: float = 10.0,
                     on_demand: bool = False, tracing: TraceSettings | None = None) -> Any:
    """One config deployment as a Ray Serve deployment of ModelReplica (bound, not yet running)."""
    from ray import serve

    from servelm.ray.replica import ModelReplica

    options = deployment_options(spec, shutdown_timeout)
    return serve.deployment(ModelReplica).options(**options).bind(spec.model_dump(mode="json"), verbose_llama,
                                                                  on_demand, tracing)


def deployment_options(spec: DeploymentSpec, shutdown_timeout: float = 10.0) -> dict[str, Any]:
    """Ray Serve's options for a deployment's replicas: how many, their CPUs, their router."""
    from ray.serve.config import RequestRouterConfig

    from servelm.ray.router import DEFAULT_IMBALANCE, PrefixAffinityRouter

    seqs = spec.engine.max_num_seqs
    options: dict[str, Any] = dict(
        name=spec.name,
        ray_actor_options={"num_cpus": spec.engine.threads or 1},
        max_ongoing_requests=max(REPLICA_QUEUE_FACTOR * seqs, 16),
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"imbalance": max(DEFAULT_IMBALANCE, seqs // 4)},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,  # which replicas hold the model and which adapters
        ),
        health_check_period_s=5,
        graceful_shutdown_timeout_s=shutdown_timeout,
        logging_config={"enable_access_log": False},  # a line per call, stats polls included: the ingress logs requests
        max_constructor_retry_count=CONSTRUCTOR_TRIES,
    )
    if spec.max_replicas is not None:
        low = 1 if spec.min_replicas is None else spec.min_replicas
        options["autoscaling_config"] = {"min_replicas": low, "max_replicas": spec.max_replicas,
                                         "initial_replicas": max(low, 1), "target_ongoing_requests": seqs}
    else:
        options["num_replicas"] = spec.num_replicas or 1
    return options


def serve_on_ray(app: Any, *, host: str, port: int, address: str | None = None) -> None:
    """Run the application on Ray until SIGINT or SIGTERM: on the cluster at `address` (else RAY_ADDRESS; else
    a local Ray instance started here), HTTP on host:port through Ray Serve's proxy on the head node."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:  # a local instance inherits this process's environment: Ray Serve's faster data plane,
        os.environ.setdefault(THROUGHPUT_OPTIMIZED, "1")
        # and no 30 s hold at shutdown for a load balancer to let go of the ingress: there is none in front of it
        os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "0")
    # "local": a new instance. None would join the latest cluster started on this machine (`ray start`, a test's
    # Cluster), which the serve.shutdown() below would then stop as if it were ours
    ray.init(address=address or "local", ignore_reinit_error=True)
    try:
        with _StopSignals() as signals:  # from here: /health may answer before serve.run returns
            try:
                _start(app, host, port)
                log.info("serving on Ray Serve at http://%s:%s (Ray cluster: %s)", host, port, address or "local")
                signals.wait()
            except _Stopped:
                log.info("a signal came while the application was starting")
        log.info("stopping the servelm application")
        _delete(own_instance=address is None)
    finally:
        ray.shutdown()


def _start(app: Any, host: str, port: int) -> None:
    from ray import serve

    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
    try:
        serve.run(app, name=APP_NAME, route_prefix="/")
    except RuntimeError as exc:  # Ray says which deployment failed; its status says why
        raise RuntimeError(f"{exc} {_why_deployments_failed()}".strip()) from None


def _delete(own_instance: bool) -> None:
    """Delete the application (its replicas drain for shutdown_timeout); stop Serve too on our own instance."""
    from ray import serve

    try:
        serve.delete(APP_NAME)
        if own_instance:  # leave nothing behind
            serve.shutdown()
    except Exception as exc:  # noqa: BLE001 - stopped before Serve was up: nothing of ours to delete
        log.warning("could not delete the servelm application: %s", exc)


def _why_deployments_failed() -> str:
    """The last line of each failed deployment's status message (the exception its replicas raised)."""
    from ray import serve

    try:
        status = serve.status().applications.get(APP_NAME)
    except Exception:  # noqa: BLE001 - the controller is gone too: Ray's own message has to do
        return ""
    reasons = []
    for name, d in (status.deployments.items() if status is not None else ()):
        lines = [line.strip() for line in (d.message or "").splitlines() if line.strip()]
        if lines and str(d.status) not in ("HEALTHY", "DeploymentStatus.HEALTHY"):
            reasons.append(f"{name}: {lines[-1]}")
    return "; ".join(reasons)


class _Stopped(BaseException):
    """A signal while the application starts (a BaseException, which Ray's own code does not catch)."""


class _StopSignals:
    """SIGINT and SIGTERM stop the server from the start: while it starts they interrupt the start (the ingress
    may already answer /health, so the application has to be deleted, not left behind); once it serves, wait()
    returns. A second signal after that gets the previous handler (Ray's: exit at once)."""

    def __enter__(self) -> _StopSignals:
        self._stop = threading.Event()
        self._interrupt = True  # raise _Stopped at the next signal (once: a start is interrupted once)
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _on_signal(self, *_: Any) -> None:
        self._stop.set()
        if self._interrupt:
            self._interrupt = False
            raise _Stopped

    def wait(self) -> None:
        self._interrupt = False
        while not self._stop.wait(1.0):
            pass

    def __exit__(self, *_: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
