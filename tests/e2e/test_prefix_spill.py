"""The prefix cache beyond its cells and its process (issue 21), on the real model through the official client: an
entry a slot gives up is saved to host RAM and read back on a hit; a server stopped gracefully writes its entries
to --prefix-cache-dir, and one restarted on the directory answers the cached prompt from disk, the same answer
(its top-20 logprobs too) as the computed one; a server of another context layout ignores the files."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from servelm.config import GEMMA_MODEL_ID
from servelm.engine.spill import SUFFIX, directory_key, read_header, write_state

from . import ray_mode
from .conftest import own_server
from .helpers import MODEL, client_for

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(ray_mode.ENABLED, reason="a Ray replica's engine stops with its actor, not here")]

FAST = ("--no-embedding-model", "--chat-embedding-window", "0")
HISTORY = "The harbour records list every ship that came in, with its cargo, its captain and the weather. " * 40
LONG = [{"role": "system", "content": HISTORY}, {"role": "user", "content": "Which ship came in first?"}]
OTHER = [{"role": "system", "content": "A different story about mountains and snow. " * 30},
         {"role": "user", "content": "What happened on the summit?"}]


def ask(base_url: str, messages: list) -> tuple:
    answer = client_for(base_url).chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                          temperature=0, logprobs=True, top_logprobs=20)
    tops = [[(t.token, t.logprob) for t in c.top_logprobs] for c in answer.choices[0].logprobs.content]
    return answer.choices[0].message.content, tops, answer.usage


def test_an_entry_its_slot_gave_up_comes_back_from_host_ram(tmp_path_factory) -> None:
    with own_server(tmp_path_factory, "--max-num-seqs", "1", *FAST) as srv:
        text, tops, usage = ask(srv.base_url, LONG)
        ask(srv.base_url, OTHER)  # the only slot goes to another prompt: LONG's entry is saved to RAM
        again, again_tops, again_usage = ask(srv.base_url, LONG)
    assert usage.prompt_tokens > 800
    assert again_usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1, "read back, not computed"
    assert (again, again_tops) == (text, tops)


@pytest.mark.slow
def test_a_restarted_server_answers_from_disk_and_another_build_ignores_the_files(tmp_path_factory) -> None:
    directory = str(tmp_path_factory.mktemp("prefix-cache"))
    with own_server(tmp_path_factory, "--prefix-cache-dir", directory, *FAST) as srv:
        text, tops, usage = ask(srv.base_url, LONG)
    with own_server(tmp_path_factory, "--prefix-cache-dir", directory, *FAST) as srv:
        again, again_tops, again_usage = ask(srv.base_url, LONG)
    assert again_usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1, "read from disk"
    assert (again, again_tops) == (text, tops)
    with own_server(tmp_path_factory, "--prefix-cache-dir", directory, "--context-window", "1024", *FAST) as srv:
        _, _, other_usage = ask(srv.base_url, LONG)
        log = srv.log_path.read_text()
    assert other_usage.prompt_tokens_details.cached_tokens == 0, "another context layout never loads the state"
    assert "ignored: made for another model or build" in log


@pytest.mark.slow
async def test_a_forged_state_the_model_refuses_hurts_nobody_and_is_gone(tmp_path_factory) -> None:
    """Issue 32: a file with this server's valid header, fingerprint and MAC around another model's state bytes
    (Gemma 3 270M's). Its prompt sent while 4 other requests ran failed them all, then kept answering a wrong
    answer from 'cached' tokens, and the file stayed. Now the neighbours never notice, the prompt is read and
    answers as a fresh server does, the file goes, and the refusal is logged and counted."""
    foreign, ours = tmp_path_factory.mktemp("foreign"), tmp_path_factory.mktemp("ours")
    with own_server(tmp_path_factory, "--model-path", GEMMA_MODEL_ID, "--model-id", "gemma", "--prefix-cache-dir",
                    str(foreign), *FAST) as srv:
        client_for(srv.base_url).chat.completions.create(model="gemma", messages=LONG, max_tokens=2)
    with own_server(tmp_path_factory, "--prefix-cache-dir", str(ours), *FAST) as srv:
        reference = ask(srv.base_url, LONG)
    (gemma_file,) = foreign.glob(f"*{SUFFIX}")
    (our_file,) = ours.glob(f"*{SUFFIX}")
    header = read_header(our_file)
    their_state = gemma_file.read_bytes()[-read_header(gemma_file)["size"]:]
    our_file.unlink()
    forged, mac = write_state(ours, header["fingerprint"], header["scope"], tuple(header["tokens"]), their_state,
                              directory_key(ours))

    with own_server(tmp_path_factory, "--prefix-cache-dir", str(ours), *FAST) as srv:
        neighbours = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=120)

        async def neighbour(k: int, stream: bool) -> str:
            messages = [{"role": "user", "content": f"Neighbour {k}: tell me about rivers. " * (k + 2)}]
            if not stream:
                r = await neighbours.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
                return r.choices[0].message.content
            text = ""
            async for chunk in await neighbours.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                                                       temperature=0, stream=True):
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
            return text

        running = [asyncio.ensure_future(neighbour(k, k % 2 == 0)) for k in range(4)]
        await asyncio.sleep(0.5)  # they are decoding when the forged prompt comes
        answer = await asyncio.to_thread(ask, srv.base_url, LONG)
        texts = await asyncio.gather(*running)
        await neighbours.close()
        metrics = httpx.get(srv.base_url + "/metrics", timeout=10).text
        gone = not forged.exists()
        again = ask(srv.base_url, LONG)
        log = srv.log_path.read_text()
    assert all(texts), "every neighbour answered"
    assert answer[:2] == reference[:2] and answer[2].prompt_tokens_details.cached_tokens == 0
    assert again[:2] == reference[:2]
    assert gone, "the forged file is gone: no restart reads it again"
    assert not forged.exists() or read_header(forged)["mac"] != mac, \
        "what the graceful stop wrote under that name is the computed state"
    assert 'servelm_prefix_cache_restore_failures_total{model="smollm2-135m-instruct"} 1.0' in metrics
    assert "refused by the model" in log and "Traceback" not in log
