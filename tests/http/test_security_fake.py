"""API keys (401, per-key deployments as 404), the body-size limit (413), and the chat template sandbox."""

from __future__ import annotations

import hashlib

import httpx
import openai
import pytest

from servelm.chat.template import ChatTemplate, TemplateError
from servelm.config import ServerSettings
from servelm.http.auth import AuthMiddleware
from servelm.http.limits import SecurityConfig
from servelm.keys import hash_key, key_from_table, key_spec, load_keys, parse_key_file

MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": "fake-model", "messages": MSG, "max_tokens": 3}


@pytest.fixture
def keyed(fake_server_factory):
    keys = [key_spec("sk-open"), key_spec("sk-other", deployments=["other-model"])]
    return fake_server_factory(security=SecurityConfig(keys=keys), extra_deployments=["other-model"])


def post(server, body=CHAT, path="/v1/chat/completions", **headers):
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=10)


def test_no_key_is_401_in_the_envelope_with_www_authenticate(keyed):
    r = post(keyed)
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and err["param"] is None
    assert "API key" in err["message"]


def test_a_wrong_key_is_401_and_is_not_echoed(keyed):
    r = post(keyed, Authorization="Bearer sk-wrong-secret")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert "sk-wrong-secret" not in r.text
    assert 'error="invalid_token"' in r.headers["www-authenticate"]


def test_a_right_key_works_as_bearer_and_as_azure_api_key(keyed):
    assert post(keyed, Authorization="Bearer sk-open").status_code == 200
    assert post(keyed, **{"api-key": "sk-open"}).status_code == 200
    assert httpx.get(keyed.base_url + "/v1/models", headers={"Authorization": "Bearer sk-open"}).status_code == 200


def test_health_stays_open(keyed):
    assert httpx.get(keyed.base_url + "/health").status_code == 200
    assert httpx.get(keyed.base_url + "/v1/models").status_code == 401


@pytest.fixture
def monitored(fake_server_factory):
    keys = [key_spec("sk-a"), key_spec("sk-b"), key_spec("sk-mon", deployments=(), monitor=True)]
    return fake_server_factory(security=SecurityConfig(keys=keys), prefix_cache=True)


def test_without_a_key_health_says_only_whether_the_server_is_up_and_hides_other_keys_cache_hits(monitored):
    """Issue 32: /health, open, showed the prefix cache's counters: key A's cache hit appeared to anyone as a jump in
    cached_tokens equal to A's own figure. With keys on, no key sees whether the server is up; a key sees the load
    of its deployments; only a monitoring key sees the prefix cache's counters."""
    url = monitored.base_url
    prompt = {**CHAT, "messages": [{"role": "user", "content": "a long shared prompt " * 4}]}
    for _ in range(2):  # the second is a cache hit of key A
        assert post(monitored, prompt, Authorization="Bearer sk-a").status_code == 200
    bare = httpx.get(url + "/health")
    assert bare.status_code == 200 and bare.json() == {"status": "ok"}
    tenant = httpx.get(url + "/health", headers={"Authorization": "Bearer sk-b"}).json()["deployments"]["fake-model"]
    assert "running" in tenant and "total_slots" in tenant
    assert not {"cache_hits", "cached_tokens", "kv_cells_cached", "spill_entries"} & set(tenant)
    monitor = httpx.get(url + "/health", headers={"Authorization": "Bearer sk-mon"}).json()["deployments"]["fake-model"]
    assert monitor["cache_hits"] >= 1 and monitor["cached_tokens"] > 0
    assert httpx.get(url + "/health", headers={"Authorization": "Bearer sk-wrong"}).json() == {"status": "ok"}


def test_metrics_answer_a_monitoring_key_only(monitored):
    url = monitored.base_url + "/metrics"
    assert httpx.get(url).status_code == 401
    bare = httpx.get(url).json()["error"]["message"]
    assert bare.startswith("You didn't provide an API key")
    wrong = httpx.get(url, headers={"Authorization": "Bearer sk-wrong"})
    other_route = httpx.get(monitored.base_url + "/v1/models", headers={"Authorization": "Bearer sk-wrong"})
    assert wrong.status_code == other_route.status_code == 401
    assert wrong.json() == other_route.json(), "an unknown key is told so, as on every other route"
    assert wrong.headers["www-authenticate"] == other_route.headers["www-authenticate"]
    assert httpx.get(url, headers={"Authorization": "Bearer sk-a"}).status_code == 403
    r = httpx.get(url, headers={"Authorization": "Bearer sk-mon"})
    assert r.status_code == 200 and "servelm_prefix_cache_hits" in r.text
    assert post(monitored, Authorization="Bearer sk-mon").status_code == 404, "a monitoring key runs no model"


def test_a_monitoring_key_from_the_flag_the_file_and_a_table():
    assert load_keys(ServerSettings(monitor_key=["sk-m"]))[0].monitor
    (spec,) = parse_key_file("sk-x monitor rpm=5")
    assert spec.monitor and spec.rpm == 5 and spec.deployments is None
    assert key_spec("sk-y").monitor is False


def test_a_key_limited_to_other_deployments_gets_404_model_not_found(keyed):
    r = post(keyed, Authorization="Bearer sk-other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    unknown = post(keyed, {**CHAT, "model": "no-such-model"}, Authorization="Bearer sk-other")
    assert unknown.json()["error"]["message"].replace("no-such-model", "fake-model") == r.json()["error"]["message"]
    assert post(keyed, {**CHAT, "model": "other-model"}, Authorization="Bearer sk-other").status_code == 200
    models = httpx.get(keyed.base_url + "/v1/models", headers={"Authorization": "Bearer sk-other"}).json()
    assert [m["id"] for m in models["data"]] == ["other-model"]
    hidden = httpx.get(keyed.base_url + "/v1/models/fake-model", headers={"Authorization": "Bearer sk-other"})
    assert hidden.status_code == 404


def test_the_openai_client_sees_authentication_error(keyed):
    wrong = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="fake-model", messages=MSG, max_tokens=2)
    right = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="sk-open", max_retries=0)
    assert right.chat.completions.create(model="fake-model", messages=MSG, max_tokens=2).choices


