"""What the routes share, typed and built once per app (http/app.py's create_app): the endpoint services over the
app's deployments, its metrics, its shutdown, and the settings the routes read. Routers take it when they are built;
the app keeps it as `app.state.servelm` (`state_of`) for the server around it (http/server.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from servelm.http.limits import Drain
from servelm.metrics import Metrics
from servelm.service.anthropic import MessagesService
from servelm.service.chat import ChatService
from servelm.service.completions import CompletionService
from servelm.service.conversations import ConversationsService, ConversationStore, MemoryConversations
from servelm.service.dialects import NativeService
from servelm.service.embeddings import EmbeddingService
from servelm.service.hosted_mcp import McpSettings
from servelm.service.registry.catalog import ModelCatalog
from servelm.service.registry.deployments import Deployments
from servelm.service.rerank import ScoreService
from servelm.service.responses import ResponsesService
from servelm.service.store import ResponseStore
from servelm.service.tokenize import TokenizeService

STATE_KEY = "servelm"  # the attribute of Starlette's app.state that holds the AppState


@dataclass(frozen=True)
class Services:
    """The endpoint services, one of each over the app's deployments."""

    chat: ChatService
    completions: CompletionService
    ovms_completions: CompletionService  # OpenVINO Model Server's: no default max_tokens (up to the context window)
    native: NativeService  # DJL's schema over completions
    embeddings: EmbeddingService
    scores: ScoreService  # rerank and score
    responses: ResponsesService
    conversations: ConversationsService
    messages: MessagesService
    tokens: TokenizeService

    @classmethod
    def build(cls, deployments: Deployments, store: ResponseStore, mcp: McpSettings = McpSettings(),
              conversations: ConversationStore | None = None) -> Services:
        """`store` keeps the Responses API's stored answers, `conversations` its conversations (default: in memory);
        `mcp`: the MCP servers its requests may reach."""
        chat = ChatService(deployments)
        completions = CompletionService(deployments)
        talks = ConversationsService(conversations or MemoryConversations())
        return cls(chat=chat, completions=completions,
                   ovms_completions=CompletionService(deployments, default_max_tokens=None),
                   native=NativeService(completions), embeddings=EmbeddingService(deployments),
                   scores=ScoreService(deployments), responses=ResponsesService(chat, store, mcp, talks),
                   conversations=talks,
                   messages=MessagesService(chat), tokens=TokenizeService(chat))


@dataclass(frozen=True)
class AppState:
    """One app's shared parts: `timings` (every answer carries llama-server's timings), `catalog` (models loaded on
    demand), `health_reports` (what /health adds for a monitoring key, by name: e.g. the batch store's, no I/O)."""

    deployments: Deployments
    services: Services
    metrics: Metrics
    drain: Drain  # the server's shutdown, for requests in flight
    timings: bool = False
    catalog: ModelCatalog | None = None
    health_reports: Mapping[str, Callable[[], dict[str, Any]]] = field(default_factory=dict)
    store_damaged: Callable[[], bool] = lambda: False  # the --state-dir database found damaged while serving


def state_of(app: object) -> AppState | None:
    """The AppState of an app create_app made (None for any other ASGI app)."""
    found = getattr(getattr(app, "state", None), STATE_KEY, None)
    return found if isinstance(found, AppState) else None
