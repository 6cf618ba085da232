"""VllmEngine over a fake AsyncLLM (no vLLM, no GPU): the stream, aborts, queue bounds, 400s, and the whole path
from a config with `engine = "vllm"` through compose and the HTTP server to the official openai client."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import httpx
import openai
import pytest

from servelm import compose
from servelm.config import ConfigFile, DeploymentSpec, load_config_file
from servelm.constrain.constraint import Constraint
from servelm.engine.hf_vocab import HfTokenizer
from servelm.engine.types import BeamParams, FinishReason, GenerationRequest, SamplingParams
from servelm.engine.vllm import VllmEngine
from servelm.errors import InvalidParameter
from servelm.http.app import create_app
from tests.conftest import serving

ROOT = Path(__file__).resolve().parents[2]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EOS = 1


class CharTokenizer:
    """A Hugging Face-shaped byte-level tokenizer: four control tokens, then one token per ASCII character."""

    SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]

    def __init__(self) -> None:
        self.chars = [chr(c) for c in range(32, 127)] + ["\n"]
        self.pieces = self.SPECIAL + ["Ġ" if c == " " else "Ċ" if c == "\n" else c for c in self.chars]
        self.bos_token, self.eos_token, self.bos_token_id = "<s>", "</s>", 0
        self.added_tokens_decoder = {i: NS(content=t) for i, t in enumerate(self.SPECIAL)}
        self.chat_template = CHATML

    def __len__(self) -> int:
        return len(self.pieces)

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]

    def id_of(self, ch: str) -> int:
        return len(self.SPECIAL) + self.chars.index(ch)

    def encode(self, text, add_special_tokens=True, split_special_tokens=False):
        ids, i = ([0] if add_special_tokens else []), 0
        while i < len(text):
            special = next((j for j, s in enumerate(self.SPECIAL) if text.startswith(s, i)), None)
            if special is not None and not split_special_tokens:
                ids.append(special)
                i += len(self.SPECIAL[special])
            else:
                ids.append(self.id_of(text[i]))
                i += 1
        return ids


class FakeLLM:
    """vLLM's AsyncLLM as VllmEngine uses it: generate(prompt, params, request_id) yields DELTA RequestOutputs,
    one token of one choice at a time; `text` is every choice's answer, then EOS (or the length limit)."""

    def __init__(self, tok: CharTokenizer, text: str = "hi there") -> None:
        self.tok, self.text = tok, text
        self.calls: list[tuple] = []
        self.aborted: list[str] = []
        self.fail_with: Exception | None = None
        self.hold: asyncio.Event | None = None  # set: outputs flow; unset: the stream waits after its first token
        self.errored = False

    async def generate(self, prompt, params, request_id, priority=0):
        self.calls.append((prompt, params, request_id))
        if self.fail_with is not None:
            raise self.fail_with
        ids = [self.tok.id_of(c) for c in self.text]
        n, limit = params["n"], params["max_tokens"]
        for i in range(n):
            steps = [*ids, EOS][:limit]
            for k, t in enumerate(steps):
                if k == 1 and self.hold is not None:
                    await self.hold.wait()
                await asyncio.sleep(0)
                last = k == len(steps) - 1
                reason = ("stop" if t == EOS else "length") if last else None
                text = "" if t == EOS else self.tok.chars[t - len(CharTokenizer.SPECIAL)]
                out = NS(index=i, text=text, token_ids=[t], finish_reason=reason, stop_reason=None, logprobs=None,
                         cumulative_logprob=None)
                yield NS(outputs=[out], finished=last and i == n - 1, num_cached_tokens=3, prompt_logprobs=None)

    async def abort(self, request_id):
        self.aborted.append(request_id)


def fake_engine(text: str = "hi there", *, max_num_seqs: int = 8, make_params=None) -> VllmEngine:
    tok = CharTokenizer()
    return VllmEngine(FakeLLM(tok, text), HfTokenizer(tok), make_params=make_params or dict, context_window=256,
                      vocab_size=len(tok), max_num_seqs=max_num_seqs)


