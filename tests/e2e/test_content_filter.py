"""Content filtering on the real model, through the official clients: `--content-blocklist` (input and output,
streamed and not, on every dialect: openai's chat, completions and Responses, azure-ai-inference on Azure's path,
/v3, /invocations, Anthropic's Messages), and a guard model: the default model as the guard deployment, with a
small template whose labels its answer must take through the grammar. The template steers the small model (it
shows examples that answer for the listed word), so this proves the pipeline, not the judgement.

The listed words come from the model's own greedy answers on this machine (the session server's, no policy): a
word a third or more into the answer to "Name three colours." and one in the completion of "The three primary
colours are red,". Which words a small model writes depends on the CPU's kernels (an AVX-512 machine's answer
names Green within 60 tokens, an AVX2 one's does not), and the filters must stop whatever listed word comes."""

from __future__ import annotations

import re
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest
from azure.ai.inference import ChatCompletionsClient
from azure.ai.inference.models import UserMessage
from azure.core.credentials import AzureKeyCredential
from azure.core.exceptions import HttpResponseError

from . import ray_mode
from .conftest import own_server
from .helpers import MODEL, client_for, user

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(ray_mode.ENABLED, reason="the e2e Ray mode writes its own config")]

COLOURS = user("Name three colours.")
PRIMARY = "The three primary colours are red,"
HELLO = user("Hi there!")
# words that may stand in the prompt as the server renders it (SmolLM2's default system prompt among them)
PROMPTED = "name three colours primary the are red you helpful assistant named smollm trained hugging face"


@dataclass(frozen=True)
class Listed:
    answer: str  # the answer to COLOURS, 60 tokens, greedy, with no policy
    word: str  # listed: in `answer`, a third or more in
    completion_word: str  # listed: in the completion of PRIMARY, 20 tokens


def unfiltered(client: openai.OpenAI, messages, max_tokens: int = 60) -> str:
    """The session server's answer (no policy): what the filtered one must be a part of."""
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                          temperature=0).choices[0].message.content


def _a_word(text: str, not_in: str, after: int = 0) -> str:
    """The first word of five letters or more that starts at `after` or later in `text`, is not in it before, and
    is not in `not_in`."""
    for m in re.finditer(r"\b[A-Za-z]{5,}\b", text):
        word = m.group().lower()
        if m.start() >= after and word not in text[: m.start()].lower() and word not in not_in:
            return word
    raise AssertionError(f"no word to list in {text!r}")


@pytest.fixture(scope="module")
def listed(client) -> Listed:
    answer = unfiltered(client, COLOURS)
    completion = client.completions.create(model=MODEL, prompt=PRIMARY, max_tokens=20, temperature=0).choices[0].text
    hello = unfiltered(client, HELLO, 20).lower()  # an answer neither list may touch
    word = _a_word(answer, f"{PROMPTED} {hello}", after=len(answer) // 3)
    return Listed(answer, word, _a_word(completion, f"{PROMPTED} {hello} {word}"))


@pytest.fixture(scope="module")
def lists(tmp_path_factory, listed):
    path = tmp_path_factory.mktemp("lists") / "blocked.txt"
    path.write_text(f"{listed.word}\n{listed.completion_word}\nparis\nre:secret\\s+code\n")
    with own_server(tmp_path_factory, "--content-blocklist", str(path), "--no-embedding-model") as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(lists):
    c = client_for(lists.base_url)
    yield c
    c.close()


def test_a_listed_prompt_is_the_seeds_content_filter_error(oai):
    for text in ("Is Paris in France?", "Is Pаris in France?", "Tell me the SECRET   code."):  # Cyrillic а
        with pytest.raises(openai.BadRequestError) as exc:
            oai.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *user(text)],
                                        max_tokens=8)
        assert exc.value.code == "content_filter" and exc.value.param == "messages[1].content", text
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model=MODEL, prompt=["fine", "the road to paris"], max_tokens=4)
    assert exc.value.code == "content_filter" and exc.value.param == "prompt[1]"


