"""A server started from a deployments config file: several models at once, aliases, a weighted endpoint,
and a response that says which deployment answered."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from .conftest import own_server
from .helpers import MODEL, RunningServer, client_for, user

pytestmark = pytest.mark.e2e

CONFIG = f"""
[server]
log_level = "warning"

[[deployments]]
name = "{MODEL}"
model = "smollm2"
aliases = ["small"]
embedding_window = 0
[deployments.engine]
max_num_seqs = 4
context_window = 1024

[[deployments]]
name = "twin"
model = "smollm2-135m-instruct"
embedding_window = 0
[deployments.engine]
max_num_seqs = 2
context_window = 512

[[deployments]]
name = "minilm"
model = "all-minilm-l6-v2"
kind = "embedding"

[[endpoints]]
name = "ab"
routes = [{{deployment = "{MODEL}", weight = 1}}, {{deployment = "twin", weight = 1}}]
"""


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    path: Path = tmp_path_factory.mktemp("config") / "servelm.toml"
    path.write_text(CONFIG)
    with own_server(tmp_path_factory, "--config", str(path)) as srv:
        yield srv


@pytest.fixture(scope="module")
def mclient(multi: RunningServer) -> Iterator[openai.OpenAI]:
    c = client_for(multi.base_url)
    yield c
    c.close()


def test_models_lists_deployments_aliases_and_endpoints(mclient: openai.OpenAI) -> None:
    cards = {m.id: m for m in mclient.models.list()}
    assert set(cards) == {MODEL, "twin", "minilm", "small", "ab"}
    assert (cards["small"].model_extra or {}).get("root") == MODEL


def test_an_alias_answers_as_its_deployment(mclient: openai.OpenAI) -> None:
    raw = mclient.chat.completions.with_raw_response.create(model="small", messages=user("Hi"), max_tokens=4)
    assert raw.headers["x-servelm-deployment"] == MODEL and raw.parse().model == MODEL


def test_two_chat_models_run_at_once_and_an_endpoint_splits_between_them(mclient: openai.OpenAI) -> None:
    seen = set()
    for _ in range(20):
        raw = mclient.completions.with_raw_response.create(model="ab", prompt="One, two,", max_tokens=2)
        seen.add((raw.headers["x-servelm-deployment"], raw.parse().model))
    assert seen == {(MODEL, MODEL), ("twin", "twin")}
    with mclient.chat.completions.with_streaming_response.create(model="twin", messages=user("Hi"), max_tokens=4,
                                                                  stream=True) as resp:
        assert resp.headers["x-servelm-deployment"] == "twin"
        assert any(line.startswith("data: [DONE]") for line in resp.iter_lines())


def test_the_embedding_deployment_serves_embeddings_only(mclient: openai.OpenAI) -> None:
    out = mclient.embeddings.create(model="minilm", input=["a cat", "a dog"])
    assert out.model == "minilm" and len(out.data) == 2 and len(out.data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError):
        mclient.chat.completions.create(model="minilm", messages=user("Hi"), max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        mclient.chat.completions.create(model="nope", messages=user("Hi"), max_tokens=2)
