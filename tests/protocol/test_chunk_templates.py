"""A streamed chat chunk that only adds text is written from a template (service/chat.py), not by pydantic: on the
wire it must be byte for byte what the model would serialize to, whatever the text holds."""

from __future__ import annotations

import asyncio
import json

import httpx
import pydantic_core
import pytest

from servelm.compose import DeploymentOptions, build_deployment
from servelm.protocol.chat import ChatCompletionChunk, ChatCompletionRequest
from servelm.runners.fake import FakeRunner
from servelm.service.chat import ChatService
from servelm.service.registry.deployments import Deployments


def test_json_dumps_escapes_every_character_as_pydantic_does():
    text = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)  # every scalar value
    assert json.dumps(text, ensure_ascii=False).encode() == pydantic_core.to_json(text)


@pytest.mark.parametrize("extra", [{}, {"stream_options": {"include_usage": True}}, {"n": 2, "seed": 3},
                                   {"logprobs": True, "top_logprobs": 2}])
def test_every_streamed_chunk_is_what_its_model_serializes_to(fake_server, extra):
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "a \" quote\n, é, 🙂 and \x01"}],
            "max_tokens": 24, "stream": True, "temperature": 1.0, **extra}
    with httpx.stream("POST", fake_server.base_url + "/v1/chat/completions", json=body, timeout=20) as r:
        assert r.status_code == 200
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    texts = [c["delta"].get("content") for f in frames for c in json.loads(f)["choices"]]
    assert sum(bool(t) for t in texts) >= 10  # the text chunks are there
    for frame in frames:
        assert ChatCompletionChunk.model_validate_json(frame).model_dump_json(exclude_unset=True) == frame


@pytest.mark.parametrize("name", ["a \"model\" é", "servelm:text-of-the-chunk"])  # the second: the template's mark
@pytest.mark.parametrize("extra", [{}, {"stream_options": {"include_usage": True}}, {"n": 3}])
def test_the_wire_stream_is_the_model_stream_serialized(extra, name):
    deployment, engine = build_deployment(name, FakeRunner(context_window=256), DeploymentOptions(prefix_cache=False))
    service = ChatService(Deployments([deployment]))
    req = ChatCompletionRequest(model=deployment.name, messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                stream=True, temperature=1.0, seed=11, **extra)
    prepared = service.prepare(req)

    async def both() -> tuple[list[bytes], list[bytes]]:
        wire = [c if isinstance(c, bytes) else c.model_dump_json(exclude_unset=True).encode()
                async for c in service.stream(prepared)]
        models = [c.model_dump_json(exclude_unset=True).encode() async for c in service.chunks(prepared)]
        return wire, models

    engine.start()
    try:
        wire, models = asyncio.run(both())
    finally:
        engine.stop()
    assert len(wire) > 10 and wire == models
