"""A batch's input and output lines, in OpenAI's JSONL format (vLLM's run-batch reads the same).

An input line is `{"custom_id", "method": "POST", "url", "body"}`; an output line is `{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}`, in the output file when the status is 2xx and in the
error file otherwise (`error` set, `response` null, for a line that got no answer at all: an expired batch's)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Container, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from servelm.batch.objects import BatchError
from servelm.batch.store import LineResult, new_id

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
PRIORITIZED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})  # they take `priority`
MAX_ERRORS = 100  # a malformed file's errors listed in the batch (the first ones)
MAX_WINDOW_S = 30 * 86400  # the longest completion window a batch may ask for
_WINDOW = re.compile(r"([1-9][0-9]{0,7})([smhd])", re.ASCII)  # ASCII digits, then the unit: nothing else
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_SCAN = 1 << 16  # a file is counted this many bytes at a time


def window_seconds(window: str) -> int | None:
    """A completion window in seconds: OpenAI's `24h`, or any `<n>s|m|h|d` (servelm's) up to MAX_WINDOW_S; None if
    malformed or longer."""
    m = _WINDOW.fullmatch(window)
    seconds = int(m.group(1)) * _UNIT[m.group(2)] if m else 0
    return seconds if 0 < seconds <= MAX_WINDOW_S else None


@dataclass(frozen=True)
class BatchLine:
    number: int  # its line in the input file, from 1
    custom_id: str
    body: dict[str, Any]
    url: str = ""  # its endpoint


class MalformedFile(Exception):
    """The file is not a batch for this endpoint: OpenAI's BatchError objects, by line."""

    def __init__(self, errors: list[BatchError]) -> None:
        super().__init__(errors[0].message if errors else "malformed batch file")
        self.errors = errors


