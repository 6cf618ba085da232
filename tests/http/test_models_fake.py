"""Models loaded on demand (servelm/fleet.py, http/models.py) over the fake runner, through the official client:
statuses, loads on a request, LRU eviction that spares busy models, keep_alive, the routes and their admin key,
failed loads, the models directory."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from servelm.compose import Built, build_deployment
from servelm.config import DeploymentSpec, EngineSettings
from servelm.fleet import Fleet, FleetLimits, scan_models_dir
from servelm.http.limits import SecurityConfig
from servelm.keys import key_spec
from servelm.runners.fake import FakeRunner
from servelm.service.registry.catalog import parse_keep_alive
from servelm.service.registry.deployments import Deployments

ADMIN, USER = "sk-admin", "sk-user"


def _files(tmp_path: Path, *names: str) -> list[DeploymentSpec]:
    specs = []
    for name in names:
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(b"GGUF" + b"\0" * 1024)
        specs.append(DeploymentSpec(name=name, model=str(path), load="on-demand", engine=EngineSettings(kv_budget_mib=1)))
    return specs


class FakeBuilder:
    """Loads a fake-runner deployment for a spec, counting loads; names in `fail` fail as a bad file would."""

    def __init__(self, step_delay: float = 0.0, fail: tuple[str, ...] = ()) -> None:
        self.step_delay, self.fail, self.loads = step_delay, fail, []

    def __call__(self, spec: DeploymentSpec) -> Built:
        if spec.name in self.fail:
            raise ValueError(f"{spec.model}: not a GGUF file llama.cpp can load")
        deployment, engine = build_deployment(spec.name, FakeRunner(step_delay=self.step_delay))
        deployment = replace(deployment, memory={"weights": 4 << 20})
        self.loads.append(spec.name)
        return Built(Deployments([deployment]), workers=[engine])


def _status(base: str, name: str, key: str = "x") -> dict:
    cards = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"]
    return next(c["status"] for c in cards if c["id"] == name)


def _chat(client: openai.OpenAI, model: str, **extra) -> str:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       extra_body=extra or None)
    return r.choices[0].message.content


def test_a_request_loads_its_model_and_the_list_tells_each_status(fake_server_factory, tmp_path):
    builder = FakeBuilder()
    fleet = Fleet(_files(tmp_path, "alpha", "beta"), builder=builder)
    server = fake_server_factory(catalog=fleet)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    assert _status(server.base_url, "alpha") == {"value": "unloaded"}
    assert _status(server.base_url, "fake-model") == {"value": "loaded"}  # loaded at start
    assert _chat(client, "alpha")
    assert _status(server.base_url, "alpha") == {"value": "loaded"}
    assert _status(server.base_url, "beta") == {"value": "unloaded"}
    assert builder.loads == ["alpha"]
    assert client.models.retrieve("beta").model_extra["status"] == {"value": "unloaded"}
    assert httpx.get(f"{server.base_url}/models").json()["data"]  # llama-server's path lists them too


def test_lru_eviction_spares_a_model_with_requests_under_way(fake_server_factory, tmp_path):
    builder = FakeBuilder(step_delay=0.05)
    fleet = Fleet(_files(tmp_path, "a", "b", "c"), FleetLimits(models_max=2), builder=builder)
    server = fake_server_factory(catalog=fleet)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    _chat(client, "a")
    _chat(client, "b")
    _chat(client, "a")  # b is now the least recently used
    _chat(client, "c")
    assert (_status(server.base_url, "a")["value"], _status(server.base_url, "b")["value"]) == ("loaded", "unloaded")
    # c runs a long stream; loading b must then evict a (idle), never c
    stream = client.chat.completions.create(model="c", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=40, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    _chat(client, "b")
    assert _status(server.base_url, "c")["value"] == "loaded"
    assert _status(server.base_url, "a")["value"] == "unloaded"
    # both loaded models busy: a third is refused with Retry-After, and the busy ones are undisturbed
    other = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=40, stream=True, extra_body={"ignore_eos": True})
    next(iter(other))
    with pytest.raises(openai.APIStatusError) as refused:
        _chat(client, "a")
    assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"]
    assert "under way" in refused.value.message
    assert sum(1 for _ in stream) and sum(1 for _ in other)  # both streams ran to their end
    assert _chat(client, "a")  # now one is idle again


def _unloaded_within(base_url: str, name: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _status(base_url, name)["value"] != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.1)
    return _status(base_url, name)["value"] == "unloaded"


def test_keep_alive_zero_unloads_after_the_request_and_seconds_after_idle(fake_server_factory, tmp_path):
    fleet = Fleet(_files(tmp_path, "a", "b"), FleetLimits(idle_unload_s=-1), builder=FakeBuilder())
    server = fake_server_factory(catalog=fleet)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    _chat(client, "a", keep_alive=0)  # unloaded as the answer ends: it may still be going as the client reads it
    assert _unloaded_within(server.base_url, "a", 5)
    _chat(client, "b", keep_alive="1s")
    assert _status(server.base_url, "b")["value"] == "loaded"
    assert _unloaded_within(server.base_url, "b", 10)
    _chat(client, "a", keep_alive=-1)  # never: the default here is never too, so it stays
    time.sleep(1.5)
    assert _status(server.base_url, "a")["value"] == "loaded"
    with pytest.raises(openai.BadRequestError) as bad:
        _chat(client, "a", keep_alive="soon")
    assert bad.value.body["param"] == "keep_alive"
    r = client.completions.create(model="fake-model", prompt="x", max_tokens=2, extra_body={"keep_alive": "5m"})
    assert r.choices  # on a model loaded at start it changes nothing


def test_keep_alive_parses_ollamas_forms():
    assert parse_keep_alive("5m") == 300
    assert parse_keep_alive("1h30m") == 5400
    assert parse_keep_alive("1.5s") == 1.5
    assert parse_keep_alive("-1m") == -60
    assert parse_keep_alive(0) == 0
    assert parse_keep_alive("10") == 10
    assert parse_keep_alive(None) is None
    for bad in ("", "m5", "5 minutes", True, [1], float("inf")):
        with pytest.raises(Exception) as err:
            parse_keep_alive(bad)
        assert getattr(err.value, "param", None) == "keep_alive"


def test_load_and_unload_routes_need_an_admin_key_when_keys_are_on(fake_server_factory, tmp_path):
    fleet = Fleet(_files(tmp_path, "a"), builder=FakeBuilder())
    security = SecurityConfig(keys=(key_spec(ADMIN, admin=True), key_spec(USER)))
    server = fake_server_factory(catalog=fleet, security=security)

    def post(path: str, key: str, body: dict | None = None) -> httpx.Response:
        return httpx.post(f"{server.base_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"})

    forbidden = post("/models/load", USER, {"model": "a"})
    assert forbidden.status_code == 403 and forbidden.json()["error"]["type"] == "permission_error"
    assert post("/models/refresh", USER).status_code == 403
    assert post("/models/load", ADMIN, {"model": "nope"}).status_code == 404
    assert post("/models/load", ADMIN, {}).status_code == 400
    loaded = post("/models/load", ADMIN, {"model": "a"})
    assert loaded.status_code == 200 and loaded.json()["success"] is True
    assert _status(server.base_url, "a", ADMIN) == {"value": "loaded"}
    assert post("/models/unload", ADMIN, {"model": "a"}).json()["status"] == {"value": "unloaded"}
    assert post("/models/refresh", ADMIN).json()["models"] == {"a": {"value": "unloaded"}}
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=USER)
    assert _chat(client, "a")  # any key's request loads it on demand


def test_unload_waits_for_the_requests_under_way(fake_server_factory, tmp_path):
    fleet = Fleet(_files(tmp_path, "a"), builder=FakeBuilder(step_delay=0.02))
    server = fake_server_factory(catalog=fleet)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    stream = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=30,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    done = threading.Event()
    threading.Thread(target=lambda: (httpx.post(f"{server.base_url}/models/unload", json={"model": "a"}, timeout=30),
                                     done.set()), daemon=True).start()
    time.sleep(0.2)
    assert not done.is_set()  # it waits for the stream
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 10
    assert done.wait(10)
    assert _status(server.base_url, "a")["value"] == "unloaded"


def test_a_failed_load_is_a_clear_400_and_disturbs_no_other_model(fake_server_factory, tmp_path):
    fleet = Fleet(_files(tmp_path, "good", "bad"), builder=FakeBuilder(fail=("bad",)))
    server = fake_server_factory(catalog=fleet)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    assert _chat(client, "good")
    with pytest.raises(openai.BadRequestError) as bad:
        _chat(client, "bad")
    assert bad.value.body["code"] == "model_load_failed" and "not a GGUF" in bad.value.message
    status = _status(server.base_url, "bad")
    assert status["value"] == "failed" and "not a GGUF" in status["reason"]
    assert _chat(client, "good") and _status(server.base_url, "good")["value"] == "loaded"
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert 'servelm_model_loads_total{model="bad",outcome="failed"} 1.0' in metrics
    assert 'servelm_model_loaded{model="good"} 1.0' in metrics


def test_a_memory_bound_evicts_and_refuses_what_cannot_fit(fake_server_factory, tmp_path):
    specs = _files(tmp_path, "a", "b")
    big = tmp_path / "big.gguf"
    big.write_bytes(b"\0" * (3 << 20))
    specs.append(DeploymentSpec(name="big", model=str(big), load="on-demand", engine=EngineSettings(kv_budget_mib=8)))
    fleet = Fleet(specs, FleetLimits(models_max=4, memory_bytes=10 << 20), builder=FakeBuilder())
    server = fake_server_factory(catalog=fleet)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    _chat(client, "a")
    _chat(client, "b")  # 4 + 4 MiB: both fit
    assert _status(server.base_url, "a")["value"] == "loaded"
    with pytest.raises(openai.APIStatusError) as refused:
        _chat(client, "big")  # 11 MiB: more than the bound
    assert refused.value.status_code == 503 and "--models-memory-mib" in refused.value.message
    fleet.limits = FleetLimits(models_max=4, memory_bytes=12 << 20)
    _chat(client, "big")  # evicts both idle ones
    assert [_status(server.base_url, n)["value"] for n in ("a", "b", "big")] == ["unloaded", "unloaded", "loaded"]


def _gguf(path: Path, arch: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_models_directory_names_pairs_and_configures_its_models(tmp_path):
    (tmp_path / "chat.gguf").write_bytes(b"GGUF")
    (tmp_path / "mmproj-chat.gguf").write_bytes(b"GGUF")
    (tmp_path / "chat.toml").write_text('aliases = ["talker"]\nreasoning_markers = "none"\n[engine]\nmax_num_seqs = 3\n')
    _gguf(tmp_path / "embedder.gguf", "bert")
    (tmp_path / "vision").mkdir()
    (tmp_path / "vision" / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    (tmp_path / "vision" / "mmproj-model-f16.gguf").write_bytes(b"GGUF")
    (tmp_path / "broken.gguf").write_bytes(b"GGUF")
    (tmp_path / "broken.toml").write_text("name = 'other'\n")
    (tmp_path / "notes.txt").write_text("not a model")
    specs, failed = scan_models_dir(tmp_path, EngineSettings(threads=1, prefix_cache_dir=str(tmp_path / "kv")))
    by_name = {s.name: s for s in specs}
    assert set(by_name) == {"chat", "embedder", "vision"}
    assert by_name["chat"].mmproj == tmp_path / "mmproj-chat.gguf" and by_name["chat"].aliases == ["talker"]
    assert by_name["chat"].engine.max_num_seqs == 3 and by_name["chat"].engine.threads == 1  # the server's flags too
    assert by_name["chat"].engine.prefix_cache_dir == str(tmp_path / "kv" / "chat")  # a folder per model
    assert by_name["embedder"].kind == "embedding" and by_name["chat"].kind == "chat"
    assert by_name["vision"].model == str(tmp_path / "vision" / "model-Q4_K_M.gguf")
    assert by_name["vision"].mmproj == tmp_path / "vision" / "mmproj-model-f16.gguf"
    assert all(s.load == "on-demand" for s in specs)
    assert "`name`" in failed["broken"]


def test_a_file_added_since_is_found_when_a_request_names_it(fake_server_factory, tmp_path):
    fleet = Fleet([], models_dir=tmp_path, builder=FakeBuilder())
    server = fake_server_factory(catalog=fleet)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    with pytest.raises(openai.NotFoundError):
        _chat(client, "late")
    (tmp_path / "late.gguf").write_bytes(b"GGUF")
    assert _chat(client, "late")
    assert _status(server.base_url, "late")["value"] == "loaded"
