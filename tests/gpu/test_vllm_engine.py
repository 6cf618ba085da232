"""VllmEngine on a real GPU: a small model through the engine, and through the HTTP server with the openai client.

Skipped, and so reported as not run, where vLLM or a CUDA GPU is absent (`pip install 'servelm[vllm]'`;
scripts/vllm_check.sh installs it, runs these and measures throughput). The model is SERVELM_VLLM_TEST_MODEL: a
Hugging Face repo id (needs the network or the HF cache) or a local directory; default Qwen/Qwen2.5-0.5B-Instruct.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'servelm[vllm]'): not run")
torch = pytest.importorskip("torch", reason="torch is not installed: not run")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU on this machine: not run", allow_module_level=True)

from servelm import compose  # noqa: E402
from servelm.config import DeploymentSpec, VllmSettings  # noqa: E402
from servelm.engine.types import FinishReason, GenerationRequest, SamplingParams  # noqa: E402
from servelm.http.app import create_app  # noqa: E402
from tests.conftest import serving  # noqa: E402

MODEL = os.environ.get("SERVELM_VLLM_TEST_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
MSG = [{"role": "user", "content": "Name three colours."}]


class Served:
    def __init__(self, url: str, deployment, loop: asyncio.AbstractEventLoop) -> None:
        self.url, self.deployment, self.loop = url, deployment, loop
        self.engine = deployment.engine  # create_app wraps a copy of the deployments; this one is the VllmEngine

    def run(self, coro, timeout: float = 300):
        """Run a coroutine on the server's event loop: vLLM's output loop lives there."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def generate(self, prompt: list[int], **params) -> list:
        request = GenerationRequest(f"t-{os.urandom(4).hex()}", tuple(prompt), SamplingParams(**params))

        async def collect():
            return [o async for o in self.engine.generate(request)]

        return self.run(collect())


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    spec = DeploymentSpec(name="gpu", model=MODEL, engine="vllm", vllm=VllmSettings(
        gpu_memory_utilization=0.5, max_model_len=2048, engine_args={"enforce_eager": True}))
    built = compose.Builder().build([spec], [])
    loops: list[asyncio.AbstractEventLoop] = []
    started = threading.Event()

    def on_start() -> None:
        loops.append(asyncio.get_running_loop())
        built.start()
        started.set()

    app = create_app(built.deployments, on_start=on_start, on_stop=built.stop)
    with serving(app) as url:
        started.wait(30)
        yield Served(url, built.deployments.get("gpu"), loops[0])


@pytest.fixture
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=300)


def prompt_ids(served: Served) -> list[int]:
    text = served.deployment.template.render(MSG, add_generation_prompt=True)
    return served.deployment.vocab.tokenize(text)


# -- the engine itself --------------------------------------------------------------------------------------
def test_greedy_is_repeatable_and_counts_its_tokens(served: Served):
    ids = prompt_ids(served)
    runs = [served.generate(ids, max_tokens=16, temperature=0.0, ignore_eos=True) for _ in range(2)]
    for outs in runs:
        assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].completion_tokens == 16
        assert sum(len(o.token_ids) for o in outs) == 16 and outs[-1].prompt_tokens == len(ids)
    assert "".join(o.text for o in runs[0]) == "".join(o.text for o in runs[1]) != ""


def test_logprobs_and_prompt_logprobs(served: Served):
    ids = prompt_ids(served)
    outs = served.generate(ids, max_tokens=8, temperature=0.0, logprobs=3, prompt_logprobs=1, ignore_eos=True)
    entries = [e for o in outs for e in o.logprobs]
    assert len(entries) == sum(len(o.token_ids) for o in outs) == 8
    assert all(e.rank == 1 and len(e.top) == 3 and e.top[0][0] == e.token for e in entries)  # greedy: the top one
    prompt = outs[0].prompt_logprobs
    assert prompt is not None and len(prompt) == len(ids) and prompt[0] is None and prompt[1].token == ids[1]


def test_a_stop_token_ends_the_choice_and_is_not_reported(served: Served):
    ids = prompt_ids(served)
    free = [t for o in served.generate(ids, max_tokens=6, temperature=0.0, ignore_eos=True) for t in o.token_ids]
    stop = free[3]
    outs = served.generate(ids, max_tokens=6, temperature=0.0, stop_token_ids=(stop,))
    got = [t for o in outs for t in o.token_ids]
    assert got == free[: free.index(stop)]
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_reason == stop


def test_n_seeded_samples_and_an_abort(served: Served):
    ids = prompt_ids(served)
    outs = served.generate(ids, max_tokens=8, temperature=1.0, n=3, seed=11)
    assert {o.index for o in outs if o.finished} == {0, 1, 2}

    async def read_one_then_leave():
        stream = served.engine.generate(GenerationRequest("leave", tuple(ids), SamplingParams(
            max_tokens=1500, ignore_eos=True)))
        await stream.__anext__()
        await stream.aclose()
        await asyncio.sleep(0.5)
        return served.engine.stats()

    assert served.run(read_one_then_leave()).running == 0


# -- through HTTP with the official client ------------------------------------------------------------------
def test_chat_streamed_and_not(client: openai.OpenAI):
    r = client.chat.completions.create(model="gpu", messages=MSG, max_tokens=32, temperature=0)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(model="gpu", messages=MSG, max_tokens=32, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content  # greedy: the same answer either way
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_logprobs_and_legacy_echo(client: openai.OpenAI):
    r = client.chat.completions.create(model="gpu", messages=MSG, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    assert b"".join(bytes(c.bytes) for c in content).decode() == r.choices[0].message.content
    c = client.completions.create(model="gpu", prompt="The capital of France is", max_tokens=4, temperature=0,
                                  echo=True, logprobs=1)
    assert c.choices[0].text.startswith("The capital of France is")
    assert c.choices[0].logprobs.token_logprobs[0] is None


def test_best_of_sampling_and_concurrent_streams(client: openai.OpenAI):
    r = client.completions.create(model="gpu", prompt="Once upon a time", max_tokens=8, best_of=3, n=1,
                                  temperature=1.0)
    assert len(r.choices) == 1 and r.choices[0].text

    def one(i: int) -> str:
        s = client.chat.completions.create(model="gpu", messages=[{"role": "user", "content": f"Count to {i}."}],
                                           max_tokens=24, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in s if c.choices)

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(one, range(16)))


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_object"}},
    {"use_beam_search": True, "best_of": 2, "temperature": 0},
])
def test_what_vllm_cannot_do_is_a_400(served: Served, extra):
    body = {"model": "gpu", "messages": MSG, "max_tokens": 4, "stream": True, **extra}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text  # before the stream starts, in the error envelope
    assert r.json()["error"]["type"] == "invalid_request_error"
