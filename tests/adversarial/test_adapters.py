"""Attacks on LoRA adapters (service/registry/adapters.py, the engine's adapter frees, vLLM's load route).

- More adapters at once than --max-loras failed every request in flight, another key's base-model streams too: an
  adapter was freed while a request that had just started on it (or one whose abort the engine had not seen yet)
  was scheduled, and the step's KeyError failed them all. Now an adapter is loaded or freed only while no request
  holds it, the engine refuses to free one that scheduled work names, and a request past --max-loras waits for
  its turn.
- A lora_path with a component over NAME_MAX was a 500 (OSError: File name too long).
- A scale of NaN, Infinity or 1e999 was taken; an adapter file of zero tensors loaded.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from servelm.http.limits import SecurityConfig
from servelm.keys import key_spec

PROMPT = [{"role": "user", "content": "hello there"}]
ADMIN, TENANT, OTHER = "sk-admin", "sk-tenant", "sk-other"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def load(base: str, name: str, path: str, **extra) -> httpx.Response:
    return httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **extra},
                      headers=auth(ADMIN))


async def chat(client: httpx.AsyncClient, model: str, key: str) -> tuple[int, str]:
    """A request's status, and its text (an error's envelope)."""
    r = await client.post("/v1/chat/completions", headers=auth(key), json={
        "model": model, "messages": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    return r.status_code, r.text


async def stream(client: httpx.AsyncClient, model: str, key: str) -> tuple[int, str]:
    """A stream's status, and what it ended with: "[DONE]", or the error event it got."""
    async with client.stream("POST", "/v1/chat/completions", headers=auth(key), json={
            "model": model, "messages": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        last = ""
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                last = line[6:]
                if '"error"' in last:
                    break
        return r.status_code, last


async def abandoned(client: httpx.AsyncClient, model: str, key: str) -> None:
    """A stream its client leaves after its first token (the engine hears of the abort a little later)."""
    async with client.stream("POST", "/v1/chat/completions", headers=auth(key), json={
            "model": model, "messages": PROMPT, "max_tokens": 64, "ignore_eos": True, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                return


def adapter_files(tmp_path, n: int) -> list[tuple[str, str]]:
    files = []
    for i in range(n):
        path = tmp_path / f"a{i}.gguf"
        path.write_text(str(i + 1))  # the fake runner's adapter: a shift of its logits
        files.append((f"a{i}", str(path)))
    return files


async def test_more_adapters_at_once_than_max_loras_fail_no_one(fake_server_factory, tmp_path):
    """--max-loras 2 and 5 adapters: one request per adapter, abandoned streams on them, and another key's two
    base-model streams, together, in rounds. Every request answers, each adapter's as it does alone."""
    security = SecurityConfig(keys=(key_spec(ADMIN, admin=True), key_spec(TENANT), key_spec(OTHER)))
    server = fake_server_factory(security=security, step_delay=0.002, num_slots=8)
    server.deployment.adapters.max_loaded = 2
    names = []
    for name, path in adapter_files(tmp_path, 5):
        assert load(server.base_url, name, path).status_code == 200
        names.append(name)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        alone = {m: await chat(client, m, TENANT) for m in names}
        assert all(status == 200 for status, _ in alone.values()), alone
        for _ in range(4):
            results = await asyncio.gather(
                *(chat(client, m, TENANT) for m in names), *(abandoned(client, m, TENANT) for m in names),
                stream(client, "fake-model", OTHER), stream(client, "fake-model", OTHER))
            answers, bases = results[:len(names)], results[-2:]
            assert bases == [(200, "[DONE]")] * 2, "another key's base-model streams were failed"
            for m, (status, text) in zip(names, answers):
                assert status == 200, text
                assert json.loads(text)["choices"][0]["message"] == json.loads(alone[m][1])["choices"][0]["message"]
    loaded = [a.name for a in server.deployment.adapters.all() if a.loaded]
    assert len(loaded) <= 2 and set(server.runner.adapters) == set(loaded)


async def test_a_request_past_max_loras_gets_its_turn_while_the_loaded_adapter_stays_busy(fake_server_factory,
                                                                                           tmp_path):
    """--max-loras 1: three clients keep requests on `a0` under way without a gap; one on `a1` drains `a0` (new
    requests on it wait) and runs once a0's requests end, long before the flood stops."""
    server = fake_server_factory(step_delay=0.002)
    server.deployment.adapters.max_loaded = 1
    (a0, p0), (a1, p1) = adapter_files(tmp_path, 2)
    assert load(server.base_url, a1, p1).status_code == 200
    assert load(server.base_url, a0, p0).status_code == 200  # a0 loaded, a1 freed
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:

        async def flood(i: int) -> list[int]:
            await asyncio.sleep(i * 0.02)  # staggered: they never all end at once
            statuses = []
            while not stop.is_set():
                statuses.append((await chat(client, a0, "x"))[0])
            return statuses

        floods = [asyncio.create_task(flood(i)) for i in range(3)]
        await asyncio.sleep(0.3)
        loop = asyncio.get_running_loop()
        started = loop.time()
        status, text = await asyncio.wait_for(chat(client, a1, "x"), 5)
        waited = loop.time() - started
        stop.set()
        flooded = [s for statuses in await asyncio.gather(*floods) for s in statuses]
    assert status == 200, text
    assert waited < 2, f"the request on a1 waited {waited:.1f} s"
    assert set(flooded) == {200}


async def test_requests_naming_two_adapters_each_never_wait_for_each_other(fake_server_factory, tmp_path):
    """--max-loras 2, four adapters, requests naming two each by llama-server's `lora` list, overlapping pairs: no
    two waiting requests hold what the other needs, so all finish; an adapter unloaded meanwhile is a 404 to those
    still waiting for it (a 400 to those that name its id after), never a hang."""
    server = fake_server_factory(step_delay=0.002, num_slots=8)
    server.deployment.adapters.max_loaded = 2
    for name, path in adapter_files(tmp_path, 4):
        assert load(server.base_url, name, path).status_code == 200
    pairs = [(0, 1), (2, 3), (1, 2), (3, 0), (0, 2), (1, 3)] * 2

    async def pair(client: httpx.AsyncClient, ids: tuple[int, int]) -> int:
        r = await client.post("/v1/chat/completions", json={
            "model": "fake-model", "messages": PROMPT, "max_tokens": 12, "ignore_eos": True,
            "lora": [{"id": i, "scale": 1.0} for i in ids]})
        return r.status_code

    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        statuses = await asyncio.wait_for(asyncio.gather(*(pair(client, p) for p in pairs)), 30)
        assert statuses == [200] * len(pairs)
        waiting = [asyncio.create_task(pair(client, p)) for p in pairs]
        await asyncio.sleep(0.01)
        assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})).status_code == 200
        statuses = await asyncio.wait_for(asyncio.gather(*waiting), 30)
        # prepared after the unload: a 400 naming `lora` (an id this model has not); waiting for it: a 404
        assert set(statuses) <= {200, 400, 404} and 200 in statuses, statuses
    assert "a3" not in server.runner.adapters


async def test_an_unload_waits_for_the_requests_under_way_and_fails_none(fake_server_factory, tmp_path):
    server = fake_server_factory(step_delay=0.002)
    (name, path), = adapter_files(tmp_path, 1)
    assert load(server.base_url, name, path).status_code == 200
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        running = [asyncio.create_task(stream(client, name, "x")) for _ in range(3)]
        base = asyncio.create_task(stream(client, "fake-model", "x"))
        await asyncio.sleep(0.05)
        gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
        assert gone.status_code == 200
        assert [await t for t in running] == [(200, "[DONE]")] * 3
        assert await base == (200, "[DONE]")
        assert (await chat(client, name, "x"))[0] == 404
    assert not server.runner.adapters


def test_the_engine_refuses_to_free_an_adapter_that_scheduled_work_names(tmp_path):
    """Whatever the layer above decides, a free while a waiting or running request names the adapter leaves it
    loaded (AdapterInUse); once that request is gone, it frees."""
    from servelm.engine.base import AdapterInUse
    from servelm.engine.local import LocalEngine
    from servelm.engine.sequence import SequenceGroup
    from servelm.engine.types import SamplingParams
    from servelm.runners.fake import FakeRunner

    engine = LocalEngine(FakeRunner())
    (name, path), = adapter_files(tmp_path, 1)
    engine.load_adapter(name, path)
    engine.scheduler.add(SequenceGroup("r", (1, 2, 3), SamplingParams(max_tokens=1), adapters=((name, 1.0),)))
    with pytest.raises(AdapterInUse):
        engine.free_adapter(name)
    assert name in engine.runner.adapters
    engine.scheduler.abort("r")
    engine.free_adapter(name)
    assert name not in engine.runner.adapters


async def test_a_request_on_an_adapter_the_engine_lacks_fails_alone(fake_server_factory):
    from servelm.engine.output import EngineError
    from servelm.engine.types import GenerationRequest, SamplingParams

    server = fake_server_factory(step_delay=0.002)

    async def collect(request: GenerationRequest) -> list:
        return [out async for out in server.engine.generate(request)]

    base = asyncio.create_task(collect(GenerationRequest("base", (1, 2, 3), SamplingParams(max_tokens=16,
                                                                                             ignore_eos=True))))
    with pytest.raises(EngineError, match="not loaded"):
        await collect(GenerationRequest("lora", (1, 2, 3), SamplingParams(max_tokens=4), adapters=(("ghost", 1.0),)))
    assert (await base)[-1].finished


@pytest.mark.parametrize("component", [256, 300, 4000])
def test_a_lora_path_with_a_name_too_long_is_a_400_naming_lora_path(fake_server, tmp_path, component):
    r = load(fake_server.base_url, "long", str(tmp_path / ("a" * component)) + ".gguf")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "lora_path"


def test_a_lora_path_that_is_not_a_regular_file_is_a_400(fake_server, tmp_path):
    r = load(fake_server.base_url, "dir", str(tmp_path))
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


@pytest.mark.parametrize("scale", ["NaN", "Infinity", "-Infinity", "1e999", "10.5", "-11", "true", '"1"'])
def test_a_scale_that_is_not_a_finite_number_within_bounds_is_a_400(fake_server, tmp_path, scale):
    (name, path), = adapter_files(tmp_path, 1)
    body = f'{{"lora_name": "{name}", "lora_path": {json.dumps(path)}, "scale": {scale}}}'
    r = httpx.post(f"{fake_server.base_url}/v1/load_lora_adapter", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "scale"
    assert name not in fake_server.runner.adapters


@pytest.mark.parametrize("scale", ["-10", "0", "0.5", "10"])
def test_a_scale_within_bounds_loads(fake_server, tmp_path, scale):
    (name, path), = adapter_files(tmp_path, 1)
    assert load(fake_server.base_url, name, path, scale=float(scale)).status_code == 200


@pytest.mark.slow
@pytest.mark.e2e
async def test_on_the_real_model_more_adapters_than_max_loras_fail_no_one(tmp_path_factory):
    """The same attack on llama.cpp with scripts/make_test_lora.py's adapters: --max-loras 2, 4 adapters."""
    from tests.e2e import ray_mode
    from tests.e2e.conftest import own_server
    from tests.e2e.helpers import MODEL
    from tests.fixture_files import write_fixture

    if ray_mode.ENABLED:
        pytest.skip("under --ray each replica has its own adapters")
    d = tmp_path_factory.mktemp("loras")
    names = [f"s{i}" for i in range(4)]
    paths = [str(write_fixture("make_test_lora.py", d / f"{n}.gguf", "--seed", str(i))) for i, n in enumerate(names)]
    keys = ("--admin-key", ADMIN, "--api-key", TENANT, "--api-key", OTHER)
    with own_server(tmp_path_factory, "--max-loras", "2", "--no-embedding-model", "--max-num-seqs", "8", "--context-window", "512", *keys) as srv:
        for name, path in zip(names, paths):
            assert load(srv.base_url, name, path).status_code == 200
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=300) as client:
            for _ in range(2):
                results = await asyncio.gather(*(chat(client, m, TENANT) for m in names),
                                               *(abandoned(client, m, TENANT) for m in names[:2]),
                                               stream(client, MODEL, OTHER),
                                               stream(client, MODEL, OTHER))
                assert results[-2:] == [(200, "[DONE]")] * 2, "another key's base-model streams were failed"
                assert [status for status, _ in results[:len(names)]] == [200] * len(names), results


@pytest.mark.e2e
def test_an_adapter_file_of_zero_tensors_is_refused(tmp_path):
    """llama.cpp loads a LoRA GGUF with no tensors (an adapter that changes nothing); the runner refuses it, which
    the load route answers as its 400 invalid_lora."""
    import gguf

    from servelm.config import embedded_model_path
    from servelm.runners.llamacpp import LlamaCppRunner

    path = tmp_path / "empty.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 8.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    runner = LlamaCppRunner(embedded_model_path(), num_slots=1, context_window=256)
    try:
        with pytest.raises(ValueError, match="no tensors"):
            runner.load_adapter("empty", str(path))
        assert "empty" not in runner._adapters
    finally:
        runner.close()


@pytest.mark.parametrize("name", ["n" * 201, "é" * 101, "\ud800", "x\x00y", "a\nb", "\x1b[31m", " a", "a\u200bb"])
def test_a_lora_name_past_200_bytes_of_utf8_is_a_400(fake_server, tmp_path, name):
    """Also control and invisible characters (found by the black-box attack: a NUL went into /metrics' label)."""
    (_, path), = adapter_files(tmp_path, 1)
    r = httpx.post(f"{fake_server.base_url}/v1/load_lora_adapter", content=json.dumps(
        {"lora_name": name, "lora_path": path}), headers={"content-type": "application/json"})  # \ud800 escaped
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "lora_name"
    assert not fake_server.runner.adapters