def req(rid: str = "r1", **params) -> GenerationRequest:
    return GenerationRequest(rid, (0, 5, 6), SamplingParams(**{"max_tokens": 32, **params}))


async def collect(engine: VllmEngine, request: GenerationRequest) -> list:
    return [o async for o in engine.generate(request)]


# -- the engine ---------------------------------------------------------------------------------------------
async def test_a_request_streams_its_text_and_ends_at_eos():
    engine = fake_engine()
    outs = await collect(engine, req(temperature=0.5, stop=("zz",)))
    assert "".join(o.text for o in outs) == "hi there"
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_reason is None
    assert sum(len(o.token_ids) for o in outs) == 8 and outs[-1].completion_tokens == 9  # EOS counted, not shown
    assert outs[0].cached_tokens == 3 and outs[0].prompt_tokens == 3
    prompt, params, rid = engine.llm.calls[0]
    assert prompt == {"prompt_token_ids": [0, 5, 6]} and rid == "r1"
    assert params["temperature"] == 0.5 and params["stop"] == ["zz"] and params["max_tokens"] == 32
    assert engine.llm.aborted == [] and engine.stats().running == 0


async def test_every_choice_of_n_arrives_and_length_ends_them():
    outs = await collect(fake_engine(), req(n=2, max_tokens=3))
    for i in (0, 1):
        mine = [o for o in outs if o.index == i]
        assert "".join(o.text for o in mine) == "hi " and mine[-1].finish_reason is FinishReason.LENGTH


async def test_closing_the_stream_early_aborts_the_request_in_vllm():
    engine = fake_engine()
    stream = engine.generate(req("gone"))
    first = await stream.__anext__()
    assert first.text == "h" and engine.stats().running == 1
    await stream.aclose()
    await asyncio.sleep(0)
    assert engine.llm.aborted == ["gone"] and engine.stats().running == 0


async def test_a_constraint_is_a_400_before_vllm_sees_the_request():
    engine = fake_engine()
    request = GenerationRequest("c", (1,), SamplingParams(max_tokens=4), Constraint("{}", "k", "json_object"))
    with pytest.raises(InvalidParameter):
        await collect(engine, request)
    assert engine.llm.calls == []


async def test_what_vllm_refuses_is_a_400_and_what_breaks_is_not():
    engine = fake_engine()
    engine.llm.fail_with = ValueError("The decoder prompt is longer than the maximum model length")
    with pytest.raises(InvalidParameter, match="maximum model length"):
        await collect(engine, req())
    engine.llm.fail_with = RuntimeError("engine dead")
    with pytest.raises(RuntimeError):
        await collect(engine, req())


def test_check_params_refuses_beam_search_and_what_vllm_would_refuse():
    def strict(kw):
        if kw["top_p"] <= 0:
            raise ValueError("top_p must be in (0, 1], got 0.0.")
        return kw

    engine = fake_engine(make_params=strict)
    with pytest.raises(InvalidParameter, match="Beam search"):
        engine.check_params(SamplingParams(max_tokens=4, best_of=2, temperature=0.0, beam=BeamParams()))
    with pytest.raises(InvalidParameter, match="top_p"):
        engine.check_params(SamplingParams(max_tokens=4, top_p=0.0))
    engine.check_params(SamplingParams(max_tokens=4, n=2, best_of=4))


async def test_sequences_beyond_max_num_seqs_wait():
    engine = fake_engine(max_num_seqs=1)
    engine.llm.hold = asyncio.Event()
    a, b = engine.generate(req("a")), engine.generate(req("b"))
    await a.__anext__()
    await b.__anext__()
    s = engine.stats()
    assert (s.running, s.waiting, s.total_slots, s.free_slots) == (1, 1, 1, 0)
    engine.llm.hold.set()
    assert "".join([o.text async for o in a]) == "i there"
    await b.aclose()
    assert engine.stats().waiting == 0


