"""MCP tools run by this server inside a response (the Responses API's `{"type": "mcp"}` tools), as plain data and
checks: each server the request names (McpServer: where it is, which tools, which need approval), the approvals it
answers (of the previous response's mcp_approval_request items), and the names the model sees its tools by.
service/responses.py runs them: it lists each server's tools, lets the model call them through the chat service
(constrained to their input schemas like any function tool), runs each call (service/mcp.py) and goes on.

An approval is answered once: the store claims its id for the key (service/store.py), so an approved call runs
exactly once however often the answer is sent, and never before it."""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from servelm.errors import InvalidParameter
from servelm.protocol.responses import McpApprovalResponseItem, McpChoice, McpTool, ResponsesRequest
from servelm.service.mcp import McpBudget, McpLimits, McpSession, McpUnavailable, StdioServer, StdioSession, origin_of, parse_allowed
from servelm.service.mcp import McpTool as ListedTool
from servelm.service.store import ResponseStore


class ServerSpec(Protocol):
    """An MCP server the operator configured (config.McpServerSpec): over HTTP (`url`) or a command (stdio)."""

    @property
    def label(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def url(self) -> str | None: ...

    @property
    def headers(self) -> dict[str, str]: ...

    @property
    def command(self) -> str | None: ...

    @property
    def args(self) -> list[str]: ...

    @property
    def env(self) -> dict[str, str]: ...

    @property
    def allowed_tools(self) -> list[str] | None: ...

    @property
    def require_approval(self) -> str | None: ...


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}")  # an HTTP header name (RFC 9110's token)
_FIELD_VALUE = re.compile(r"[\x20-\x7e\x80-\xff]*")  # printable, no line break: nothing to split a request on
_TRANSPORT_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "upgrade", "keep-alive",
                                "te", "trailer", "proxy-connection", "content-type", "accept", "mcp-session-id",
                                "mcp-protocol-version", "last-event-id"})


@dataclass(frozen=True)
class McpSettings:
    """The operator's MCP settings: the origins a request's server_url may reach (--allowed-mcp-servers; none by
    default), the servers it configured (named by label alone), and the limits of each response's MCP work."""

    allowed: frozenset[tuple[str, str, int]] = frozenset()
    limits: McpLimits = McpLimits()
    configured: tuple[ServerSpec, ...] = ()

    @classmethod
    def from_settings(cls, settings: Any, configured: Sequence[ServerSpec] = ()) -> McpSettings:
        """From ServerSettings and the config file's servers (a ValueError names an allowed origin that is none)."""
        step = settings.mcp_call_timeout
        return cls(parse_allowed(tuple(settings.allowed_mcp_servers)),
                   McpLimits(connect_s=step, list_s=step, call_s=step, total_s=settings.mcp_timeout,
                             max_calls=settings.mcp_max_calls), tuple(configured))


class Configured:
    """The operator's MCP servers, live: a command's server runs from the app's start to its stop (StdioServer),
    an HTTP one is connected to per request like any."""

    def __init__(self, specs: Sequence[ServerSpec]) -> None:
        self.specs = {s.label: s for s in specs}
        self.stdio = {s.label: StdioServer(s.label, s.command, s.args, s.env) for s in specs if s.command}

    def start(self) -> None:
        for server in self.stdio.values():
            server.start()

    async def stop(self) -> None:
        for server in self.stdio.values():
            await server.stop()

    def open(self, label: str, limits: McpLimits, budget: McpBudget) -> McpSession | StdioSession:
        """A request's session with the configured server `label` (`async with` it)."""
        if label in self.stdio:
            return self.stdio[label].session(limits, budget)
        spec = self.specs[label]
        assert spec.url is not None
        return McpSession(label, spec.url, spec.headers, limits, budget)

    async def describe(self, limits: McpLimits) -> list[dict[str, Any]]:
        """GET /v1/mcp/servers: each server, how it is reached, whether it answers, and its tools (all asked at
        once, each within the step bound; a command known to be starting again is not waited for)."""
        return list(await asyncio.gather(*(self._describe(label, spec, limits) for label, spec in self.specs.items())))

    async def _describe(self, label: str, spec: ServerSpec, limits: McpLimits) -> dict[str, Any]:
        entry: dict[str, Any] = {"server_label": label, "description": spec.description,
                                 "transport": "stdio" if spec.command else "streamable_http",
                                 "require_approval": spec.require_approval or "always"}
        if label in self.stdio and self.stdio[label].status == "restarting":  # not waited for: known down
            return {**entry, "status": "restarting", "tools": []}
        try:
            async with self.open(label, limits, McpBudget(limits.connect_s + limits.list_s)) as session:
                tools = await session.list_tools(tuple(spec.allowed_tools) if spec.allowed_tools else None)
                entry["transport"] = getattr(session, "transport", entry["transport"])  # an HTTP one's: or SSE
        except McpUnavailable as exc:
            return {**entry, "status": "unavailable", "error": exc.message, "tools": []}
        return {**entry, "status": "ready", "tools": [{"name": t.name, "description": t.description,
                                                       "input_schema": t.input_schema} for t in tools]}


