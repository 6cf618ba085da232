"""Shared helpers for the end-to-end tests: run one chat request (streamed or not), check every
structural promise of the response on the way, and fold it into one comparable Outcome."""

from __future__ import annotations

import asyncio
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_usage import CompletionUsage

MODEL = "smollm2-135m-instruct"


def client_for(root_url: str, api_key: str = "none", path: str = "/v1") -> openai.OpenAI:
    """The official client for a server under test: no retries (a failure must show), a generous timeout."""
    return openai.OpenAI(base_url=root_url + path, api_key=api_key, max_retries=0, timeout=120)

# SmolLM2's end-of-generation tokens: <|endoftext|> (0) and <|im_end|> (2). Banning them makes a request
# run to its token limit.
NO_EOS = {"0": -100, "2": -100}

HELLO = [{"role": "user", "content": "Hi there!"}]
STORY = [{"role": "user", "content": "Write a story about a cat."}]
APPLES = [{"role": "user", "content": "Repeat the word 'apple' many times: apple apple apple"}]


@dataclass
class RunningServer:
    """The e2e session's server subprocess."""

    base_url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no server log: {exc})"


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@dataclass
class Outcome:
    """One request's result, the same shape whether it was streamed or not."""

    texts: list[str]
    finish_reasons: list[str | None]
    stop_reasons: list[Any]
    usage: CompletionUsage | None
    response: ChatCompletion | None = None
    chunks: list[ChatCompletionChunk] = field(default_factory=list)

    @property
    def text(self) -> str:
        assert len(self.texts) == 1
        return self.texts[0]

    @property
    def finish_reason(self) -> str | None:
        assert len(self.finish_reasons) == 1
        return self.finish_reasons[0]

    @property
    def stop_reason(self) -> Any:
        assert len(self.stop_reasons) == 1
        return self.stop_reasons[0]

    def same_result(self) -> tuple:
        """What must be equal between a streamed and a non-streamed run of the same request."""
        usage = None if self.usage is None else (
            self.usage.prompt_tokens, self.usage.completion_tokens, self.usage.total_tokens)
        return self.texts, self.finish_reasons, self.stop_reasons, usage


def stop_reason_of(choice: Any) -> Any:
    """`stop_reason` is a vLLM extension; the openai client keeps it among the model's extras."""
    return (choice.model_extra or {}).get("stop_reason")


