"""Shared fixtures: a real HTTP server (uvicorn on 127.0.0.1) over the fake runner, for fast tests."""

from __future__ import annotations

import os
import sys
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


# Two xdist workers (`make test` runs `-n 2`). The tests that need the cores to themselves run in one work unit,
# in collection order, on one worker: those that compute on a real model (llama.cpp's threads sized for every core)
# and those whose assertions bound wall-clock time (the pacer's learned step costs, a latency behind a flood, a
# deadline). The other worker takes the rest a file at a time and lowers its own priority as it starts them, so it
# fills the model's idle moments (HTTP, tokenizing, a client's own work) and not its cores. Without that, two
# llama.cpp thread pools, or a busy worker beside one, made llama.cpp's barrier spin wait for a descheduled thread
# at every op (docs/testing.md measures both).
OWN_CORES = (
    "tests/e2e/", "tests/ray/", "tests/runners/",
    # a real model
    "tests/adversarial/test_adapters.py", "tests/adversarial/test_batch_state.py",
    "tests/adversarial/test_kept_state.py", "tests/adversarial/test_model_names.py",
    "tests/adversarial/test_models_dir.py", "tests/adversarial/test_selfcheck_memo.py",
    "tests/adversarial/test_shutdown.py", "tests/adversarial/test_start_and_bodies.py",
    "tests/scripts/test_minilm_gguf.py",
    # wall-clock bounds
    "tests/adversarial/test_neighbours.py", "tests/adversarial/test_priority.py",
    "tests/adversarial/test_metrics_flood.py", "tests/adversarial/test_rerank.py",
    "tests/http/test_load_control_fake.py", "tests/http/test_connections_fake.py",
)
# Files with looser wall-clock bounds (a deadline of seconds, the event loop's lag): the other worker runs them
# first, before it lowers its priority, beside the unit at the same priority. At the lowest priority, one of them
# saw the event loop stall 3.5 s while the model computed.
EARLY = (
    "tests/adversarial/test_loop.py", "tests/adversarial/test_batches.py",
    "tests/adversarial/test_conversations_attack.py", "tests/adversarial/test_mcp_attack.py",
    "tests/http/test_content_filter_fake.py", "tests/http/test_images_fake.py",
    "tests/service/test_mcp.py", "tests/service/test_responses_mcp.py",
)
_lowered = False


def own_cores(nodeid: str) -> bool:
    return nodeid.startswith(OWN_CORES)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under `-n N` with the default `--dist load`: the OWN_CORES tests as one unit, first; the others by file,
    the EARLY ones first."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OwnCoresTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "own-cores" if own_cores(nodeid) else nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node) -> None:
            # the unit first, whatever its size (it is the longest to run), then the EARLY files
            first = [scope for scope in self.workqueue if scope == "own-cores" or scope.startswith(EARLY)]
            for scope in sorted(first, key=lambda scope: scope != "own-cores", reverse=True):
                self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return OwnCoresTogether(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """An xdist worker's first test outside the OWN_CORES unit and the EARLY files lowers that worker's priority for
    good (and its children's: a server it starts, a build it runs); the worker that runs the unit does so only
    after it."""
    global _lowered
    if not _lowered and "PYTEST_XDIST_WORKER" in os.environ and not item.nodeid.startswith(OWN_CORES + EARLY):
        os.nice(19)
        _lowered = True


# Python 3.11's settrace has one reentrancy guard for the whole process (python/cpython#98257): under coverage's
# tracer, a thread that starts while another thread installs its trace function dies in threading's bootstrap with
# this RuntimeError, before its target runs. A clean-clone run met it once in 2,275 tests (a thread pool's worker;
# the pool's others did the work). Only that exception, and only while coverage traces new threads, is dropped
# here; a test whose own thread died that way still fails by what it waits for. Python 3.12's sys.monitoring has
# no such guard.
_TRACE_RACE = "Cannot install a trace function while another trace function is being installed"


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """After pytest's own thread-exception hook is installed: wrap it to drop the tracer's race, on Python 3.11."""
    if sys.version_info >= (3, 12):
        return
    reported = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is RuntimeError and str(args.exc_value) == _TRACE_RACE and threading.gettrace() is not None:
            return
        reported(args)

    threading.excepthook = hook
