"""GET /: the playground, one page of plain HTML and JavaScript that talks to this server's own API.

No build step and no CDN: the page is servelm/http/static/playground.html, served as it is. It holds nothing
secret; when API keys are on it asks for one and sends it with each request (the key stays in the tab). Its
Content-Security-Policy lets it run only its own inline script (by hash) and talk only to this origin.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse


def _page() -> tuple[str, str]:
    html = resources.files("servelm.http").joinpath("static/playground.html").read_text(encoding="utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", html, re.S)
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in scripts)
    policy = (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; "
              "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html, policy


def build_playground_router() -> APIRouter:
    html, policy = _page()
    headers = {"Content-Security-Policy": policy, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache",
               "Referrer-Policy": "no-referrer"}
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def playground() -> HTMLResponse:
        return HTMLResponse(html, headers=headers)

    return router