def test_an_open_server_needs_no_key(fake_server):
    assert post(fake_server).status_code == 200


def test_keys_are_kept_only_as_digests_and_matched_in_constant_time():
    spec = key_spec("sk-secret")
    assert spec.digest == hashlib.sha256(b"sk-secret").digest()
    assert "sk-secret" not in repr(spec)
    mw = AuthMiddleware(None, [key_spec("a"), spec, key_spec(sha256=hash_key("b").hex())])  # type: ignore[arg-type]
    assert mw.match(["sk-secret"]) is spec
    assert mw.match(["b"]).digest == hash_key("b")
    assert mw.match(["sk-secre"]) is None


def test_load_keys_reads_flags_file_and_tables(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text("# keys\n\nsk-one\nsk-two deployments=a,b rpm=5 tpm=100  # limited\n"
                 f"sha256:{hash_key('sk-three').hex()} name=ci\n")
    settings = ServerSettings(api_key=["sk-flag"], api_key_file=f)
    specs = load_keys(settings, [{"key": "sk-table", "deployments": ["a"], "tpm": 7}])
    assert [s.digest for s in specs] == [hash_key(k) for k in ("sk-flag", "sk-one", "sk-two", "sk-three", "sk-table")]
    assert specs[2].deployments == {"a", "b"} and specs[2].rpm == 5 and specs[2].tpm == 100
    assert specs[3].label == "ci" and specs[4].tpm == 7 and specs[0].deployments is None
    assert "sk-flag" not in repr(settings)


def test_api_key_env_variable_takes_a_comma_separated_list(monkeypatch):
    monkeypatch.setenv("SERVELM_API_KEY", "k1, k2")
    assert ServerSettings().api_key == ["k1", "k2"]


@pytest.mark.parametrize("line", ["sk-x rpm=many", "sk-x color=red", "sha256:abcd", " "])
def test_a_bad_key_line_names_its_line(line):
    if not line.strip():
        assert parse_key_file(line) == []
        return
    with pytest.raises(ValueError, match="line 1"):
        parse_key_file(line)


def test_a_body_over_the_limit_is_413_by_content_length_or_chunked(fake_server_factory):
    server = fake_server_factory(security=SecurityConfig(max_body_bytes=2048))
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    r = post(server, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():
        for _ in range(10):
            yield b" " * 500  # whitespace: the JSON would still be valid
        yield httpx.Request("POST", "/", json=CHAT).content

    r = httpx.post(server.base_url + "/v1/chat/completions", content=chunks(), timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert post(server).status_code == 200


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% include '/etc/passwd' %}",
    "{{ messages.append(1) }}",
])
def test_chat_templates_run_in_the_sandbox(source):
    with pytest.raises(TemplateError):
        ChatTemplate(source).render(MSG)


def test_azure_paths_answer_401_in_azure_mls_shape(keyed):
    r = post(keyed, path="/chat/completions?api-version=2024-05-01-preview")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    body = r.json()
    assert body["status"] == 401 and body["code"] == "invalid_api_key" and body["error"]["status"] == 401
    assert r.headers["x-ms-error-code"] == "invalid_api_key"
    ok = post(keyed, path="/chat/completions?api-version=2024-05-01-preview", **{"api-key": "sk-open"})
    assert ok.status_code == 200, ok.text


def test_a_key_may_use_a_weighted_endpoint_only_if_it_may_use_every_deployment_behind_it():
    import random

    from servelm.http.auth import SCOPE_KEY, can_use
    from servelm.service.registry.deployments import Deployment, Deployments

    def dep(name):
        return Deployment(name=name, context_window=1, fingerprint="fp")

    deps = Deployments([dep("a"), dep("b")], aliases={"small": "a"}, endpoints={"ab": [("a", 1.0), ("b", 1.0)]},
                       rng=random.Random(0))
    only_a = {SCOPE_KEY: key_spec("k", deployments=["a"])}
    assert can_use(only_a, deps, "a") and can_use(only_a, deps, "small")
    assert not can_use(only_a, deps, "b") and not can_use(only_a, deps, "ab") and not can_use(only_a, deps, "zz")
    both = {SCOPE_KEY: key_spec("k", deployments=["a", "b"])}
    assert can_use(both, deps, "ab") and can_use({}, deps, "ab")


def test_health_states_the_memory_budget_part_by_part(fake_server):
    """Issue 32: the default caps add up to a stated total that /health reports (fuzzing's RSS is measured
    against it in docs/robustness.md)."""
    memory = httpx.get(fake_server.base_url + "/health").json()["memory"]
    parts = memory["deployments"]["fake-model"]
    assert set(parts) == {"weights", "kv_cache", "logits", "grammar_cache", "prefix_cache_ram", "image_embeddings"}
    assert parts["grammar_cache"] == 512 << 20 and parts["kv_cache"] > 0
    assert memory["budget_bytes"] == memory["runtime_bytes"] + sum(sum(p.values()) for p in memory["deployments"].values())


def test_an_admin_key_from_the_flag_the_file_and_a_table():
    assert load_keys(ServerSettings(admin_key=["sk-adm"]))[0].admin
    (spec,) = parse_key_file("sk-x admin")
    assert spec.admin and not spec.monitor and spec.deployments is None
    assert key_from_table({"key": "sk-t", "admin": True}).admin
    assert key_spec("sk-y").admin is False
