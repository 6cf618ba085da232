"""GET / serves the playground page: open without a key, strict about what it may run and reach, off with
--no-playground."""

from __future__ import annotations

import base64
import hashlib
import re

import httpx

from servelm.__main__ import settings_from_args
from servelm.compose import build_deployment
from servelm.http.app import AppOptions, create_app
from servelm.http.limits import SecurityConfig
from servelm.keys import key_spec
from servelm.runners.fake import FakeRunner
from servelm.service.registry.deployments import Deployments

from ..conftest import serving


def test_the_page_is_served_with_a_policy_that_allows_only_its_own_script(fake_server):
    r = httpx.get(fake_server.base_url + "/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<title>servelm playground</title>" in r.text
    assert "http://" not in r.text and "https://" not in r.text  # no CDN, nothing fetched from elsewhere
    policy = r.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "frame-ancestors 'none'" in policy
    (script,) = re.findall(r"<script>(.*?)</script>", r.text, re.S)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in policy  # exactly the page's own inline script may run
    assert r.headers["x-content-type-options"] == "nosniff"


def test_with_keys_the_page_is_open_and_the_api_is_not(fake_server_factory):
    server = fake_server_factory(security=SecurityConfig(keys=[key_spec("sk-secret")]))
    page = httpx.get(server.base_url + "/", timeout=10)
    assert page.status_code == 200 and "sk-secret" not in page.text
    assert httpx.get(server.base_url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(server.base_url + "/v1/models", headers={"Authorization": "Bearer sk-secret"},
                     timeout=10).status_code == 200


def test_no_playground_is_a_404_at_the_root():
    deployment, engine = build_deployment("fake-model", FakeRunner())
    app = create_app(Deployments([deployment]), AppOptions(playground=False), on_start=engine.start, on_stop=engine.stop)
    with serving(app) as url:
        r = httpx.get(url + "/", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_the_flag_turns_it_off():
    import argparse

    assert settings_from_args(argparse.Namespace(playground=False)).playground is False
    assert settings_from_args(argparse.Namespace()).playground is True
