"""What one tenant's ordinary traffic did to another's stream, on an engine whose steps cost what they carry.

- Two concurrent requests of a new ~170-token prompt froze a neighbour's stream for 7.3 s (`--threads 1` on 2
  cores): waiting prompts that outnumbered the decoding streams and were short were all read in one step, past the
  inter-token target. Now a step that decodes reads only what the pacer allows, whatever waits: a burst, tools, a
  cached prefix with an uncached tail, the turns of a Responses request.
- A prompt's whole tiles were read a tile (64 rows) a step beside decoding, 0.9 s a tile there. Tiles are now read
  only where the start-up self-check times a tile's pass within half the target (--prompt-tiles auto).
- One key's 32 requests, sent a second before another key's one, were all served first: the other key's first token
  came after 15.4 s. Now the next free slot goes to the tenant served least (engine/fairness.py).
- A running batch's lines stalled an interactive neighbour's first token (2.9 s) and its stream (2.5 s gaps).

The fake runner here costs 4 ms a step and 2 ms a token, as a model on a CPU does (its costs are linear in what a
step carries), so the pacer learns them as it would a real model's.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from servelm.compose import DeploymentOptions, build_deployment, settle_tiles
from servelm.engine.plan import StepPlan
from servelm.http.app import AppOptions, create_app
from servelm.http.limits import SecurityConfig
from servelm.keys import key_spec
from servelm.runners.fake import FakeRunner
from servelm.service.registry.deployments import Deployments
from tests.conftest import serving

TARGET_S = 0.05
STEP_S, ROW_S = 0.004, 0.002
# the pacer's allowance beside one or two decoding rows, and some slack for its fit of wall times
MOST_BESIDE_DECODING = int((TARGET_S - STEP_S) / ROW_S) + 4


NEIGHBOURS = (key_spec("k1"), key_spec("k2"))  # k1 sends the traffic, k2 is the neighbour


def served(keys=NEIGHBOURS, fair_share: bool = True, **runner_kw):
    kw = dict(num_slots=8, context_window=2048, max_step_tokens=512, step_delay=STEP_S, row_delay=ROW_S, tile_rows=0)
    runner = FakeRunner(**{**kw, **runner_kw})
    dep, engine = build_deployment("fake-model", runner, DeploymentOptions(itl_target_s=TARGET_S, prefix_cache=True,
                                                                           fair_share=fair_share))
    app = create_app(Deployments([dep]), AppOptions(security=SecurityConfig(keys=list(keys))), on_start=engine.start,
                     on_stop=engine.stop)
    return app, runner


def words(n: int, salt: str) -> str:
    """n characters (the fake model's tokens) of text that shares nothing with another salt's."""
    return (salt * n)[:n]


async def stream(client: httpx.AsyncClient, key: str | None, content: str, max_tokens: int,
                 **extra) -> dict[str, float]:
    """A streamed chat request: its first token's time and its largest gap between tokens."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": "fake-model", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, **extra}
    start, last, first, gap = time.monotonic(), None, None, 0.0
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"] if json.loads(line[6:])["choices"] else {}
            if not delta.get("content") and not delta.get("tool_calls"):
                continue
            now = time.monotonic()
            first = first if first is not None else now - start
            gap = max(gap, now - last) if last is not None else gap
            last = now
    return {"first": first or 0.0, "gap": gap, "end": time.monotonic()}


def decoding_steps_reading_prompt(steps: list[StepPlan]) -> list[int]:
    """The prompt tokens each step that also decoded read."""
    return [p.num_tokens - p.decode_tokens for p in steps if p.decode_tokens and p.num_tokens > p.decode_tokens]


def check_bound(runner: FakeRunner, since: int) -> list[int]:
    read = decoding_steps_reading_prompt(runner.steps[since:])
    assert read, "prompts were read beside the decoding stream"
    assert max(read) <= MOST_BESIDE_DECODING, f"a decoding step read {max(read)} prompt tokens (steps: {read})"
    return read


async def beside_a_stream(app, runner, send, *, key="k2", warm: int = 40, before=None) -> list[int]:
    """A neighbour streams; once the pacer has seen enough steps, `send(client)` runs; the prompt tokens each of the
    neighbour's decoding steps read after that. `before(client)` runs first."""
    with serving(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            if before is not None:
                await before(client)
            await stream(client, key, "w" * 40, 20)  # the pacer sees steps with and without prompt
            neighbour = asyncio.create_task(stream(client, key, "hello", 400))
            while len(runner.steps) < warm:
                await asyncio.sleep(0.01)
            since = len(runner.steps)
            await send(client)
            await neighbour
    return check_bound(runner, since)


async def test_a_burst_of_short_prompts_from_another_key_is_read_within_the_target_beside_a_stream():
    app, runner = served()

    async def burst(client):
        await asyncio.gather(*(stream(client, "k1", words(170, f"burst{i}"), 24) for i in range(2)))

    read = await beside_a_stream(app, runner, burst)
    assert sum(read) >= 2 * 170, "both prompts were read while the stream decoded, a few tokens a step"


async def test_a_long_prompt_whose_prefix_is_cached_reads_its_tail_within_the_target():
    app, runner = served()
    head = words(729, "cached")

    async def long_prompt(client):
        await stream(client, "k1", head + words(20, "tail"), 8)

    async def cache_it(client):
        await stream(client, "k1", head, 2)

    await beside_a_stream(app, runner, long_prompt, before=cache_it)
    tail = [c for p in runner.steps for c in p.chunks if c.start >= 729 and len(c.tokens) > 1]
    assert tail, "the tail was read past the cached prefix"


async def test_a_grammar_bound_request_is_read_within_the_target():
    """A tool's or a schema's request reads its prompt as any other (the fake model's letters take a regex, not a
    tool call's syntax: tools ride the same grammar path)."""
    app, runner = served()

    async def constrained(client):
        await stream(client, "k1", words(300, "ask"), 16, structured_outputs={"regex": "[a-z]{16}"})

    await beside_a_stream(app, runner, constrained)


async def test_a_responses_request_is_read_within_the_target():
    app, runner = served()

    async def respond(client):
        r = await client.post("/v1/responses", headers={"authorization": "Bearer k1"}, json={
            "model": "fake-model", "input": words(300, "resp"), "max_output_tokens": 8})
        assert r.status_code == 200, r.text

    await beside_a_stream(app, runner, respond)


def test_without_a_target_a_decoding_step_may_read_a_whole_burst():
    """The bound is the pacer's: with no target the same traffic reads more beside decoding (the tests above fail
    on an engine that reads every short waiting prompt at once)."""
    runner = FakeRunner(num_slots=8, context_window=2048, max_step_tokens=512, tile_rows=0, step_delay=STEP_S,
                        row_delay=ROW_S)
    dep, engine = build_deployment("fake-model", runner, DeploymentOptions(itl_target_s=0.0))
    app = create_app(Deployments([dep]), on_start=engine.start, on_stop=engine.stop)

    async def go():
        with serving(app) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                neighbour = asyncio.create_task(stream(client, None, "hello", 100))
                while not runner.steps:
                    await asyncio.sleep(0.005)
                await asyncio.gather(*(stream(client, None, words(170, f"b{i}"), 4) for i in range(2)))
                await neighbour

    asyncio.run(go())
    assert max(decoding_steps_reading_prompt(runner.steps)) > MOST_BESIDE_DECODING


# -- tiles ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting, tile_s, target_s, kept", [
    ("auto", 0.9, 0.2, False),  # a tile's pass (0.9 s) over half the target: off
    ("auto", 0.04, 0.2, True),
    ("auto", 0.9, 0.0, True),  # no target: nothing to keep within
    ("auto", 0.0, 0.2, False),  # not timed (the self-check times a tile where the context holds two): off
    ("on", 0.0, 0.2, True),
    ("on", 0.9, 0.2, True),
    ("off", 0.01, 0.2, False),
])
def test_tiles_are_read_only_where_a_tiles_pass_fits_the_target(setting, tile_s, target_s, kept):
    runner = FakeRunner(tile_rows=64)
    runner.tile_seconds = tile_s
    before = runner.tile_rows
    said = settle_tiles("fake-model", runner, DeploymentOptions(itl_target_s=target_s, prompt_tiles=setting))
    assert (runner.tile_rows == before) is kept and said.startswith("on" if kept else "off"), said
    if setting == "on" and (tile_s > target_s / 2 or not tile_s):
        assert "past --itl-target-ms" in said or "not timed" in said, "it says the bound may not hold"


