"""MCP servers for the tests, on 127.0.0.1: a real one built with the `mcp` SDK's own server side (run as a script:
`python -m tests.mcp_servers http PORT`, `python -m tests.mcp_servers sse PORT` (MCP's earlier HTTP+SSE transport) or
`python -m tests.mcp_servers stdio` from the repository's root), and hostile ones that speak
HTTP badly: one that never answers, one that floods, one that answers malformed JSON-RPC, one that drops the
connection mid-answer. `McpHttpServer` starts the real one as a process and stops it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stdio_command(*args: str) -> list[str]:
    """The command that runs the real server (as a module: tests/http would hide the standard library's http)."""
    return [sys.executable, "-m", "tests.mcp_servers", *args]


def serve(transport: str, port: int = 0) -> None:
    from mcp.server import MCPServer
    from mcp_types import ToolAnnotations

    app = MCPServer("servelm-tests")

    @app.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @app.tool()
    def echo(text: str) -> str:
        """Echo a text back."""
        return text

    @app.tool()
    def large(size: int) -> str:
        """A text of `size` bytes."""
        return "x" * size

    @app.tool()
    def slow(seconds: float) -> str:
        """Answer after `seconds`."""
        time.sleep(seconds)
        return "done"

    bumped = [0]

    @app.tool()
    def bump() -> int:
        """Count one more call, and say how many there were."""
        bumped[0] += 1
        return bumped[0]

    @app.tool(annotations=ToolAnnotations(read_only_hint=True))
    def bumps() -> int:
        """How many times bump ran."""
        return bumped[0]

    @app.tool()
    def fail(why: str) -> str:
        """Fail with `why`."""
        from mcp.server.mcpserver.exceptions import ToolError

        raise ToolError(why)

    if transport == "stdio":
        app.run("stdio")
    elif transport == "sse":  # MCP's earlier HTTP+SSE transport only: a POST to /sse is a 405
        app.run("sse", host="127.0.0.1", port=port)
    else:
        app.run("streamable-http", host="127.0.0.1", port=port)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class McpHttpServer:
    """The real MCP server over streamable HTTP (or, `transport="sse"`, over the earlier HTTP+SSE transport only),
    as a process: `.url` (http://127.0.0.1:PORT/mcp, or /sse), `.origin`, `.transport` (streamable_http or sse)."""

    def __init__(self, transport: str = "http") -> None:
        self.transport = "sse" if transport == "sse" else "streamable_http"
        self.port = free_port()
        self.origin = f"http://127.0.0.1:{self.port}"
        self.url = self.origin + ("/sse" if transport == "sse" else "/mcp")
        self.proc = subprocess.Popen(stdio_command(transport, str(self.port)), cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("the test MCP server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class HostileServer:
    """An HTTP server on 127.0.0.1 that misbehaves as `kind` says: "hang" (reads the request, never answers),
    "flood" (an endless body), "malformed" (200 with a body that is not JSON-RPC), "drop" (starts an SSE answer and
    closes the connection). The "sse-" kinds answer a POST 405, as a server of MCP's earlier HTTP+SSE transport does,
    and a GET with an event stream that: "sse-hang" sends nothing on, "sse-flood" sends one endless event on,
    "sse-chatter" names its endpoint on and then sends endless small events, "sse-elsewhere" names `endpoint` as its
    endpoint on. `.origin`, `.url`; `.connections` counts what it accepted."""

    def __init__(self, kind: str, endpoint: str = "/messages/?session_id=0") -> None:
        self.kind, self.endpoint = kind, endpoint
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.origin = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.url = self.origin + "/mcp"
        self.connections = 0
        self._stop = threading.Event()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            self._open.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            asked = conn.recv(65536)
            if self.kind.startswith("sse-"):
                self._answer_sse(conn, asked.startswith(b"GET "))
            elif self.kind == "hang":
                self._stop.wait()
            elif self.kind == "flood":
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n")
                chunk = b"[" * 65536
                while not self._stop.is_set():
                    conn.sendall(chunk)
            elif self.kind == "malformed":
                body = b'{"jsonrpc": "2.0", "id": "not yours", "result": [1, 2, {"oops"'
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
            elif self.kind == "drop":
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\nevent: message\r\ndata: {\"js")
            conn.close()

    def _answer_sse(self, conn: socket.socket, get: bool) -> None:
        if not get:
            conn.sendall(b"HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
        if self.kind == "sse-flood":
            conn.sendall(b"event: message\ndata: ")
            while not self._stop.is_set():
                conn.sendall(b"x" * 65536)
        elif self.kind == "sse-chatter":
            conn.sendall(b"event: endpoint\ndata: " + self.endpoint.encode() + b"\n\n")
            while not self._stop.is_set():
                conn.sendall(b"event: chatter\ndata: hi\n\n" * 4096)
        elif self.kind == "sse-elsewhere":
            conn.sendall(b"event: endpoint\ndata: " + self.endpoint.encode() + b"\n\n")
        self._stop.wait()

    def stop(self) -> None:
        self._stop.set()
        self.sock.close()
        for conn in self._open:
            with contextlib.suppress(OSError):
                conn.close()


@contextlib.contextmanager
def hostile(kind: str, **options: str) -> Iterator[HostileServer]:
    server = HostileServer(kind, **options)
    try:
        yield server
    finally:
        server.stop()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
