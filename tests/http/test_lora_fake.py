"""LoRA adapters (service/registry/adapters.py, the runner's per-call adapter sets) over the fake runner, through the official
client: vLLM's load and unload routes and their status codes, adapters listed with their parent, `model: NAME` and
llama-server's `lora` list, the base's answers unchanged beside adapters, the prefix cache keyed by adapter,
--max-loras LRU, and the admin key."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from servelm.engine.plan import StepPlan
from servelm.http.limits import SecurityConfig
from servelm.keys import key_spec

PROMPT = [{"role": "user", "content": "hello there"}]


def adapter_file(tmp_path, name: str, shift: int) -> str:
    path = tmp_path / f"{name}.gguf"
    path.write_text(str(shift))
    return str(path)


def load(base: str, name: str, path: str, key: str = "x", **extra) -> httpx.Response:
    return httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **extra},
                      headers={"Authorization": f"Bearer {key}"})


def answer(client: openai.OpenAI, model: str, **extra) -> tuple[str, str]:
    r = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=6, temperature=0,
                                       extra_body=extra or None)
    return r.choices[0].message.content, r.model


def test_vllms_routes_load_list_select_and_unload_an_adapter(fake_server_factory, tmp_path):
    server = fake_server_factory()
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    base, _ = answer(client, "fake-model")
    r = load(server.base_url, "shift3", adapter_file(tmp_path, "a", 3))
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'shift3' added successfully."
    again = load(server.base_url, "shift3", adapter_file(tmp_path, "a", 3))
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert load(server.base_url, "other", str(tmp_path / "missing.gguf")).status_code == 404
    bad = load(server.base_url, "bad", adapter_file(tmp_path, "bad", "x"))
    assert bad.status_code == 400 and "not a fake LoRA adapter" in bad.json()["error"]["message"]
    card = client.models.retrieve("shift3")
    assert card.model_extra["parent"] == "fake-model" and card.model_extra["status"] == {"value": "loaded"}
    assert "bad" not in [m.id for m in client.models.list().data]
    text, model = answer(client, "shift3")
    assert model == "shift3" and text != base
    assert answer(client, "fake-model", lora=[{"id": 0, "scale": 1.0}])[0] == text  # llama-server's shape
    assert answer(client, "fake-model", lora=[{"id": 0, "scale": 0}])[0] == base
    with pytest.raises(openai.BadRequestError) as unknown:
        answer(client, "fake-model", lora=[{"id": 7}])
    assert unknown.value.body["param"] == "lora"
    assert 'servelm_lora_requests_total{adapter="shift3",model="fake-model"} 2.0' in \
        httpx.get(f"{server.base_url}/metrics").text
    gone = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": "shift3"})
    assert gone.status_code == 200 and "removed" in gone.text
    assert not server.runner.adapters
    with pytest.raises(openai.NotFoundError):
        answer(client, "shift3")
    assert httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": "shift3"}).status_code == 404


async def test_adapters_and_the_base_run_together_each_answer_as_alone(fake_server_factory, tmp_path):
    server = fake_server_factory(step_delay=0.005)
    for name, shift in (("one", 1), ("two", 2)):
        assert load(server.base_url, name, adapter_file(tmp_path, name, shift)).status_code == 200
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x")

    async def ask(model: str) -> str:
        r = await client.chat.completions.create(model=model, messages=PROMPT, max_tokens=12, temperature=0,
                                                 extra_body={"ignore_eos": True})
        return r.choices[0].message.content

    async with client:  # its connections closed on this loop (left open: a ResourceWarning once it is gone)
        alone = {m: await ask(m) for m in ("fake-model", "one", "two")}
        assert len(set(alone.values())) == 3
        server.runner.steps.clear()
        together = await asyncio.gather(*(ask(m) for m in ("fake-model", "one", "two") * 3))
    assert together == [alone[m] for m in ("fake-model", "one", "two") * 3]
    mixed = [p for p in server.runner.steps if isinstance(p, StepPlan) and len({c.adapters for c in p.chunks}) > 1]
    assert mixed, "requests on different adapters shared steps"
    for plan in mixed:  # but never a forward pass
        assert all(len({plan.chunks[i].adapters for i in call}) == 1 for call in plan.calls())


def test_the_prefix_cache_is_kept_apart_per_adapter(fake_server_factory, tmp_path):
    server = fake_server_factory(prefix_cache=True)
    load(server.base_url, "one", adapter_file(tmp_path, "one", 1))
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")

    def cached(model: str) -> int:
        r = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=2)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("fake-model") == 0
    assert cached("one") == 0, "the base's cells are not the adapter's"
    assert cached("one") > 0 and cached("fake-model") > 0


def two_adapters_one_loaded(fake_server_factory, tmp_path):
    """A fake server with --max-loras 1 and adapters `one` and `two` loaded by route, in that order (so `two` is)."""
    server = fake_server_factory()
    assert server.deployment is not None and server.deployment.adapters is not None
    server.deployment.adapters.max_loaded = 1
    load(server.base_url, "one", adapter_file(tmp_path, "one", 1))
    load(server.base_url, "two", adapter_file(tmp_path, "two", 2))
    return server


def test_max_loras_frees_the_least_recently_used_idle_adapter_and_loads_it_again(fake_server_factory, tmp_path):
    server = two_adapters_one_loaded(fake_server_factory, tmp_path)
    assert set(server.runner.adapters) == {"two"}
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    assert answer(client, "one")[1] == "one"  # loaded again, two freed
    assert set(server.runner.adapters) == {"one"}
    status = {m.id: m.model_extra["status"]["value"] for m in client.models.list().data}
    assert (status["one"], status["two"]) == ("loaded", "unloaded")


def test_the_lora_routes_need_an_admin_key_when_keys_are_on(fake_server_factory, tmp_path):
    security = SecurityConfig(keys=(key_spec("sk-admin", admin=True), key_spec("sk-user")))
    server = fake_server_factory(security=security)
    path = adapter_file(tmp_path, "one", 1)
    assert load(server.base_url, "one", path, key="sk-user").status_code == 403
    assert load(server.base_url, "one", path, key="sk-admin").status_code == 200
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="sk-user")
    assert answer(client, "one")[1] == "one"


def test_a_request_naming_more_adapters_than_max_loras_is_a_400(fake_server_factory, tmp_path):
    server = two_adapters_one_loaded(fake_server_factory, tmp_path)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    with pytest.raises(openai.BadRequestError) as too_many:
        answer(client, "fake-model", lora=[{"id": 0}, {"id": 1}])
    assert too_many.value.body["param"] == "lora"
