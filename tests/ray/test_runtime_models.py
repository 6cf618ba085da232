"""Models and LoRA adapters that come and go (issue 36) under Ray Serve, on a two-node local cluster: an on-demand
deployment whose replica starts without its model, loaded when a request names it and unloaded by route; a base
model of two replicas with an adapter from the start and one loaded and unloaded by vLLM's routes, which reach
every replica. Driven by the official openai client. Issue 37's parts under Ray too: one trace across the ingress
and a replica, and a reranker (scripts/make_test_reranker.py) scored on a replica."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.fixture_files import reranker_scores, write_fixture
from tests.otlp_receiver import OtlpReceiver

from .conftest import ENGINE, MODEL, RayServer, ray_app

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

LATER = "smollm2-later"  # the same file as MODEL, loaded on demand: its greedy answers must equal MODEL's
QUESTION = [{"role": "user", "content": "Write a story about a cat."}]


@pytest.fixture(scope="module")
def loras(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("loras")
    return (str(write_fixture("make_test_lora.py", d / "two.gguf", "--seed", "2")),
            str(write_fixture("make_test_lora.py", d / "three.gguf", "--seed", "3")))


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory) -> Path:
    return write_fixture("make_test_reranker.py", tmp_path_factory.mktemp("reranker") / "tiny-reranker.gguf")


@pytest.fixture(scope="module")
def server(loras, receiver, reranker) -> Iterator[RayServer]:
    from servelm.config import DeploymentSpec, EngineSettings, LoraSpec

    base = DeploymentSpec(name=MODEL, model="smollm2", num_replicas=2, engine=EngineSettings(**ENGINE),
                          loras=[LoraSpec(name="two", path=Path(loras[0]))])
    later = DeploymentSpec(name=LATER, model="smollm2", load="on-demand", engine=EngineSettings(**ENGINE))
    ranker = DeploymentSpec(name="ranker", model=str(reranker), kind="rerank", engine=EngineSettings(threads=1))
    # the ingress and the replicas send their spans every 0.2 s (the SDK reads it; Ray's workers inherit it)
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"
    try:
        with ray_app([base, ranker], node_cpus=2, on_demand=[later], idle_unload_s=-1,
                     otlp_traces_endpoint=receiver.start_http()) as s:
            yield s
    finally:
        del os.environ["OTEL_BSP_SCHEDULE_DELAY"]


def client(server: RayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=180, max_retries=0)


def answer(server: RayServer, model: str) -> openai.types.chat.ChatCompletion:
    return client(server).chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)


def statuses(server: RayServer) -> dict[str, dict]:
    return {m.id: (m.model_extra or {}) for m in client(server).models.list().data}


async def _replica_adapters(deployment: str) -> list[set[str]]:
    """Each replica's loaded adapters, from the replicas themselves."""
    from ray import serve

    from servelm.ray.application import APP_NAME

    handle = serve.get_deployment_handle(deployment, APP_NAME)
    stats = await handle.broadcast("stats").results_async(timeout_s=30)
    return [{name for name, loaded, _ in s.adapters if loaded} for s in stats]


def test_an_on_demand_model_loads_when_named_and_unloads_by_route(server: RayServer) -> None:
    assert statuses(server)[LATER]["status"]["value"] == "unloaded"
    base = answer(server, MODEL).choices[0].message.content
    reply = answer(server, LATER)
    assert reply.model == LATER and reply.choices[0].message.content == base  # the same file, the same greedy answer
    assert statuses(server)[LATER]["status"]["value"] == "loaded"
    assert LATER in server.health()["deployments"]
    r = httpx.post(f"{server.base_url}/models/unload", json={"model": LATER}, timeout=60)
    assert r.status_code == 200, r.text
    assert statuses(server)[LATER]["status"]["value"] == "unloaded"
    assert LATER not in server.health()["deployments"]
    r = httpx.post(f"{server.base_url}/models/load", json={"model": LATER}, timeout=180)
    assert r.status_code == 200, r.text
    assert answer(server, LATER).choices[0].message.content == base
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert f'servelm_model_loads_total{{model="{LATER}",outcome="loaded"}} 2.0' in metrics
    # what a load built (the model, its vocabulary tables) is frozen out of the garbage collector's way, as what a
    # replica builds at its start is: the on-demand replica holds as many frozen objects as each of the base's two
    frozen = {m: float(v) for m, v in re.findall(r'^servelm_replica_gc_frozen_objects{model="([^"]+)"} (\S+)$',
                                                  metrics, re.M)}
    assert frozen[LATER] > 0.9 * frozen[MODEL] / 2, frozen


def test_adapters_reach_every_replica_by_route(server: RayServer, loras) -> None:
    base = answer(server, MODEL).choices[0].message.content
    two = answer(server, "two")
    assert two.model == "two" and two.choices[0].message.content != base  # the adapter from the start applies
    assert server.run(_replica_adapters(MODEL), timeout=60) == [{"two"}, {"two"}]

    r = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": "three", "lora_path": loras[1]},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert server.run(_replica_adapters(MODEL), timeout=60) == [{"two", "three"}, {"two", "three"}]
    cards = statuses(server)
    assert cards["three"]["parent"] == MODEL and cards["three"]["status"]["value"] == "loaded"
    three = answer(server, "three").choices[0].message.content
    assert three not in (base, two.choices[0].message.content)
    assert [answer(server, "three").choices[0].message.content for _ in range(3)] == [three] * 3

    twice = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": "three", "lora_path": loras[1]})
    assert twice.status_code == 400
    missing = httpx.post(f"{server.base_url}/v1/load_lora_adapter",
                         json={"lora_name": "four", "lora_path": loras[1] + ".no"}, timeout=60)
    assert missing.status_code == 404, missing.text
    assert "four" not in statuses(server)

    r = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": "three"}, timeout=60)
    assert r.status_code == 200, r.text
    assert server.run(_replica_adapters(MODEL), timeout=60) == [{"two"}, {"two"}]
    with pytest.raises(openai.NotFoundError):
        answer(server, "three")
    assert answer(server, MODEL).choices[0].message.content == base  # the base model unchanged throughout


def test_the_ingress_and_replica_spans_join_the_callers_trace(server: RayServer, receiver: OtlpReceiver) -> None:
    trace_id, caller = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120,
                   headers={"traceparent": f"00-{trace_id}-{caller}-01"},
                   json={"model": "two", "messages": QUESTION, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    ingress = receiver.wait_for(lambda s: s.trace_id == trace_id and s.name == "chat two")
    assert ingress.parent_span_id == caller and ingress.attributes["servelm.lora"] == ["two"]
    assert ingress.attributes["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]
    replica = receiver.wait_for(lambda s: s.trace_id == trace_id and s.name == f"generate {MODEL}")
    assert replica.parent_span_id == ingress.span_id
    assert replica.attributes["servelm.replica"] == r.headers["x-servelm-replica"]
    assert replica.attributes["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]


def test_a_reranker_scores_on_a_replica(server: RayServer, reranker: Path) -> None:
    query, docs = "What is the capital of France?", ["Bananas are yellow.", "Paris is the capital of France."]
    r = httpx.post(f"{server.base_url}/v1/rerank", json={"model": "ranker", "query": query, "documents": docs},
                   timeout=60)
    assert r.status_code == 200, r.text
    expected = reranker_scores(reranker, [(query, d) for d in docs])
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert [got[i] for i in range(2)] == pytest.approx(expected, rel=1e-3)
    assert r.headers["x-servelm-deployment"] == "ranker"