@dataclass(frozen=True)
class McpServer:
    """One `{"type": "mcp"}` tool of a request. Its headers are the client's secrets: kept out of repr."""

    label: str
    url: str
    where: str  # its place in the request (tools[i]), for errors
    allowed_tools: tuple[str, ...] | None
    approval: Any  # the tool's require_approval ("always", "never", a filter, None: always)
    headers: dict[str, str] = field(repr=False, default_factory=dict)
    configured: bool = False  # the operator's (Configured): named by its label alone

    def needs_approval(self, tool: ListedTool) -> bool:
        rule = self.approval
        if rule is None or rule == "always":
            return True
        if rule == "never":
            return False

        def matches(f: Any) -> bool:
            return f is not None and ((f.tool_names is not None and tool.name in f.tool_names)
                                      or (f.read_only is not None and f.read_only == tool.read_only))

        if matches(rule.never):
            return False
        if matches(rule.always):
            return True
        return rule.never is not None or rule.always is None  # only `never` given: the rest need approval


@dataclass(frozen=True)
class Approval:
    """The client's answer to one of the previous response's mcp_approval_request items."""

    request_id: str
    server_label: str
    name: str
    arguments: str
    approve: bool
    reason: str | None


@dataclass(frozen=True)
class McpPlan:
    servers: tuple[McpServer, ...]
    approvals: tuple[Approval, ...]
    settings: McpSettings


@dataclass
class Exposed:
    """A listed tool as the model sees it: the function name it calls it by, its server and its MCP name."""

    function: str
    server: McpServer
    tool: ListedTool

    def chat_tool(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.function, "description": self.tool.description,
                                                 "parameters": self.tool.input_schema}}


def plan(req: ResponsesRequest, history: Sequence[dict[str, Any]], store: ResponseStore, owner: str,
         settings: McpSettings) -> McpPlan | None:
    """The request's MCP servers and answered approvals, checked (400s naming the field), or None without any.
    Claims each answered approval in the store: a second answer to the same request is a 400."""
    servers = []
    for n, tool in enumerate(req.tools or ()):
        if isinstance(tool, McpTool):
            servers.append(_server(tool, f"tools[{n}]", settings))
    labels = [s.label for s in servers]
    duplicate = next((label for label in labels if labels.count(label) > 1), None)
    if duplicate is not None:
        raise InvalidParameter(f"Two MCP tools have the server_label {duplicate!r}; each needs its own.", "tools")
    choice = req.tool_choice
    if isinstance(choice, McpChoice) and choice.server_label not in labels:
        raise InvalidParameter(f"tool_choice names the MCP server {choice.server_label!r}, which no mcp tool of the "
                               "request has.", "tool_choice")
    answers = [(n, item) for n, item in enumerate(req.input if isinstance(req.input, list) else ())
               if isinstance(item, McpApprovalResponseItem)]
    if not servers:
        if answers:
            raise InvalidParameter("An mcp_approval_response needs the mcp tool of its server in `tools`.",
                                   f"input[{answers[0][0]}]")
        return None
    asked = {item.get("id"): item for item in history if item.get("type") == "mcp_approval_request"}
    approvals = []
    for n, answer in answers:
        where = f"input[{n}].approval_request_id"
        asked_for = asked.get(answer.approval_request_id)
        if asked_for is None:
            raise InvalidParameter(f"No approval request {answer.approval_request_id!r} in the previous response.",
                                   where)
        if asked_for.get("server_label") not in labels:
            raise InvalidParameter(f"The approval request's server {asked_for.get('server_label')!r} is not among "
                                   "the request's mcp tools.", where)
        approvals.append(Approval(answer.approval_request_id, str(asked_for["server_label"]), str(asked_for["name"]),
                                  str(asked_for.get("arguments") or "{}"), answer.approve, answer.reason))
    for approval in approvals:  # last: a request refused for another reason leaves its approvals unanswered
        if not store.claim(owner, f"approval:{approval.request_id}"):
            raise InvalidParameter(f"The approval request {approval.request_id!r} was answered already.",
                                   "input", "approval_already_answered")
    return McpPlan(tuple(servers), tuple(approvals), settings)


