"""The prefix cache beyond its cells and its process (issue 21), on the real model through the official client: an
entry a slot gives up is saved to host RAM and read back on a hit; a server stopped gracefully writes its entries
to --prefix-cache-dir, and one restarted on the directory answers the cached prompt from disk, the same answer
(its top-20 logprobs too) as the computed one; a server of another context layout ignores the files."""

from __future__ import annotations

import pytest

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