def test_a_listed_answer_stops_with_content_filter(oai, listed):
    whole, word = listed.answer, listed.word
    r = oai.chat.completions.create(model=MODEL, messages=COLOURS, max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "content_filter"
    assert word not in choice.message.content.lower() and whole.startswith(choice.message.content)
    assert choice.model_extra["content_filter_results"]["custom_blocklists"]["filtered"] is True
    assert r.model_extra["prompt_filter_results"][0]["content_filter_results"]["custom_blocklists"]["filtered"] is False
    assert r.usage.completion_tokens > 0


def test_a_listed_answer_stops_a_stream_before_its_text_is_sent(oai, listed):
    whole = listed.answer
    chunks = list(oai.chat.completions.create(model=MODEL, messages=COLOURS, max_tokens=60, temperature=0,
                                              stream=True))
    assert chunks[0].choices == [] and "prompt_filter_results" in chunks[0].model_extra
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert listed.word not in text.lower() and whole.startswith(text)
    assert chunks[-1].choices[0].finish_reason == "content_filter"
    assert chunks[-1].choices[0].model_extra["content_filter_results"]["custom_blocklists"]["filtered"] is True


def test_a_clean_answer_is_the_same_with_the_policy(oai, client):
    r = oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == unfiltered(client, HELLO, 20)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_completions_v3_and_invocations(oai, lists, listed):
    r = oai.completions.create(model=MODEL, prompt=PRIMARY, max_tokens=20, temperature=0)
    assert r.choices[0].finish_reason == "content_filter" and listed.completion_word not in r.choices[0].text.lower()
    v3 = client_for(lists.base_url, path="/v3")
    assert v3.chat.completions.create(model=MODEL, messages=COLOURS, max_tokens=60,
                                      temperature=0).choices[0].finish_reason == "content_filter"
    v3.close()
    r = httpx.post(lists.base_url + "/invocations", json={"messages": COLOURS, "max_tokens": 60, "temperature": 0},
                   timeout=120)
    assert r.json()["choices"][0]["finish_reason"] == "content_filter"
    r = httpx.post(lists.base_url + "/invocations", json={"inputs": "Where is Paris?"}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "content_filter"


def test_azure_ai_inference(lists, listed):
    azure = ChatCompletionsClient(endpoint=lists.base_url, credential=AzureKeyCredential("none"))
    try:
        with pytest.raises(HttpResponseError) as exc:
            azure.complete(messages=[UserMessage("Is Paris big?")], max_tokens=8)
        assert exc.value.status_code == 400 and exc.value.error.code == "content_filter"
        r = azure.complete(messages=[UserMessage("Name three colours.")], max_tokens=60, temperature=0)
        assert r.choices[0].finish_reason == "content_filter"
        assert listed.word not in r.choices[0].message.content.lower()
        updates = list(azure.complete(messages=[UserMessage("Name three colours.")], max_tokens=60, temperature=0,
                                      stream=True))
        text = "".join(u.choices[0].delta.content or "" for u in updates if u.choices)
        assert text == r.choices[0].message.content
        assert [u.choices[0].finish_reason for u in updates if u.choices][-1] == "content_filter"
    finally:
        azure.close()


def test_responses_and_messages(oai, lists, listed):
    r = oai.responses.create(model=MODEL, input="Name three colours.", max_output_tokens=60, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "content_filter"
    assert listed.word not in r.output_text.lower()
    with pytest.raises(openai.BadRequestError) as exc:
        oai.responses.create(model=MODEL, input="Where is Paris?", max_output_tokens=8)
    assert exc.value.code == "content_filter"
    claude = anthropic.Anthropic(base_url=lists.base_url, api_key="none", max_retries=0, timeout=120)
    try:
        m = claude.messages.create(model=MODEL, max_tokens=60, messages=COLOURS, extra_body={"temperature": 0})
        text = "".join(block.text for block in m.content)  # none at all where the word came in the first window
        assert m.stop_reason == "refusal" and listed.word not in text.lower()
        with pytest.raises(anthropic.BadRequestError):
            claude.messages.create(model=MODEL, max_tokens=8, messages=user("Where is Paris?"))
    finally:
        claude.close()


def test_metrics_count_what_was_filtered(lists, oai):
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=user("paris"), max_tokens=4)
    metrics = httpx.get(lists.base_url + "/metrics").text
    line = f'servelm_content_filtered_total{{category="blocklist",direction="input",model="{MODEL}"}}'
    assert line in metrics
    assert "paris" not in lists.log_tail(20000).lower()  # the access log says filtered, never the text


# -- a guard model ----------------------------------------------------------------------------------------
GUARD_TEMPLATE = """{% set text = messages[-1].content %}
{% set verdict = "unsafe\\nG" if "WORD" in text|lower else "safe" %}
{% for example in ["Hello there", "Tell me a story", "What is the weather like?"] %}
<|im_start|>user
Does this say WORD? {{ example }}<|im_end|>
<|im_start|>assistant
{{ verdict }}<|im_end|>
{% endfor %}
<|im_start|>user
Does this say WORD? {{ text }}<|im_end|>
<|im_start|>assistant{{ "\\n" }}
"""  # WORD: the listed word


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, listed):
    folder = tmp_path_factory.mktemp("guard")
    (folder / "guard.jinja").write_text(GUARD_TEMPLATE.replace("WORD", listed.word))
    (folder / "servelm.toml").write_text(f"""
[[deployments]]
name = "{MODEL}"
model = "{MODEL}"
embedding_window = 0
[deployments.content_filter]
window = 8
[deployments.content_filter.guard]
deployment = "{MODEL}"
template = "{folder / 'guard.jinja'}"
labels = [{{label = "G", name = "The listed word", category = "listed"}}, {{label = "H", name = "Hate", category = "hate"}}]
""")
    with own_server(tmp_path_factory, "--config", str(folder / "servelm.toml")) as srv:
        c = client_for(srv.base_url)
        yield c
        c.close()


def test_the_guard_passes_a_safe_prompt_and_annotates_its_categories(guarded, client):
    r = guarded.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20, temperature=0)
    safe = {"listed": {"filtered": False, "severity": "safe"}, "hate": {"filtered": False, "severity": "safe"}}
    assert r.model_extra["prompt_filter_results"] == [{"prompt_index": 0, "content_filter_results": safe}]
    assert r.choices[0].model_extra["content_filter_results"] == safe
    assert r.choices[0].message.content == unfiltered(client, HELLO, 20)


def test_the_guard_blocks_a_prompt_it_flags(guarded, listed):
    with pytest.raises(openai.BadRequestError) as exc:
        guarded.chat.completions.create(model=MODEL, messages=user(f"Is {listed.word} a word?"), max_tokens=8)
    assert exc.value.code == "content_filter" and exc.value.param == "messages[0].content"
    assert exc.value.body["innererror"]["content_filter_result"]["listed"] == {"filtered": True, "severity": "high"}


def test_the_guard_stops_an_answer_it_flags(guarded, listed):
    whole = listed.answer
    chunks = list(guarded.chat.completions.create(model=MODEL, messages=COLOURS, max_tokens=60, temperature=0,
                                                  stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert listed.word not in text.lower() and whole.startswith(text) and len(text) > 10
    last = chunks[-1].choices[0]
    assert last.finish_reason == "content_filter"
    assert last.model_extra["content_filter_results"]["listed"] == {"filtered": True, "severity": "high"}
