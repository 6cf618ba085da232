"""The contract on a second architecture (issue 31): Gemma 3 270M (Q4_K_M, interleaved sliding-window attention, a
BOS, no chat template in its file), installed by make install, through the official client. What depends on the
model: its template (llama.cpp's built-in one, no ChatML markers leaking, <end_of_turn> ending answers), stop
strings, tool calls, echo offsets after its BOS, tokenizing, its context within the KV budget, and its prefix cache
over a sliding-window cache."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from servelm.config import GEMMA_MODEL_ID

from .conftest import own_server
from .helpers import client_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # slow: its server starts in the first test

GEMMA = GEMMA_MODEL_ID
END_OF_TURN = 106  # <end_of_turn>: an end-of-generation token of Gemma's vocabulary
BOS = 2
CELL_BYTES = 18 * 2 * 256 * 2  # 18 layers (15 of them sliding-window, kept as long as the others), 1 KV head of 256, f16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with own_server(tmp_path_factory, "--model-path", GEMMA, "--model-id", GEMMA, "--no-embedding-model",
                    "--chat-embedding-window", "0") as srv:
        yield srv.base_url


def test_its_card_says_what_it_is_and_how_it_is_served(gemma):
    card = httpx.get(f"{gemma}/v1/models/{GEMMA}", timeout=10).json()
    assert card["chat_template"] == "builtin:gemma" and card["quantization"] == "Q4_K_M"
    assert card["tool_call_format"] == "hermes (prompted)" and card["reasoning_markers"] is None
    assert card["exact"] is True and card["exactness"].startswith("exact")
    assert card["placement"] == "CPU"  # where its layers run (this machine has no GPU)
    # the trained context is 32,768; the default 768 MiB budget holds 16 streams of 2,560 full-size cells
    assert card["trained_context_length"] == 32768
    assert card["max_model_len"] == 2560 and 16 * card["max_model_len"] * CELL_BYTES <= 768 << 20
    health = httpx.get(f"{gemma}/health", timeout=10).json()["deployments"][GEMMA]
    assert health["kv_cell_bytes"] == CELL_BYTES and health["kv_cells_total"] == 16 * 2560
    assert health["exact"] is True and health["placement"] == "CPU"


def test_the_prompt_is_gemmas_own_turns_after_its_bos(gemma):
    ids = httpx.post(f"{gemma}/tokenize", json={"model": GEMMA, "messages": QUESTION}, timeout=10).json()["tokens"]
    text = httpx.post(f"{gemma}/detokenize", json={"model": GEMMA, "tokens": ids}, timeout=10).json()["prompt"]
    assert ids[0] == BOS and ids.count(BOS) == 1
    assert text.endswith("<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n")
    assert "<|im_start|>" not in text


def test_end_of_turn_ends_an_answer_and_no_marker_leaks(gemma):
    client = client_for(gemma)
    ended = client.chat.completions.create(model=GEMMA, messages=QUESTION, max_tokens=8, temperature=0,
                                           logit_bias={str(END_OF_TURN): 100})
    assert ended.choices[0].finish_reason == "stop" and ended.choices[0].message.content == ""
    answer = client.chat.completions.create(model=GEMMA, messages=QUESTION, max_tokens=40, temperature=0)
    text = answer.choices[0].message.content
    assert text and not any(m in text for m in ("<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>"))


def test_a_stop_string_cuts_the_answer_where_it_begins(gemma):
    client = client_for(gemma)
    full = client.chat.completions.create(model=GEMMA, messages=QUESTION, max_tokens=30, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    cut = client.chat.completions.create(model=GEMMA, messages=QUESTION, max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[: text.index(stop)]


def test_a_required_tool_call_parses(gemma):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    r = client_for(gemma).chat.completions.create(
        model=GEMMA, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool], tool_choice="required",
        max_tokens=60, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert "city" in call.function.arguments


def test_echo_offsets_count_the_text_not_the_bos(gemma):
    r = client_for(gemma).completions.create(model=GEMMA, prompt="The quick brown fox", echo=True, logprobs=1,
                                             max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs
    assert lp.tokens[:5] == ["<bos>", "The", " quick", " brown", " fox"]
    assert lp.text_offset == [0, 0, 3, 9, 15, 19]
    assert r.choices[0].text.startswith("The quick brown fox")


def test_the_sliding_window_cache_serves_a_prefix_hit_exactly(gemma):
    """The full-size sliding-window cache keeps every position, so a prompt longer than the window (512) is read
    back from the cache and answers as a fresh read does (a window-sized ring would have overwritten its start)."""
    client = client_for(gemma)
    history = [{"role": "user", "content": "Tell me about lighthouses. " * 80}]
    first = client.chat.completions.create(model=GEMMA, messages=history, max_tokens=16, temperature=0)
    again = client.chat.completions.create(model=GEMMA, messages=history, max_tokens=16, temperature=0)
    assert first.usage.prompt_tokens > 512
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content
