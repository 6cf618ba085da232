"""Images in prompts on the fake runner (which checks every plan: an image chunk is a pass of its own, holds its
placeholders, was encoded first, and is whole unless causal): how the scheduler reads them, one a step beside
decoding streams, how the prefix cache reuses them, and that a failed encode fails its request alone."""

from __future__ import annotations

import asyncio

import pytest

from servelm.engine.local import LocalEngine
from servelm.engine.types import GenerationRequest, MediaChunk, MediaSpan, SamplingParams
from servelm.runners.fake import FakeProjector, FakeRunner
from tests.engine.steps import request_ids


def prompt_with(images: list[bytes], length: int = 6, causal: bool = False, text: int = 5) -> tuple[tuple[int, ...], tuple[MediaSpan, ...]]:
    """`text` word tokens, then each image (its positions) followed by `text` more."""
    ids: list[int] = list(range(1, text + 1))
    spans = []
    for data in images:
        chunk = MediaChunk(data, 0, length, causal)
        spans.append(MediaSpan(len(ids), chunk))
        ids += [chunk.placeholder] * length + list(range(1, text + 1))
    return tuple(ids), tuple(spans)


def engine_with(**kw) -> tuple[LocalEngine, FakeRunner]:
    projector = FakeProjector(length=kw.pop("length", 6), causal=kw.pop("causal", False))
    runner = FakeRunner(projector=projector, **{"num_slots": 4, "max_step_tokens": 16, "max_rows": 8, **kw})
    eng = LocalEngine(runner)
    eng.start()
    return eng, runner


async def run(engine, rid, prompt, spans, max_tokens=4):
    req = GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), media=spans)
    tokens, final = [], None
    async for out in engine.generate(req):
        tokens += out.token_ids
        final = out
    return tokens, final


def media_chunks(runner):
    return [c for plan in runner.steps for c in plan.chunks if c.media is not None]


async def test_an_image_is_a_whole_chunk_of_its_own_and_counts_in_the_prompt():
    eng, runner = engine_with(length=12)  # longer than max_rows (8): a bidirectional image still goes whole
    try:
        prompt, spans = prompt_with([b"IMG-red"], length=12)
        tokens, final = await run(eng, "a", prompt, spans)
        assert final.prompt_tokens == len(prompt) == 5 + 12 + 5 and len(tokens) == 4
        [chunk] = media_chunks(runner)
        assert chunk.start == 5 and len(chunk.tokens) == 12 and chunk.offset == 0
        assert runner.encoded == [spans[0].chunk.key]
    finally:
        eng.stop()


async def test_the_answer_depends_on_the_image():
    eng, _ = engine_with()
    try:
        a = await run(eng, "a", *prompt_with([b"IMG-red"]))
        b = await run(eng, "b", *prompt_with([b"IMG-blue"]))
        # the fake's image ends with text, so the image reaches the answer only through the cells: the text after
        # it is the same, hence the same answer; with the image last, the answer starts from the image's row
        ids_a, spans_a = prompt_with([b"IMG-red"], text=0)
        ids_b, spans_b = prompt_with([b"IMG-blue"], text=0)
        c = await run(eng, "c", ids_a, spans_a)
        d = await run(eng, "d", ids_b, spans_b)
        assert a[0] == b[0] and c[0] != d[0]
    finally:
        eng.stop()


async def test_a_causal_image_is_read_in_pieces_of_at_most_max_rows():
    eng, runner = engine_with(length=20, causal=True)
    try:
        prompt, spans = prompt_with([b"IMG-x"], length=20, causal=True)
        await run(eng, "a", prompt, spans)
        pieces = media_chunks(runner)
        assert [len(c.tokens) for c in pieces] == [8, 8, 4] and [c.offset for c in pieces] == [0, 8, 16]
        assert runner.encoded == [spans[0].chunk.key]  # encoded once, before its first piece
    finally:
        eng.stop()


async def test_one_image_a_step_while_text_streams_keep_decoding():
    # steps of 20 ms: the text's 40 steps outlast the six image steps even when a loaded machine posts the images late
    eng, runner = engine_with(step_delay=0.02)
    requests = request_ids(eng)
    try:
        text = run(eng, "text", (1, 2, 3), (), max_tokens=40)
        images = [run(eng, f"img{i}", *prompt_with([f"IMG-{i}".encode(), f"IMG-{i}b".encode()])) for i in range(3)]
        await asyncio.gather(text, *images)
        assert all(sum(c.media is not None for c in plan.chunks) <= 1 for plan in runner.steps)
        with_image = [n for n, plan in enumerate(runner.steps) if plan.has_media]
        assert len(with_image) == 6  # three requests of two images each, one a step
        # and every one of those steps decoded the text stream too (it runs for 40 steps)
        assert all(any(requests[c.seq] == "text" for c in runner.steps[n].chunks) for n in with_image)
    finally:
        eng.stop()


async def test_the_prefix_cache_reuses_the_same_image_and_stops_before_another():
    eng, runner = engine_with()
    try:
        prompt, spans = prompt_with([b"IMG-red"], text=10)
        await run(eng, "a", prompt, spans)
        _, again = await run(eng, "b", prompt, spans)
        assert again.cached_tokens == len(prompt) - 1  # everything but the last token, the image included
        other, other_spans = prompt_with([b"IMG-blue"], text=10)
        _, final = await run(eng, "c", other, other_spans)
        assert final.cached_tokens == 10  # the text before the image only: another image is no match
        assert runner.encoded.count(spans[0].chunk.key) == 1
    finally:
        eng.stop()


async def test_a_cached_prefix_ending_inside_an_image_is_cut_back_to_its_start():
    eng, runner = engine_with(length=6)
    requests = request_ids(eng)
    try:
        prompt, spans = prompt_with([b"IMG-red"], text=5)
        # a first request whose prompt is the same up to the middle of the image (its cells then end there)
        half = GenerationRequest("a", prompt[:8], SamplingParams(max_tokens=1, temperature=0.0),
                                 media=(MediaSpan(5, MediaChunk(b"IMG-red", 0, 3, False, key=spans[0].chunk.key)),))
        async for _ in eng.generate(half):
            pass
        _, final = await run(eng, "b", prompt, spans)
        assert final.cached_tokens == 5
        last = media_chunks(runner)[-1]
        assert requests[last.seq] == "b" and last.offset == 0 and len(last.tokens) == 6
    finally:
        eng.stop()


async def test_an_image_that_fails_to_encode_fails_its_request_alone():
    eng, _ = engine_with()
    try:
        good = asyncio.ensure_future(run(eng, "good", *prompt_with([b"IMG-ok"]), max_tokens=8))
        with pytest.raises(Exception, match="scripted encoding failure"):
            await run(eng, "bad", *prompt_with([b"fail-this"]))
        tokens, final = await good
        assert len(tokens) == 8 and final.finish_reason is not None
    finally:
        eng.stop()
