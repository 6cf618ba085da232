"""One real server for the whole e2e session, and the clients that talk to it. With SERVELM_E2E_RAY=1 every
server is `servelm serve --ray` on a local two-node Ray cluster (tests/e2e/ray_mode.py)."""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from tests.mcp_servers import McpHttpServer

from . import ray_mode
from .helpers import MODEL, RunningServer, client_for, wait_idle

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180.0  # the start-up self-check's passes: seconds on a quiet machine, a minute or more on a busy one


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=ray_mode.STOP_TIMEOUT_S if ray_mode.ENABLED else 20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def start_server(tmp_path_factory: pytest.TempPathFactory, *flags: str) -> RunningServer:
    """Start `servelm serve` on a free port with the default settings plus `flags`; wait for /health. Under
    SERVELM_E2E_RAY=1: `servelm serve --ray` with the same deployments replicated, on a Ray cluster of its own
    (tests/e2e/ray_mode.py), ready once every replica of the default model counts in /health."""
    log_path = tmp_path_factory.mktemp("servelm") / "server.log"
    port = _free_port()
    # The tests assume the default settings; a developer's SERVELM_* variables must not change them.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVELM_")}
    env["PYTHONUNBUFFERED"] = "1"
    args, slots, cluster = list(flags), None, None
    if ray_mode.ENABLED:
        args, slots, cpus = ray_mode.write_config(flags, log_path.with_name("servelm-ray.yaml"))
        cluster = ray_mode.start_cluster(cpus)
        args += ["--ray-address", cluster.address]
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "servelm", "serve", "--host", "127.0.0.1", "--port", str(port), *args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO_ROOT, env=env,
            )
    except BaseException:
        if cluster is not None:
            cluster.shutdown()
        raise
    srv = RunningServer(f"http://127.0.0.1:{port}", proc, log_path)
    if cluster is not None:
        ray_mode.adopt(srv, cluster)
    key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None  # with keys on, /health tells a key
    name = args[args.index("--model-id") + 1] if "--model-id" in args else MODEL
    if "--models-dir" in args and "--model-path" not in args:
        name = None  # its models load when a request names them: ready once it answers
    _wait_ready(srv, slots, name, key)
    return srv


def _wait_ready(srv: RunningServer, slots: int | None, name: str | None = MODEL, key: str | None = None) -> None:
    """Until /health lists the model `name` (with `slots` sequence slots, if given) to `key` (None: until it answers
    200); else fail the test."""
    timeout = ray_mode.STARTUP_TIMEOUT_S if ray_mode.ENABLED else STARTUP_TIMEOUT_S
    deadline = time.monotonic() + timeout
    while True:
        if srv.process.poll() is not None:
            stop_server(srv)
            pytest.fail(f"the server exited with code {srv.process.returncode} while starting:\n{srv.log_tail()}")
        try:
            r = httpx.get(f"{srv.base_url}/health", timeout=2, headers={"authorization": f"Bearer {key}"} if key else None)
            if name is None and r.status_code == 200:
                return
            model = r.json().get("deployments", {}).get(name) if r.status_code == 200 else None
            if model is not None and (slots is None or model.get("total_slots") == slots):
                return
        except (httpx.TransportError, ValueError):
            pass
        if time.monotonic() > deadline:
            stop_server(srv)
            pytest.fail(f"the server did not answer /health within {timeout:.0f} s:\n{srv.log_tail()}")
        time.sleep(0.2)


def stop_server(srv: RunningServer) -> None:
    _stop(srv.process)
    ray_mode.release(srv)  # its Ray cluster, under SERVELM_E2E_RAY=1


@contextmanager
def own_server(tmp_path_factory: pytest.TempPathFactory, *flags: str) -> Iterator[RunningServer]:
    """A server of a test module's own (other flags than the session's), stopped after the block."""
    srv = start_server(tmp_path_factory, *flags)
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="session", autouse=True)
def _ray_clusters() -> Iterator[None]:
    """Under SERVELM_E2E_RAY=1: no Ray cluster outlives the session (nor a server left running on one)."""
    yield
    ray_mode.shutdown_all(_stop)


@pytest.fixture(scope="session")
def mcp_tools_server() -> Iterator[McpHttpServer]:
    """The real MCP server (tests/mcp_servers.py) that the session's server may reach: the client guide calls it."""
    s = McpHttpServer()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, mcp_tools_server: McpHttpServer) -> Iterator[RunningServer]:
    srv = start_server(tmp_path_factory, "--allowed-mcp-servers", mcp_tools_server.origin)
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="session")
def base_url(server: RunningServer) -> str:
    return server.base_url


@pytest.fixture(autouse=True)
def _server_alive_and_idle(server: RunningServer) -> Iterator[None]:
    """Every test starts on an idle server (a previous test's generations have ended) and leaves it alive; what it
    left unclosed (a client's connection, a stream's iterator) is collected at its end, so a ResourceWarning names
    the test that leaked, not whichever test the garbage collector happened to run in."""
    wait_idle(server.base_url, timeout=30)
    yield
    gc.collect()
    if server.process.poll() is not None:
        pytest.fail(f"the server died (exit code {server.process.returncode}):\n{server.log_tail()}")


@pytest.fixture(scope="session")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    c = client_for(base_url)
    yield c
    c.close()


@pytest.fixture
async def aclient(base_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
    yield c
    await c.close()


@pytest.fixture(params=[False, True], ids=["plain", "stream"])
def stream(request: pytest.FixtureRequest) -> bool:
    """Run the test once non-streamed and once streamed."""
    return request.param
