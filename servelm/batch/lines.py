"""A batch's input and output lines, in OpenAI's JSONL format (vLLM's run-batch reads the same).

An input line is `{"custom_id", "method": "POST", "url", "body"}`; an output line is `{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}`, in the output file when the status is 2xx and in the
error file otherwise (`error` set, `response` null, for a line that got no answer at all: an expired batch's)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from servelm.batch.store import LineResult, new_id

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
PRIORITIZED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})  # they take `priority`
MAX_ERRORS = 100  # a malformed file's errors listed in the batch (the first ones)
_WINDOW = re.compile(r"^(\d+)([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def window_seconds(window: str) -> int | None:
    """A completion window in seconds: OpenAI's `24h`, or any `<n>s|m|h|d` (servelm's); None if malformed."""
    m = _WINDOW.match(window)
    return int(m.group(1)) * _UNIT[m.group(2)] if m and int(m.group(1)) > 0 else None


@dataclass(frozen=True)
class BatchLine:
    number: int  # its line in the input file, from 1
    custom_id: str
    body: dict[str, Any]
    url: str = ""  # its endpoint


class MalformedFile(Exception):
    """The file is not a batch for this endpoint: OpenAI's BatchError objects, by line."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(errors[0]["message"] if errors else "malformed batch file")
        self.errors = errors


def _error(code: str, message: str, line: int | None = None, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def parse_lines(data: bytes, endpoint: str | None, max_lines: int) -> list[BatchLine]:
    """Every request of a batch file, or MalformedFile listing what is wrong (a line that is not a JSON object, a
    missing or repeated custom_id, a method other than POST, a url other than the batch's endpoint (None: any
    endpoint a batch serves, line by line, as vLLM's run-batch takes them), a body that is not an object; no line at
    all; more than `max_lines`). A body's own fields are the endpoint's to check, line by line."""
    errors: list[dict[str, Any]] = []
    lines: list[BatchLine] = []
    seen: set[str] = set()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedFile([_error("invalid_file", f"the file is not UTF-8 text ({exc.reason} at byte "
                                    f"{exc.start}).")]) from None
    for number, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            errors.append(_error("invalid_json_line", f"line {number} is not JSON: {exc.msg}.", number))
            continue
        if not isinstance(obj, dict):
            errors.append(_error("invalid_request", f"line {number} is not a JSON object.", number))
            continue
        custom_id, body = obj.get("custom_id"), obj.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            errors.append(_error("missing_required_parameter", f"line {number} has no custom_id string.", number,
                                 "custom_id"))
        elif custom_id in seen:
            errors.append(_error("duplicate_custom_id", f"line {number} repeats custom_id {custom_id!r}; each "
                                 "request of a batch needs its own.", number, "custom_id"))
        if obj.get("method") != "POST":
            errors.append(_error("invalid_request", f"line {number}: method must be POST.", number, "method"))
        url = obj.get("url")
        if endpoint is not None and url != endpoint:
            errors.append(_error("invalid_url", f"line {number}: url {url!r} is not the batch's endpoint "
                                 f"{endpoint!r}.", number, "url"))
        elif url not in ENDPOINTS:
            errors.append(_error("invalid_url", f"line {number}: url {url!r} is none of {', '.join(ENDPOINTS)}.",
                                 number, "url"))
        if not isinstance(body, dict):
            errors.append(_error("invalid_request", f"line {number}: body must be a JSON object.", number, "body"))
        extra = set(obj) - {"custom_id", "method", "url", "body"}
        if extra:
            errors.append(_error("invalid_request", f"line {number} has unknown fields: {', '.join(sorted(extra))}.",
                                 number))
        if isinstance(custom_id, str) and custom_id:
            seen.add(custom_id)
        if isinstance(custom_id, str) and isinstance(body, dict) and isinstance(url, str):
            lines.append(BatchLine(number, custom_id, body, url))
        if len(errors) >= MAX_ERRORS:
            break
    if not errors and not lines:
        errors.append(_error("empty_file", "the file holds no requests."))
    if not errors and len(lines) > max_lines:
        errors.append(_error("too_many_requests", f"the file holds {len(lines)} requests; a batch may hold at most "
                             f"{max_lines} (--batch-max-lines)."))
    if errors:
        raise MalformedFile(errors)
    return lines


def request_body(line: BatchLine, endpoint: str, priority: int) -> dict[str, Any]:
    """What a line sends to its endpoint: its body, at the batch's priority unless it asks for a lower one itself
    (a higher number)."""
    body = dict(line.body)
    own = body.get("priority")
    if endpoint in PRIORITIZED and (own is None or (isinstance(own, int) and not isinstance(own, bool) and own < priority)):
        body["priority"] = priority
    return body


def answered(line: BatchLine, status: int, request_id: str, body: Any) -> LineResult:
    """The output line of a request that got an HTTP answer (2xx: the output file; else the error file)."""
    ok = 200 <= status < 300
    out = {"id": new_id("batch_req_"), "custom_id": line.custom_id,
           "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}
    usage = body.get("usage") if ok and isinstance(body, dict) else None
    tokens = _tokens(usage) if isinstance(usage, dict) else (0, 0, 0)
    return LineResult(line.number, ok, json.dumps(out, separators=(",", ":")), *tokens)


def unanswered(line: BatchLine, code: str, message: str) -> LineResult:
    """The error line of a request that got no answer (the batch expired before it ran)."""
    out = {"id": new_id("batch_req_"), "custom_id": line.custom_id, "response": None,
           "error": {"code": code, "message": message}}
    return LineResult(line.number, False, json.dumps(out, separators=(",", ":")))


def _tokens(usage: dict[str, Any]) -> tuple[int, int, int]:
    """(input, cached, output) tokens of an answer's usage, in the chat/completions/embeddings or Responses shape."""
    inputs = usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    outputs = usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
    return int(inputs), int(details.get("cached_tokens", 0) or 0), int(outputs)