def test_a_runner_without_tiles_says_nothing_of_them():
    runner = FakeRunner(tile_rows=0)
    assert settle_tiles("fake-model", runner, DeploymentOptions(itl_target_s=0.2)) == ""


# -- fair share over HTTP ----------------------------------------------------------------------------------------
async def _flood_then_one(fair_share: bool) -> tuple[int, list[float], float]:
    """Key A sends 32 requests of 16 tokens at once to 4 slots; once they wait, key B sends one. Returns B's place
    among the 33 answers, A's end times, and B's first token's wait."""
    keys = [key_spec("key-a", name="a"), key_spec("key-b", name="b"), key_spec("key-m", monitor=True)]
    app, runner = served(keys, fair_share=fair_share, num_slots=4, row_delay=0.0, step_delay=0.01)
    with serving(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            flood = [asyncio.create_task(stream(client, "key-a", words(30, f"a{i}"), 16)) for i in range(32)]
            while True:
                health = (await client.get("/health", headers={"authorization": "Bearer key-a"})).json()
                if health["deployments"]["fake-model"]["waiting"] >= 20:
                    break
                await asyncio.sleep(0.01)
            b = await stream(client, "key-b", words(30, "b"), 16)
            a = await asyncio.gather(*flood)
            metrics = (await client.get("/metrics", headers={"authorization": "Bearer key-m"})).text
    ends = sorted([x["end"] for x in a] + [b["end"]])
    if fair_share:
        assert 'servelm_tenant_tokens_total{model="fake-model",tenant="a"}' in metrics, metrics[-2000:]
        assert 'servelm_tenant_tokens_total{model="fake-model",tenant="b"}' in metrics
    return ends.index(b["end"]), [x["end"] for x in a], b["first"]


async def test_one_keys_flood_does_not_crowd_out_another_keys_single_request():
    place, a_ends, first = await _flood_then_one(True)
    assert place <= 8, f"B's answer came {place + 1}th of 33"
    assert len(a_ends) == 32, "every one of A's requests answered"


async def test_without_fair_share_the_flood_goes_first():
    place, _, _ = await _flood_then_one(False)
    assert place >= 24, f"first come, first served: B came {place + 1}th of 33"


# -- a running batch yields ----------------------------------------------------------------------------------
async def test_a_running_batch_decodes_only_the_rows_the_target_holds_beside_an_interactive_stream(tmp_path):
    """Eight slots of batch lines beside one interactive stream, on an engine whose rows cost 10 ms: the target
    (60 ms) holds five rows a step, so the batch's lines take what is left beside the stream (they took all eight,
    and a neighbour's gaps grew with them), and still move on; alone, before and after it, they decode together."""
    from servelm.http.batches import BatchConfig

    runner = FakeRunner(num_slots=8, context_window=512, max_step_tokens=256, step_delay=0.004, row_delay=0.01,
                        tile_rows=0)
    dep, engine = build_deployment("fake-model", runner, DeploymentOptions(itl_target_s=0.06))
    app = create_app(Deployments([dep]), AppOptions(security=SecurityConfig(keys=list(NEIGHBOURS)),
                                                    batches=BatchConfig(str(tmp_path / "state"))),
                     on_start=engine.start, on_stop=engine.stop)
    lines = b"".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "fake-model", "messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 60,
        "ignore_eos": True}}).encode() + b"\n" for i in range(40))
    auth = {"authorization": "Bearer k1"}
    with serving(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            f = await client.post("/v1/files", headers=auth, files={"file": ("in.jsonl", lines)}, data={"purpose": "batch"})
            batch = await client.post("/v1/batches", headers=auth, json={
                "input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
            while (await client.get("/health", headers=auth)).json()["deployments"]["fake-model"]["running"] < 8:
                await asyncio.sleep(0.02)
            while engine.pacer.rows_within() is None:  # the pacer has seen steps of every kind
                await stream(client, "k2", "hello", 5)
            since = len(runner.steps)
            neighbour = await stream(client, "k2", "hello", 40)
            until = len(runner.steps)
            state = (await client.get(f"/v1/batches/{batch.json()['id']}", headers=auth)).json()
    most = engine.pacer.rows_within()
    assert most is not None and 3 <= most <= 6, most
    rows = [p.decode_tokens for p in runner.steps[since:until] if p.decode_tokens]
    # the window's first and last steps may come before the stream reached the engine or after it left: there the
    # batch's lines, alone, decode together
    while rows and rows[0] > most:
        rows.pop(0)
    while rows and rows[-1] > most:
        rows.pop()
    assert len(rows) >= 30 and max(rows) <= most, (most, rows)
    assert neighbour["gap"] < 1.0
    assert min(rows) >= 2, "the batch's lines still move on: a row of theirs beside the stream's every step"
    assert state["status"] == "in_progress"
