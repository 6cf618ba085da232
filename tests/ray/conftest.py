"""A local two-node Ray cluster (ray.cluster_utils.Cluster, one CPU per node) serving the default model with
two replicas through servelm's Ray Serve application, started once per test module and torn down after it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

# Every Ray process of these tests on 127.0.0.1: Ray reads this once, at import, and then takes the loopback
# address for "this node" instead of the machine's own (its children inherit it).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# The mode `servelm serve --ray` runs a local instance in (servelm/ray/application.py: serve_on_ray).
os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "0")
pytest.importorskip("ray", reason="tests/ray need Ray Serve (pip install 'servelm[ray]')")

MODEL = "smollm2-135m-instruct"
NODE = {"num_cpus": 1, "object_store_memory": 100 * 1024 * 1024, "node_ip_address": "127.0.0.1"}
# Small and single-threaded: each replica holds one core of a 2-core machine. Two sequence slots per replica
# let a test fill a replica and queue requests behind the running ones.
ENGINE = {"threads": 1, "context_window": 1024, "max_num_seqs": 2, "max_step_tokens": 128}
READY_TIMEOUT_S = 120


@dataclass
class RayServer:
    base_url: str
    cluster: object
    loop: asyncio.AbstractEventLoop  # where the tests' own deployment handles run (a thread of its own)

    def health(self) -> dict:
        return httpx.get(f"{self.base_url}/health", timeout=10).json()

    def run(self, coro: Coroutine, timeout: float) -> Any:
        """Run a coroutine that uses Ray Serve handles (in throughput-optimized mode a handle routes on the
        loop it was first used on, so they all share this one, alive until the cluster stops)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_specs():
    from servelm.config import DeploymentSpec, EngineSettings

    return [DeploymentSpec(name=MODEL, model="smollm2", num_replicas=2, embedding_window=64,
                           engine=EngineSettings(**ENGINE), limits={"min_priority": 0})]


@pytest.fixture(scope="module")
def ray_server() -> Iterator[RayServer]:
    with ray_app(replica_specs()) as server:
        yield server


@contextlib.contextmanager
def ray_app(specs: list, *, node_cpus: int = 1, on_demand: tuple = (), **settings: Any) -> Iterator[RayServer]:
    """servelm's Ray Serve application over `specs` and `on_demand` (the server's `settings` by name) on a fresh
    two-node local cluster, ready once the first deployment reports all its replicas' slots."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from servelm.compose import Plan
    from servelm.config import ServerSettings
    from servelm.ray.application import APP_NAME, build_application

    node = {**NODE, "num_cpus": node_cpus}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="ray-test-handles", daemon=True)
    thread.start()
    try:
        cluster.add_node(**node)
        ray.init(address=cluster.address)
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        plan = Plan(ServerSettings(**settings), specs=tuple(specs), on_demand=tuple(on_demand))
        serve.run(build_application(plan), name=APP_NAME, route_prefix="/")
        server = RayServer(f"http://127.0.0.1:{port}", cluster, loop)
        first = specs[0]
        _wait_ready(server, first.name, (first.num_replicas or 1) * first.engine.max_num_seqs)
        yield server
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)


def _wait_ready(server: RayServer, model: str, slots: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            health = server.health()
            if health.get("status") == "ok" and health["deployments"][model]["total_slots"] == slots:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    pytest.fail(f"the Ray Serve application did not report {model}'s replicas within {READY_TIMEOUT_S} s")