def shown(value: object, limit: int = 80) -> str:
    """A value quoted in an error, cut to `limit` characters (a line's own strings may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def batch_error(code: str, message: str, line: int | None = None, param: str | None = None) -> BatchError:
    return BatchError(code=code, message=message, param=param, line=line)


def count_requests(f: BinaryIO, stop_after: int) -> int:
    """How many lines of a file are not blank, read _SCAN bytes at a time (counting stops past `stop_after`)."""
    count, under_way = 0, False  # under_way: the line being read has something in it
    while count <= stop_after and (chunk := f.read(_SCAN)):
        pieces = chunk.split(b"\n")
        for piece in pieces[:-1]:  # each ends a line
            count += under_way or bool(piece.strip())
            under_way = False
        under_way = under_way or bool(pieces[-1].strip())
    return count + under_way


def file_lines(f: BinaryIO, max_bytes: int, first: int = 1) -> Iterator[tuple[int, bytes | None]]:
    """A file's lines that are not blank, a line at a time, with their numbers (the line where `f` is: `first`);
    None for a line longer than `max_bytes`, read past without holding it."""
    number = first - 1
    while raw := f.readline(max_bytes + 1):
        number += 1
        if len(raw) > max_bytes and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(_SCAN)
            yield number, None
        elif raw.strip():
            yield number, raw


def parse_line(raw: bytes | None, number: int, endpoint: str | None,
               max_bytes: int) -> tuple[BatchLine | None, list[BatchError]]:
    """One line of a batch file as a request, and what is wrong with it: not UTF-8, longer than `max_bytes`, not a
    JSON object (nested too deeply included), no custom_id string, a method other than POST, a url other than the
    batch's endpoint (None: any endpoint a batch serves, line by line, as vLLM's run-batch takes them), a body that
    is not an object. A body's own fields are the endpoint's to check."""
    if raw is None:
        return None, [batch_error("line_too_long", f"line {number} is longer than {max_bytes} bytes, the largest request "
                             "body the server takes (--max-body-bytes).", number)]
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return None, [batch_error("invalid_json_line", f"line {number} is not UTF-8 text ({exc.reason} at byte "
                             f"{exc.start}).", number)]
    except ValueError as exc:  # JSONDecodeError, or an integer of too many digits
        return None, [batch_error("invalid_json_line", f"line {number} is not JSON: {getattr(exc, 'msg', exc)}.", number)]
    except RecursionError:
        return None, [batch_error("invalid_json_line", f"line {number} is nested too deeply to read.", number)]
    if not isinstance(obj, dict):
        return None, [batch_error("invalid_request", f"line {number} is not a JSON object.", number)]
    errors = []
    custom_id, body, url = obj.get("custom_id"), obj.get("body"), obj.get("url")
    if not isinstance(custom_id, str) or not custom_id:
        errors.append(batch_error("missing_required_parameter", f"line {number} has no custom_id string.", number,
                             "custom_id"))
    if obj.get("method") != "POST":
        errors.append(batch_error("invalid_request", f"line {number}: method must be POST.", number, "method"))
    if endpoint is not None and url != endpoint:
        errors.append(batch_error("invalid_url", f"line {number}: url {shown(url)} is not the batch's endpoint {endpoint!r}.",
                             number, "url"))
    elif url not in ENDPOINTS:
        errors.append(batch_error("invalid_url", f"line {number}: url {shown(url)} is none of {', '.join(ENDPOINTS)}.",
                             number, "url"))
    if not isinstance(body, dict):
        errors.append(batch_error("invalid_request", f"line {number}: body must be a JSON object.", number, "body"))
    extra = set(obj) - {"custom_id", "method", "url", "body"}
    if extra:
        errors.append(batch_error("invalid_request", f"line {number} has unknown fields: {shown(sorted(extra))}.",
                             number))
    if isinstance(custom_id, str) and custom_id and isinstance(body, dict) and isinstance(url, str):
        return BatchLine(number, custom_id, body, url), errors
    return None, errors


def validate(f: BinaryIO, endpoint: str | None, max_lines: int, max_bytes: int) -> int:
    """How many requests a batch file holds, read a line at a time and each line let go once checked; or
    MalformedFile listing what is wrong: parse_line's errors, a repeated custom_id, no line at all, more than
    `max_lines`. What it keeps is a 16-byte digest per custom_id."""
    errors: list[BatchError] = []
    seen: set[bytes] = set()
    count = 0
    for number, raw in file_lines(f, max_bytes):
        line, problems = parse_line(raw, number, endpoint, max_bytes)
        errors += problems
        if line is not None:
            digest = hashlib.blake2b(line.custom_id.encode(), digest_size=16).digest()
            if digest in seen:
                errors.append(batch_error("duplicate_custom_id", f"line {number} repeats custom_id {shown(line.custom_id)}; "
                                     "each request of a batch needs its own.", number, "custom_id"))
            seen.add(digest)
        count += 1
        if count > max_lines:
            errors.append(batch_error("too_many_requests", f"the file holds more than {max_lines} requests; a batch may "
                                 f"hold at most {max_lines} (--batch-max-lines)."))
        if len(errors) >= MAX_ERRORS or count > max_lines:
            break
    if not errors and not count:
        errors.append(batch_error("empty_file", "the file holds no requests."))
    if errors:
        raise MalformedFile(errors[:MAX_ERRORS])
    return count


def requests(f: BinaryIO, endpoint: str | None, max_bytes: int, skip: Container[int] = (),
             first: int = 1) -> Iterator[tuple[int, BatchLine | LineResult]]:
    """A validated file's requests with their line numbers, a line at a time (file_lines), but those numbered in
    `skip` (answered already); a line that no longer reads as one (the file changed on disk since) is its error
    line."""
    for number, raw in file_lines(f, max_bytes, first):
        if number not in skip:
            line, problems = parse_line(raw, number, endpoint, max_bytes)
            yield number, line if line is not None and not problems else unreadable(number, problems)


def request_body(line: BatchLine, endpoint: str, priority: int) -> dict[str, Any]:
    """What a line sends to its endpoint: its body, at the batch's priority unless it asks for a lower one itself
    (a higher number)."""
    body = dict(line.body)
    own = body.get("priority")
    if endpoint in PRIORITIZED and (own is None or (isinstance(own, int) and not isinstance(own, bool) and own < priority)):
        body["priority"] = priority
    return body


def answered(line: BatchLine, status: int, request_id: str, body: object) -> LineResult:
    """The output line of a request that got an HTTP answer (2xx: the output file; else the error file)."""
    ok = 200 <= status < 300
    out = {"id": new_id("batch_req_"), "custom_id": line.custom_id,
           "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}
    usage = body.get("usage") if ok and isinstance(body, dict) else None
    tokens = _tokens(usage) if isinstance(usage, dict) else (0, 0, 0)
    return LineResult(line.number, ok, json.dumps(out, separators=(",", ":")), *tokens)


def unanswered(line: BatchLine, code: str, message: str) -> LineResult:
    """The error line of a request that got no answer (the batch expired before it ran)."""
    return _no_answer(line.number, line.custom_id, code, message)


def unreadable(number: int, errors: list[BatchError]) -> LineResult:
    """The error line of a line that is no request (its custom_id unknown)."""
    first = errors[0] if errors else batch_error("invalid_request", f"line {number} is not a request.", number)
    return _no_answer(number, None, first.code, first.message)


def _no_answer(number: int, custom_id: str | None, code: str, message: str) -> LineResult:
    out = {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
           "error": {"code": code, "message": message}}
    return LineResult(number, False, json.dumps(out, separators=(",", ":")))


def _tokens(usage: dict[str, Any]) -> tuple[int, int, int]:
    """(input, cached, output) tokens of an answer's usage, in the chat/completions/embeddings or Responses shape."""
    inputs = usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    outputs = usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
    return int(inputs), int(details.get("cached_tokens", 0) or 0), int(outputs)