def _request(stream: bool, kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    kw = dict(kwargs)
    kw.setdefault("model", MODEL)
    include_usage = False
    if stream:
        kw["stream"] = True
        kw.setdefault("stream_options", {"include_usage": True})
        include_usage = bool((kw["stream_options"] or {}).get("include_usage"))
    return kw, include_usage


def chat(client: openai.OpenAI, *, stream: bool, **kwargs: Any) -> Outcome:
    """One chat completion through the client; streams ask for the usage chunk unless told otherwise."""
    kw, include_usage = _request(stream, kwargs)
    n = kw.get("n") or 1
    if not stream:
        return fold_completion(client.chat.completions.create(**kw), n)
    chunks = list(client.chat.completions.create(**kw))
    return fold_stream(chunks, n, include_usage)


async def achat(client: openai.AsyncOpenAI, *, stream: bool, **kwargs: Any) -> Outcome:
    kw, include_usage = _request(stream, kwargs)
    n = kw.get("n") or 1
    if not stream:
        return fold_completion(await client.chat.completions.create(**kw), n)
    chunks = [c async for c in await client.chat.completions.create(**kw)]
    return fold_stream(chunks, n, include_usage)


def _check_usage(usage: CompletionUsage | None) -> None:
    assert usage is not None
    assert usage.prompt_tokens > 0
    assert usage.completion_tokens >= 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def _check_created(created: int) -> None:
    assert isinstance(created, int)
    assert abs(created - time.time()) < 3600, created


def fold_completion(resp: ChatCompletion, n: int) -> Outcome:
    assert resp.id.startswith("chatcmpl-"), resp.id
    assert resp.object == "chat.completion"
    _check_created(resp.created)
    assert resp.model == MODEL
    assert isinstance(resp.system_fingerprint, str) and resp.system_fingerprint
    assert [c.index for c in resp.choices] == list(range(n))
    for c in resp.choices:
        assert c.message.role == "assistant"
        assert isinstance(c.message.content, str)
        assert c.finish_reason in ("stop", "length"), c.finish_reason
    _check_usage(resp.usage)
    return Outcome(
        texts=[c.message.content for c in resp.choices],
        finish_reasons=[c.finish_reason for c in resp.choices],
        stop_reasons=[stop_reason_of(c) for c in resp.choices],
        usage=resp.usage,
        response=resp,
    )


def fold_stream(chunks: list[ChatCompletionChunk], n: int, include_usage: bool) -> Outcome:
    """Check a finished stream chunk by chunk, then fold it. The client ended it at `data: [DONE]`."""
    assert chunks, "the stream carried no chunks"
    first = chunks[0]
    assert first.id.startswith("chatcmpl-"), first.id
    _check_created(first.created)
    texts = [""] * n
    finish: list[str | None] = [None] * n
    stops: list[Any] = [None] * n
    seen = [False] * n
    usage = None
    for i, chunk in enumerate(chunks):
        assert chunk.object == "chat.completion.chunk"
        assert chunk.id == first.id and chunk.created == first.created
        assert chunk.model == MODEL
        assert chunk.system_fingerprint == first.system_fingerprint and chunk.system_fingerprint
        if include_usage and i == len(chunks) - 1:
            assert chunk.choices == [], "the usage chunk must have no choices"
            assert chunk.usage is not None, "the last chunk must carry usage"
            usage = chunk.usage
            continue
        assert chunk.usage is None, f"chunk {i} carries usage: {chunk}"
        assert chunk.choices, f"chunk {i} has no choices and is not the usage chunk"
        for c in chunk.choices:
            assert 0 <= c.index < n
            assert finish[c.index] is None, f"choice {c.index} got a chunk after its finish_reason"
            if not seen[c.index]:
                assert c.delta.role == "assistant", f"the first delta of choice {c.index} lacks the role"
                seen[c.index] = True
            else:
                assert c.delta.role is None
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                assert c.finish_reason in ("stop", "length"), c.finish_reason
                finish[c.index] = c.finish_reason
                stops[c.index] = stop_reason_of(c)
    assert all(seen), "a choice never appeared in the stream"
    assert all(f is not None for f in finish), f"a choice ended without a finish_reason: {finish}"
    if include_usage:
        _check_usage(usage)
    return Outcome(texts, finish, stops, usage, chunks=chunks)


def health(base_url: str) -> dict[str, Any]:
    r = httpx.get(f"{base_url}/health", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["deployments"][MODEL]


def wait_idle(base_url: str, timeout: float = 10.0) -> tuple[bool, dict[str, Any]]:
    """Poll /health until nothing runs or waits and the KV cache is empty; return (idle, last stats)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = health(base_url)
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_cells_used"] == 0:
            return True, stats
        if time.monotonic() > deadline:
            return False, stats
        time.sleep(0.05)


async def gather_watching_running(base_url: str, tasks: list[Any]) -> tuple[list[Any], int]:
    """Run the tasks together while polling /health; returns their results and the peak running count."""
    peak = 0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        async with httpx.AsyncClient(timeout=10) as http:
            while not done.is_set():
                stats = (await http.get(f"{base_url}/health")).json()["deployments"][MODEL]
                peak = max(peak, stats["running"])
                await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        results = await asyncio.gather(*tasks)
    finally:
        done.set()
        await watcher
    return list(results), peak


# -- JSON Schema, checked by hand (the subset the structured-output tests use) -------------------
_SCHEMA_KEYWORDS = {
    "type", "enum", "const", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "minimum", "maximum", "title", "description",
}
_JSON_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def schema_errors(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """Where value breaks schema (empty when it validates). A keyword outside the subset is a test bug."""
    import re

    unknown = set(schema) - _SCHEMA_KEYWORDS
    assert not unknown, f"schema_errors does not check {sorted(unknown)}"
    errors: list[str] = []
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_JSON_TYPES[t](value) for t in types):
            return [f"{path}: {value!r} is not of type {schema['type']}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: {value!r} is not {schema['const']!r}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: {value!r} is shorter than {schema['minLength']}")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: {value!r} is longer than {schema['maxLength']}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: {value!r} does not match {schema['pattern']!r}")
    if _JSON_TYPES["number"](value):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value!r} is below {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value!r} is above {schema['maximum']}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: {len(value)} items, fewer than {schema['minItems']}")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: {len(value)} items, more than {schema['maxItems']}")
        for i, item in enumerate(value):
            errors += schema_errors(item, schema.get("items", {}), f"{path}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", ()):
            if key not in value:
                errors.append(f"{path}: the required property {key!r} is missing")
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                errors += schema_errors(item, props[key], f"{path}.{key}")
            elif extra is False:
                errors.append(f"{path}: the property {key!r} is not allowed")
            elif isinstance(extra, dict):
                errors += schema_errors(item, extra, f"{path}.{key}")
    return errors


def assert_valid_json(text: str, schema: dict[str, Any]) -> Any:
    """text is one JSON value that validates against schema; returns the value."""
    import json

    value = json.loads(text)
    errors = schema_errors(value, schema)
    assert not errors, f"{text!r} breaks its schema: {errors}"
    return value
