"""LoRA adapters (issue 36) on the real models with scripts/make_test_lora.py's fixtures, through the official
client: one loaded at start (--lora), one by vLLM's route; each changes the answer; requests on the base and on
both adapters run together and each answers exactly as alone; the prefix cache is kept apart per adapter; vLLM's
status codes (a name twice, a missing file, another model's adapter with llama.cpp's reason); an unload. Gemma 3
270M takes its own adapter the same way."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from servelm.config import GEMMA_MODEL_ID, gemma_model_path
from tests.fixture_files import write_fixture

from . import ray_mode
from .conftest import own_server
from .helpers import MODEL, STORY, client_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(ray_mode.ENABLED, reason="under --ray: tests/ray/test_runtime_models.py")]


def make_lora(out, seed: int, model: str | None = None) -> str:
    return str(write_fixture("make_test_lora.py", out, "--seed", str(seed), *(["--model", model] if model else [])))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    d = tmp_path_factory.mktemp("loras")
    return make_lora(d / "two.gguf", 2), make_lora(d / "three.gguf", 3), make_lora(d / "gemma.gguf", 2,
                                                                                     str(gemma_model_path()))


async def answers(base_url: str, models: list[str], messages=STORY) -> list[str]:
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300) as client:

        async def one(model: str) -> str:
            r = await client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
            return r.choices[0].message.content

        return await asyncio.gather(*(one(m) for m in models))


async def test_adapters_load_run_together_exactly_and_unload(adapters, tmp_path_factory):
    two, three, gemma = adapters
    with own_server(tmp_path_factory, "--lora", f"two={two}", "--no-embedding-model") as srv, \
            client_for(srv.base_url) as client:  # closed before its server stops: no socket left to the collector
        cards = {m.id: m.model_extra for m in client.models.list().data}
        assert cards["two"]["parent"] == MODEL and cards["two"]["root"] == two
        r = httpx.post(f"{srv.base_url}/v1/load_lora_adapter", json={"lora_name": "three", "lora_path": three})
        assert r.status_code == 200, r.text
        twice = httpx.post(f"{srv.base_url}/v1/load_lora_adapter", json={"lora_name": "three", "lora_path": three})
        assert twice.status_code == 400
        missing = httpx.post(f"{srv.base_url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": two + ".no"})
        assert missing.status_code == 404
        other = httpx.post(f"{srv.base_url}/v1/load_lora_adapter", json={"lora_name": "g", "lora_path": gemma})
        assert other.status_code == 400 and "arch mismatch" in other.json()["error"]["message"]  # llama.cpp's words
        models = [MODEL, "two", "three"]
        alone = {m: (await answers(srv.base_url, [m]))[0] for m in models}
        assert alone[MODEL] != alone["two"] and alone[MODEL] != alone["three"], alone
        together = (await answers(srv.base_url, models * 4))
        assert together == [alone[m] for m in models * 4], "each answers as alone, the base's unchanged"
        # the cache is the adapter's own: a prompt the base has read is read again under an adapter
        fresh = [{"role": "user", "content": "Name three rivers of Europe and say one thing about each."}]
        first = client.chat.completions.create(model=MODEL, messages=fresh, max_tokens=2)
        under = client.chat.completions.create(model="two", messages=fresh, max_tokens=2)
        again = client.chat.completions.create(model="two", messages=fresh, max_tokens=2)
        # only the template's opening, which "two" read before: never the base's cells of this prompt
        assert under.usage.prompt_tokens_details.cached_tokens < 30 < first.usage.prompt_tokens - 1
        assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
        assert under.model == "two"
        gone = httpx.post(f"{srv.base_url}/v1/unload_lora_adapter", json={"lora_name": "three"})
        assert gone.status_code == 200
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="three", messages=STORY, max_tokens=2)
        assert (await answers(srv.base_url, [MODEL]))[0] == alone[MODEL]


async def test_gemma_takes_its_own_adapter_exactly(adapters, tmp_path_factory):
    *_, gemma = adapters
    with own_server(tmp_path_factory, "--model-path", GEMMA_MODEL_ID, "--model-id", "gemma", "--lora",
                    f"g={gemma}", "--no-embedding-model") as srv:
        alone = {m: (await answers(srv.base_url, [m]))[0] for m in ("gemma", "g")}
        assert alone["gemma"] != alone["g"]
        assert (await answers(srv.base_url, ["gemma", "g"] * 3)) == [alone["gemma"], alone["g"]] * 3
