"""What an image costs the other streams: text streams' inter-token latency (ITL) with and without image requests
arriving beside them, on a server started with a vision projector.

    .venv/bin/python scripts/make_test_projector.py /tmp/proj256.gguf --side 16   # an image = 256 positions
    .venv/bin/servelm serve --mmproj /tmp/proj256.gguf --no-embedding-model &
    .venv/bin/python -m harness.images --url http://127.0.0.1:8000 --streams 4 --images 8

The text streams each write `--tokens` tokens (end of text banned); in the second run, `--images` image requests
(one at a time, back to back) run beside them. It prints ITL p50/p99/max of the text streams for both runs and the
image requests' latency. An image is read as one chunk a step at most, so the others' ITL grows by one image
decode (and its encode, the step it is first read) per image, not more.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import time

import httpx

MODEL = "smollm2-135m-instruct"


def _png(rgb: tuple[int, int, int], size: int = 64) -> bytes:
    import struct
    import zlib

    raw = b"".join(b"\x00" + bytes(rgb) * size for _ in range(size))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


async def _stream(client: httpx.AsyncClient, url: str, tokens: int, gaps: list[float]) -> None:
    body = {"model": MODEL, "stream": True, "max_tokens": tokens, "temperature": 0, "logit_bias": {"0": -100, "2": -100},
            "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}]}
    last = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if json.loads(line[6:])["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now


async def _images(client: httpx.AsyncClient, url: str, count: int, latencies: list[float]) -> None:
    for i in range(count):
        rgb = (255, (37 * i) % 256, (91 * i) % 256)  # a different image each time: no cache hit
        image = "data:image/png;base64," + base64.b64encode(_png(rgb)).decode()
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What colour?"}]}]}
        start = time.perf_counter()
        r = await client.post(url + "/v1/chat/completions", json=body)
        r.raise_for_status()
        latencies.append(time.perf_counter() - start)


def _summary(gaps: list[float]) -> str:
    ms = sorted(g * 1000 for g in gaps)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"ITL p50 {statistics.median(ms):.1f} ms, p99 {p99:.1f} ms, max {ms[-1]:.1f} ms ({len(ms)} gaps)"


async def main(url: str, streams: int, tokens: int, images: int) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        for label, n in (("text alone", 0), (f"beside {images} image requests", images)):
            gaps: list[float] = []
            latencies: list[float] = []
            jobs = [_stream(client, url, tokens, gaps) for _ in range(streams)]
            if n:
                jobs.append(_images(client, url, n, latencies))
            await asyncio.gather(*jobs)
            extra = f"; image request latency median {statistics.median(latencies) * 1000:.0f} ms" if latencies else ""
            print(f"{streams} text streams, {label}: {_summary(gaps)}{extra}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--images", type=int, default=8)
    args = ap.parse_args()
    asyncio.run(main(args.url.rstrip("/"), args.streams, args.tokens, args.images))
