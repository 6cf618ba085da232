"""schemathesis against /openapi.json on a real HTTP server over the fake model: about 2,000 generated requests
(valid and invalid) to every route, checking that none is answered 5xx, that every 4xx is the error envelope,
and that none takes over 30 s. The document served is checked too: every route, the dialects included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from servelm.compose import build_deployment
from servelm.http.app import create_app
from servelm.runners.fake import FakeRunner
from servelm.service.registry.deployments import Deployments
from tests.conftest import serving

REPO = Path(__file__).resolve().parents[2]
MAX_EXAMPLES = 12  # per operation and phase: about 2,000 requests in all


@pytest.fixture(scope="module")
def server():
    runner = FakeRunner(num_slots=4, context_window=128)
    deployment, engine = build_deployment("fake-model", runner)
    app = create_app(Deployments([deployment]), on_start=engine.start, on_stop=engine.stop)
    with serving(app) as url:
        yield url


def test_the_document_describes_every_route_and_its_bodies(server):
    spec = httpx.get(server + "/openapi.json").json()
    paths = spec["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/chat/completions",
                 "/invocations", "/v3/chat/completions", "/v3/completions", "/health", "/metrics"):
        assert path in paths, path
    chat = paths["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    schemas = spec["components"]["schemas"]
    assert schemas["ChatCompletionRequest"]["additionalProperties"] is False
    assert {"messages", "model"} <= set(schemas["ChatCompletionRequest"]["required"])
    azure = paths["/chat/completions"]["post"]
    assert any(p["name"] == "api-version" and p["in"] == "query" and p["required"] for p in azure["parameters"])
    assert len(paths["/invocations"]["post"]["requestBody"]["content"]["application/json"]["schema"]["anyOf"]) == 3


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(server, tmp_path):
    """The served document, with `model` narrowed to the served names so that requests get past routing and into
    the engine; `st run` exits non-zero on any failed check."""
    spec = httpx.get(server + "/openapi.json").json()
    for schema in spec["components"]["schemas"].values():
        model = schema.get("properties", {}).get("model")
        if model is not None:
            schema["properties"]["model"] = {"type": "string", "enum": ["fake-model"]}
    path = tmp_path / "openapi.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.http.fuzz_checks", "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [str(Path(sys.executable).with_name("st")), "run", str(path), "--url", server,
         "--checks", "not_a_server_error,error_envelope", "--max-response-time", "30", "--request-timeout", "30",
         "--max-examples", str(MAX_EXAMPLES), "--seed", "13", "--no-shrink", "--warnings", "off",
         "--generation-codec", "utf-8"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
    )
    report = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, report
    generated = [line for line in run.stdout.splitlines() if "generated" in line]
    print(generated)
    count = int(generated[-1].split()[0]) if generated else 0
    assert count >= 1500, f"the fuzzer ran only {count} cases:\n{report}"
