"""The ASGI application: routes, error rendering, and the engines' lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from servelm.http import errors
from servelm.http.routes import build_router
from servelm.service.deployments import Deployments


def create_app(deployments: Deployments, *, on_start: Callable[[], None] | None = None,
               on_stop: Callable[[], None] | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_start is not None:
            on_start()
        try:
            yield
        finally:
            if on_stop is not None:
                on_stop()

    app = FastAPI(title="servelm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    errors.install(app)
    app.include_router(build_router(deployments))
    return app
