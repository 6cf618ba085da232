"""One real server for the whole e2e session, and the clients that talk to it."""

from __future__ import annotations

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

from .helpers import MODEL, RunningServer, wait_idle

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def start_server(tmp_path_factory: pytest.TempPathFactory, *flags: str) -> RunningServer:
    """Start `servelm serve` on a free port with the default settings plus `flags`; wait for /health."""
    log_path = tmp_path_factory.mktemp("servelm") / "server.log"
    port = _free_port()
    # The tests assume the default settings; a developer's SERVELM_* variables must not change them.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVELM_")}
    env["PYTHONUNBUFFERED"] = "1"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "servelm", "serve", "--host", "127.0.0.1", "--port", str(port), *flags],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO_ROOT, env=env,
        )
    srv = RunningServer(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with code {proc.returncode} while starting:\n{srv.log_tail()}")
        try:
            r = httpx.get(f"{srv.base_url}/health", timeout=2)
            if r.status_code == 200 and MODEL in r.json().get("deployments", {}):
                return srv
        except (httpx.TransportError, ValueError):
            pass
        if time.monotonic() > deadline:
            _stop(proc)
            pytest.fail(f"the server did not answer /health within {STARTUP_TIMEOUT_S:.0f} s:\n{srv.log_tail()}")
        time.sleep(0.2)


def stop_server(srv: RunningServer) -> None:
    _stop(srv.process)


@contextmanager
def own_server(tmp_path_factory: pytest.TempPathFactory, *flags: str) -> Iterator[RunningServer]:
    """A server of a test module's own (other flags than the session's), stopped after the block."""
    srv = start_server(tmp_path_factory, *flags)
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    srv = start_server(tmp_path_factory)
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="session")
def base_url(server: RunningServer) -> str:
    return server.base_url


@pytest.fixture(autouse=True)
def _server_alive_and_idle(server: RunningServer) -> Iterator[None]:
    """Every test starts on an idle server (a previous test's generations have ended) and leaves it alive."""
    wait_idle(server.base_url, timeout=30)
    yield
    if server.process.poll() is not None:
        pytest.fail(f"the server died (exit code {server.process.returncode}):\n{server.log_tail()}")


@pytest.fixture(scope="session")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
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