# -- config, compose and the HTTP server --------------------------------------------------------------------
def test_engine_vllm_in_a_config_file_chooses_the_vllm_backend(tmp_path):
    path = tmp_path / "gpu.toml"
    path.write_text('[[deployments]]\nname = "qwen"\nmodel = "Qwen/Qwen2.5-0.5B-Instruct"\nengine = "vllm"\n'
                    '[deployments.vllm]\ntensor_parallel_size = 2\nmax_model_len = 4096\n'
                    'engine_args = {enable_prefix_caching = true}\n')
    spec = load_config_file(path).deployments[0]
    assert spec.backend == "vllm" and spec.vllm.tensor_parallel_size == 2 and spec.vllm.max_model_len == 4096
    assert spec.vllm.engine_args == {"enable_prefix_caching": True}
    assert DeploymentSpec(name="a", model="m").backend == "llamacpp"


@pytest.mark.parametrize("deployment, message", [
    ({"name": "e", "model": "m", "kind": "embedding", "engine": "vllm"}, "chat models only"),
    ({"name": "t", "model": "m", "vllm": {"dtype": "half"}}, 'engine = "vllm"'),
    ({"name": "r", "model": "m", "engine": "vllm", "vllm": {"engine_args": {"dtype": "half"}}}, "repeats dtype"),
    ({"name": "x", "model": "m", "engine": "tensorrt"}, "backend"),
])
def test_vllm_settings_are_validated(deployment, message):
    with pytest.raises(ValueError, match=message):
        ConfigFile.model_validate({"deployments": [deployment]})


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_a_vllm_deployment_says_how_to_install_it():
    with pytest.raises(RuntimeError, match=r"pip install 'servelm\[vllm\]'"):
        compose.Builder().build([DeploymentSpec(name="gpu", model="org/model", engine="vllm")], [])


def test_the_core_never_imports_vllm():
    from tests.test_layers import imports_of, modules, starts

    importers = [m for m, p in modules() if any(starts(i, "vllm") for i in imports_of(p))]
    assert importers == ["servelm.engine.vllm"]
    code = ("import sys, servelm.__main__, servelm.compose, servelm.http.app, servelm.service.chat; "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith(('vllm.', 'servelm.engine.vllm'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


@pytest.fixture
def vllm_server(monkeypatch):
    """compose.Builder().build over a vLLM deployment whose AsyncLLM is the fake, served by uvicorn."""
    monkeypatch.setattr(VllmEngine, "create", classmethod(lambda cls, options: fake_engine("hi there")))
    built = compose.Builder().build([DeploymentSpec(name="gpu", model="org/model", engine="vllm")], [])
    app = create_app(built.deployments, on_start=built.start, on_stop=built.stop)
    with serving(app) as url:
        yield url


def test_the_http_contract_over_a_vllm_deployment(vllm_server):
    client = openai.OpenAI(base_url=vllm_server + "/v1", api_key="none", max_retries=0)
    msg = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model="gpu", messages=msg, max_tokens=20)
    assert r.choices[0].message.content == "hi there" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 9 and r.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(model="gpu", messages=msg, max_tokens=4, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hi t"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    best = client.chat.completions.create(model="gpu", messages=msg, max_tokens=3, n=2, temperature=0.9)
    assert [c.message.content for c in best.choices] == ["hi ", "hi "]
    assert [m.id for m in client.models.list().data] == ["gpu"]


@pytest.mark.parametrize("extra", [
    {"use_beam_search": True, "best_of": 2, "temperature": 0},
    {"response_format": {"type": "json_object"}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
])
def test_what_vllm_cannot_do_is_a_400_even_when_streamed(vllm_server, extra):
    body = {"model": "gpu", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True, **extra}
    r = httpx.post(vllm_server + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    e = httpx.post(vllm_server + "/v1/embeddings", json={"model": "gpu", "input": "hi"}, timeout=10)
    assert e.status_code == 400
