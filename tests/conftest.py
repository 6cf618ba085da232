"""Shared fixtures: a real HTTP server (uvicorn on 127.0.0.1) over the fake runner, for fast tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest

from servelm.compose import DeploymentOptions, build_deployment
from servelm.engine.local import LocalEngine
from servelm.http.app import AppOptions, create_app
from servelm.http.limits import Drain, SecurityConfig
from servelm.http.server import make_server
from servelm.http.state import AppState, state_of
from servelm.runners.fake import FakeRunner
from servelm.service.media import ImageSources
from servelm.service.registry.deployments import Deployments, TextDeployment
from tests.mcp_servers import McpHttpServer


@contextmanager
def serving(app, **server_kw) -> Iterator[str]:
    """Run an ASGI app on a free port of 127.0.0.1 for the block, as `servelm serve` runs it (servelm's uvicorn
    server: header deadline, connection cap, draining shutdown; `server_kw` sets those); yields its base URL."""
    server = make_server(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", **server_kw)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def wait_engine_idle(engine, timeout: float = 10.0) -> bool:
    """Poll the engine until nothing runs or waits; False if it is still busy after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.running == 0 and stats.waiting == 0:
            return True
        time.sleep(0.02)
    return False


@dataclass
class FakeServer:
    base_url: str
    runner: FakeRunner
    engine: LocalEngine
    model: str = "fake-model"
    deployment: TextDeployment | None = None
    drain: Drain | None = None  # the app's shutdown, for a test that cuts requests in flight
    state: AppState | None = None  # the app's state (its services and stores)


@pytest.fixture
def fake_server_factory() -> Iterator:
    with ExitStack() as stack:

        def start(*, security=None, extra_deployments=(), prefix_cache=False, image_sources=ImageSources(),
                  content_filter=None, other_runner_kw=None, min_priority=None, batches=None, catalog=None,
                  tracing=None, **runner_kw) -> FakeServer:
            """runner_kw go to FakeRunner (other_runner_kw, when given, to the extra deployments'); security (a
            SecurityConfig) and extra deployment names to create_app; prefix_cache turns the first deployment's
            cache on; image_sources are where it may fetch images; content_filter is its policy; min_priority its bound; batches the Batch API's
            config (http/batches.BatchConfig); catalog its models loaded on demand (servelm/fleet.Fleet); tracing its
            OpenTelemetry exporter (servelm/tracing.Tracing)."""
            runner = FakeRunner(**runner_kw)
            options = DeploymentOptions(prefix_cache=prefix_cache, image_sources=image_sources,
                                        content_filter=content_filter, min_priority=min_priority)
            deployment, engine = build_deployment("fake-model", runner, options)
            others = [build_deployment(name, FakeRunner(**(other_runner_kw or runner_kw))) for name in extra_deployments]
            engines = [engine, *(e for _, e in others)]
            app = create_app(Deployments([deployment, *(d for d, _ in others)]),
                             AppOptions(security=security or SecurityConfig(), batches=batches),
                             on_start=lambda: [e.start() for e in engines],
                             on_stop=lambda: [e.stop() for e in engines], catalog=catalog, tracing=tracing)
            return FakeServer(stack.enter_context(serving(app)), runner, engine, deployment=deployment,
                              drain=state_of(app).drain, state=state_of(app))

        yield start


@pytest.fixture
def fake_server(fake_server_factory) -> FakeServer:
    return fake_server_factory()


@pytest.fixture(scope="module", params=["streamable_http", "sse"])
def mcp_either(request: pytest.FixtureRequest) -> Iterator[McpHttpServer]:
    """The real MCP server (tests/mcp_servers.py) over either transport: streamable HTTP, or the earlier HTTP+SSE
    transport only (a client reaches that one by falling back to SSE)."""
    s = McpHttpServer("sse" if request.param == "sse" else "http")
    yield s
    s.stop()
