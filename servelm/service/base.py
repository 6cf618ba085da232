"""The protocol every text-generating service has (chat, completions, DJL's native schema), which the routes
drive the same way: prepare (every 400 before anything runs), then stream chunks or complete one answer."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable
from typing import Protocol, TypeVar

from pydantic import BaseModel

from servelm.engine.types import GenerationRequest
from servelm.service.params import RequestContext
from servelm.service.registry.deployments import Deployments, TextDeployment
from servelm.service.safety.content_filter import Screening


class Prepared(Protocol):
    """A request checked and turned into engine requests, not yet running."""

    @property
    def stream(self) -> bool: ...

    @property
    def deployment(self) -> TextDeployment: ...

    @property
    def generations(self) -> tuple[GenerationRequest, ...]: ...

    @property
    def screening(self) -> Screening | None:
        """Its deployment's content policy on this request (None: no policy)."""
        ...


class Translated:
    """A request prepared as another service's request (the Responses and Messages APIs over chat, DJL's schema
    over completions): that one's stream flag, deployment and generations are its own."""

    @property
    def inner(self) -> Prepared:
        raise NotImplementedError

    @property
    def stream(self) -> bool:
        return self.inner.stream

    @property
    def deployment(self) -> TextDeployment:
        return self.inner.deployment

    @property
    def generations(self) -> tuple[GenerationRequest, ...]:
        return self.inner.generations

    @property
    def screening(self) -> Screening | None:
        return self.inner.screening


class NamedRequest(Protocol):
    """A generating request as the route sees it before it is prepared: the model it names (None: the default)."""

    @property
    def model(self) -> str | None: ...


Req = TypeVar("Req", bound=NamedRequest, contravariant=True)
P = TypeVar("P", bound=Prepared)


class GeneratingService(Protocol[Req, P]):
    deployments: Deployments
    operation: str  # the OpenTelemetry GenAI operation name: "chat" or "text_completion"

    def prepare(self, req: Req, ctx: RequestContext) -> P:
        """Check the request and make its engine requests: raises the 4xx for anything it cannot run."""
        ...

    def complete(self, p: P) -> Awaitable[BaseModel]:
        """Run it to the end: one answer."""
        ...

    def stream(self, p: P) -> AsyncGenerator[BaseModel | bytes, None]:
        """Run it, a chunk at a time (a chunk the service wrote as JSON itself comes as bytes)."""
        ...
