"""schemathesis checks of our own, loaded by the fuzz test through SCHEMATHESIS_HOOKS."""

from __future__ import annotations

import schemathesis


@schemathesis.check
def error_envelope(ctx, response, case):  # noqa: ARG001 - schemathesis passes all three
    """Every 4xx and 5xx body is the error envelope: {"error": {message, type, param, code}} (Azure's paths add
    fields around it; Anthropic's Messages paths answer {"type": "error", "error": {type, message}}; Cohere's
    /v2/rerank {"message"} and OpenVINO Model Server's /v3/rerank {"error": message})."""
    if response.status_code < 400:
        return None
    body = response.json()
    path = response.request.path_url.split("?")[0]
    if path in ("/v2/rerank", "/v3/rerank"):
        message = body.get("message" if path == "/v2/rerank" else "error") if isinstance(body, dict) else None
        assert isinstance(message, str) and message and "Traceback" not in message, response.text[:300]
        return None
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"no error envelope: {response.text[:300]}"
    error = body["error"]
    anthropic = response.request.path_url.split("?")[0].startswith("/v1/messages")  # Anthropic's shape there
    if anthropic:
        assert body.get("type") == "error", f"not Anthropic's error shape: {response.text[:300]}"
    missing = ({"message", "type"} | (set() if anthropic else {"param", "code"})) - set(error)
    assert not missing, f"the envelope lacks {sorted(missing)}: {response.text[:300]}"
    assert isinstance(error["message"], str) and error["message"], "an empty error message"
    assert "Traceback" not in error["message"] and "panic" not in error["message"], error["message"][:300]
    return None
