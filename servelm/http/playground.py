"""GET /: the playground, one page of plain HTML and JavaScript that talks to this server's own API.

No build step and no CDN: the page is servelm/http/static/playground.html, served as it is. It holds nothing
secret; when API keys are on it asks for one and sends it with each request (the key stays in the tab). Its
Content-Security-Policy lets it run only its own inline script (by hash) and talk only to this origin.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from servelm.http.routes import Route, router_of


@functools.cache
def _page() -> tuple[str, dict[str, str]]:
    """The page, and its headers: a Content-Security-Policy that lets it run only its own inline script (by hash)
    and talk only to this origin."""
    html = resources.files("servelm.http").joinpath("static/playground.html").read_text(encoding="utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", html, re.S)
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in scripts)
    policy = (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; "
              "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html, {"Content-Security-Policy": policy, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache",
                  "Referrer-Policy": "no-referrer"}


async def playground() -> HTMLResponse:
    html, headers = _page()
    return HTMLResponse(html, headers=headers)


ROUTES = (Route("GET", "/", playground, schema=False),)


def build_playground_router() -> APIRouter:
    _page()  # read once, as the app is built
    return router_of(ROUTES)