def _server(tool: McpTool, where: str, settings: McpSettings) -> McpServer:
    allowed = tool.allowed_tools
    names = tuple(allowed) if isinstance(allowed, list) else \
        tuple(allowed.tool_names) if allowed is not None and allowed.tool_names is not None else None
    spec = next((s for s in settings.configured if s.label == tool.server_label), None)
    if spec is not None:
        if tool.server_url is not None:
            raise InvalidParameter(f"{tool.server_label!r} is a server this one runs: name it by server_label alone, "
                                   "without server_url.", f"{where}.server_url")
        own = tuple(spec.allowed_tools) if spec.allowed_tools is not None else None
        names = tuple(n for n in names if own is None or n in own) if names is not None else own
        if spec.require_approval == "always" and tool.require_approval not in (None, "always"):
            raise InvalidParameter(f"The server {tool.server_label!r} asks for approval of every call (its "
                                   "operator's setting): a request may not turn that off.", f"{where}.require_approval")
        return McpServer(spec.label, spec.url or "", where, names,
                         tool.require_approval if tool.require_approval is not None else spec.require_approval or "always",
                         dict(spec.headers), configured=True)
    if tool.connector_id is not None:
        raise InvalidParameter("Connectors are not served here; give the MCP server's server_url.",
                               f"{where}.connector_id", "unsupported_parameter")
    if tool.server_url is None:
        raise InvalidParameter(f"No MCP server labelled {tool.server_label!r} runs here: give the tool its server_url.",
                               f"{where}.server_url", "missing_required_parameter")
    origin = origin_of(tool.server_url)
    if origin is None:
        raise InvalidParameter("`server_url` must be an http(s) URL without user info.", f"{where}.server_url")
    if origin not in settings.allowed:
        raise InvalidParameter(f"This server does not reach MCP servers at {origin[0]}://{origin[1]}:{origin[2]} "
                               "(the operator allows the origins in --allowed-mcp-servers).", f"{where}.server_url")
    headers = dict(tool.headers or {})
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name) or name.lower() in _TRANSPORT_HEADERS or not _FIELD_VALUE.fullmatch(value):
            raise InvalidParameter("`headers` holds a header that cannot be sent: a name must be an HTTP token and "
                                   "not one the connection sets itself (Host, Content-Length, Transfer-Encoding, "
                                   "Connection, Upgrade, the Mcp-* ones…), a value printable text without line "
                                   "breaks.", f"{where}.headers")
    if tool.authorization is not None:
        if not _FIELD_VALUE.fullmatch(tool.authorization):
            raise InvalidParameter("`authorization` must be printable text without line breaks.",
                                   f"{where}.authorization")
        headers["Authorization"] = f"Bearer {tool.authorization}"
    return McpServer(tool.server_label, tool.server_url, where, names, tool.require_approval, headers)


def expose(listed: Sequence[tuple[McpServer, Sequence[ListedTool]]], taken: set[str]) -> list[Exposed]:
    """Each listed tool under the function name the model calls it by, unique among them all and the function
    tools (`taken`): its own name, else `label__name`, else `label__` and a digest of both (any name too long or
    with other characters than a function name's takes the last)."""
    counts: dict[str, int] = {}
    for _, tools in listed:
        for tool in tools:
            counts[tool.name] = counts.get(tool.name, 0) + 1
    used = set(taken)
    exposed = []
    for server, tools in listed:
        for tool in tools:
            digest = hashlib.sha256(f"{server.label}\0{tool.name}".encode()).hexdigest()[:12]
            for name in (tool.name if counts[tool.name] == 1 else "", f"{server.label}__{tool.name}",
                         f"{server.label[:48]}__{digest}"):
                if _function_name(name) and name not in used:
                    break
            used.add(name)
            exposed.append(Exposed(name, server, tool))
    return exposed


def _function_name(name: str) -> str:
    """A name as a function name ([a-zA-Z0-9_-], at most 64), or "" if it has other characters."""
    ok = name and len(name) <= 64 and all(c.isascii() and (c.isalnum() or c in "_-") for c in name)
    return name if ok else ""
