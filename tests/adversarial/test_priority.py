"""Priorities as an attack: a priority too large for a float, a flood of very urgent requests, and who may ask
for an urgent one.

- `"priority": 1` followed by 309 zeros reached Scheduler.rank (priority + age as a float): its OverflowError
  failed every request in flight. The value is now bounded where parsed (tests/adversarial/test_numbers.py), and
  rank never does arithmetic on it.
- A flood at priority -1000 starved a priority-0 client (aging, one level a minute, took about 17 hours to make up
  the gap). Aging now counts priorities within ±AGING_SPAN: past 2 × AGING_SPAN levels of waiting, nothing that
  arrives later ranks above a request, whatever its priority.
- A burst of long priority-0 prompts, then one short priority -5 request while a priority-0 stream decoded: the
  stream held back (as it should) for the urgent prompt, but the burst's waiting prompts were read in the same
  step, and with nothing decoding that step took the whole 2,048-token budget: 8.5 s before the urgent request's
  first token, and as long a gap in the stream. Waiting requests that rank below the urgent one now wait too.
- With keys on, a key goes below priority 0 only when granted (`min_priority` in its [[keys]] table or key-file line),
  or as an admin key.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from servelm.compose import DeploymentOptions, build_deployment
from servelm.engine.fairness import AGING_SPAN
from servelm.http.app import create_app
from servelm.http.limits import SecurityConfig
from servelm.keys import key_from_table, key_spec, parse_key_file
from servelm.runners.fake import FakeRunner
from servelm.service.registry.deployments import Deployments
from tests.conftest import serving
from tests.engine.test_scheduler import ranked, run_step, sched

MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": "fake-model", "messages": MSG, "max_tokens": 3}


# -- the scheduler ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("aging_s", [0, 60])
def test_rank_takes_any_priority_without_overflowing(aging_s):
    s = sched(num_slots=1, max_step_tokens=64, aging_s=aging_s)
    s.add(ranked("huge", 4, 10**309, max_tokens=1, received=5.0))
    s.add(ranked("negative", 4, -(10**309), max_tokens=1, received=6.0))
    s.add(ranked("plain", 4, 0, max_tokens=1, received=7.0))
    plan = run_step(s)  # used to raise OverflowError: int too large to convert to float
    assert [s.group(c).request_id for c in plan.chunks] == ["negative"]


def test_aging_makes_up_a_bounded_gap_so_no_priority_starves_another():
    s = sched(num_slots=1, max_step_tokens=64, aging_s=10)
    s.add(ranked("patient", 5, 0, max_tokens=1, received=0.0))
    gap = AGING_SPAN * 10  # AGING_SPAN levels: the most a priority below -AGING_SPAN counts for
    s.add(ranked("flood", 5, -1000, max_tokens=1, received=gap + 1.0))
    plan = run_step(s)
    assert [s.group(c).request_id for c in plan.chunks] == ["patient"]
    # at the same age, a lower priority still goes first, however far below the span it is
    s2 = sched(num_slots=1, max_step_tokens=64, aging_s=10)
    s2.add(ranked("a", 5, -20, max_tokens=1, received=0.0))
    s2.add(ranked("b", 5, -1000, max_tokens=1, received=0.0))
    assert [s2.group(c).request_id for c in run_step(s2).chunks] == ["b"]


def test_an_old_running_request_does_not_hold_back_for_newer_urgent_prompts():
    s = sched(num_slots=2, max_step_tokens=64, aging_s=10)
    s.add(ranked("old", 4, 0, max_tokens=50, received=0.0))
    run_step(s)
    run_step(s)
    s.add(ranked("urgent-but-new", 40, -1000, max_tokens=5, received=AGING_SPAN * 10 + 1.0))
    plan = run_step(s)
    assert "old" in {s.group(c).request_id for c in plan.chunks}, "it still gets its row while the prompt is read"


# -- over HTTP: the starved client ---------------------------------------------------------------------------
def test_an_urgent_prompt_is_read_alone_not_with_the_lower_priority_prompts_waiting():
    s = sched(num_slots=4, max_step_tokens=2048, aging_s=0, context_window=1024)
    s.add(ranked("stream", 5, 0, max_tokens=50))
    run_step(s)
    for i in range(2):
        s.add(ranked(f"long-{i}", 900, 0, max_tokens=4))
    s.add(ranked("urgent", 8, -5, max_tokens=4))
    plan = run_step(s)
    assert {s.group(c).request_id for c in plan.chunks} == {"urgent"} and plan.num_tokens == 8, \
        "only the urgent prompt is read: its first token does not wait for 1,800 tokens of others"
    plan = run_step(s)
    assert {"urgent", "stream"} <= {s.group(c).request_id for c in plan.chunks}, "then the stream decodes again"


@pytest.mark.slow
def test_a_flood_of_urgent_requests_leaves_a_priority_0_client_its_turn():
    """Two slots, six threads sending priority -1000 without pause, and a priority-0 request among them. With aging
    at 0.05 s a level, the old aging made it wait 1000 levels (50 s, so until the flood ended); it now waits about
    AGING_SPAN levels."""
    aging = 0.05
    dep, engine = build_deployment("fake-model", FakeRunner(num_slots=2, step_delay=0.005, context_window=400),
                                   DeploymentOptions(priority_aging_s=aging))
    app = create_app(Deployments([dep]), on_start=engine.start, on_stop=engine.stop)
    flood_s = 12.0
    with serving(app) as url:
        stop = time.monotonic() + flood_s
        flood_body = {**CHAT, "max_tokens": 8, "ignore_eos": True, "priority": -1000}

        def flood() -> None:
            with httpx.Client(timeout=60) as client:
                while time.monotonic() < stop:
                    client.post(url + "/v1/chat/completions", json=flood_body)

        threads = [threading.Thread(target=flood) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # the flood holds both slots and the queue
        start = time.monotonic()
        r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "priority": 0}, timeout=60)
        latency = time.monotonic() - start
        for t in threads:
            t.join(60)
    assert r.status_code == 200
    print(f"priority-0 latency beside a -1000 flood (aging {aging} s/level): {latency:.2f} s")
    assert latency < 2 * AGING_SPAN * aging + 2.0, f"waited {latency:.1f} s behind the flood"


# -- with keys: who may ask for an urgent priority ---------------------------------------------------------------
@pytest.fixture
def keyed(fake_server_factory):
    keys = [key_spec("sk-plain"), key_spec("sk-urgent", min_priority=-100), key_spec("sk-admin", admin=True)]
    return fake_server_factory(security=SecurityConfig(keys=keys))


def ask(server, key: str, priority: int, path: str = "/v1/chat/completions") -> httpx.Response:
    body = CHAT if path == "/v1/chat/completions" else {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
    return httpx.post(server.base_url + path, json={**body, "priority": priority},
                      headers={"Authorization": f"Bearer {key}"}, timeout=20)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_key_goes_below_priority_0_only_when_granted(keyed, path):
    r = ask(keyed, "sk-plain", -1, path)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert "at least 0" in r.json()["error"]["message"]
    assert ask(keyed, "sk-plain", 0, path).status_code == 200
    assert ask(keyed, "sk-plain", 5, path).status_code == 200
    assert ask(keyed, "sk-urgent", -100, path).status_code == 200
    assert ask(keyed, "sk-urgent", -101, path).status_code == 400
    assert ask(keyed, "sk-admin", -1000, path).status_code == 200


def test_the_key_bound_holds_on_messages_and_responses(keyed):
    h = {"Authorization": "Bearer sk-plain"}
    r = httpx.post(keyed.base_url + "/v1/messages", headers=h, timeout=20,
                   json={"model": "fake-model", "max_tokens": 2, "messages": MSG, "priority": -5})
    assert r.status_code == 400 and "priority" in r.text
    r = httpx.post(keyed.base_url + "/v1/responses", headers=h, timeout=20,
                   json={"model": "fake-model", "input": "hi", "max_output_tokens": 2, "priority": -5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_an_open_server_takes_any_priority_in_range(fake_server):
    r = httpx.post(fake_server.base_url + "/v1/chat/completions", json={**CHAT, "priority": -1000}, timeout=20)
    assert r.status_code == 200


def test_min_priority_from_the_key_file_and_tables():
    (a, b) = parse_key_file("sk-a min_priority=-10\nsk-b\n")
    assert (a.min_priority, b.min_priority) == (-10, None)
    assert key_from_table({"key": "sk-c", "min_priority": -3}).min_priority == -3
    for bad in ("x", 1.5, 2**31, -(2**31) - 1, True):
        with pytest.raises(ValueError, match="min_priority"):
            key_from_table({"key": "sk-d", "min_priority": bad})
    with pytest.raises(ValueError, match="min_priority"):
        parse_key_file("sk-e min_priority=soon\n")
