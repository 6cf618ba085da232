"""Image parts over HTTP on the fake model with its fake projector (bytes beginning with b"IMG" are an image of 6
positions between the marker tokens "[" and "]"): where image bytes may come from, every bad image a 4xx naming
its part, and the routes that take images (chat, Azure, /v3, DJL's /invocations, Responses, Messages)."""

from __future__ import annotations

import base64
import http.server
import threading
import time

import httpx
import pytest

from servelm.runners.fake import FakeProjector
from servelm.service.media import ImageSources

IMG = b"IMG-some-pixels"


def data_url(data: bytes = IMG) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def ask(url: str, text: str = "what is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url, "detail": "low"}}]}]


@pytest.fixture
def vision(fake_server_factory):
    return fake_server_factory(projector=FakeProjector(), prefix_cache=True)


def chat(server, messages, path="/v1/chat/completions", **extra):
    body = {"model": server.model, "messages": messages, "max_tokens": 3, "temperature": 0, **extra}
    return httpx.post(server.base_url + path, json=body, timeout=30)


def test_a_data_url_image_is_read_and_counted(vision, fake_server):
    r = chat(vision, ask(data_url()))
    assert r.status_code == 200, r.text
    text_only = chat(fake_server, [{"role": "user", "content": "what is this?\n"}]).json()["usage"]["prompt_tokens"]
    # the same prompt with the image's 2 marker tokens and 6 positions in place of its mark
    assert r.json()["usage"]["prompt_tokens"] == text_only + 8
    assert vision.runner.encoded  # the engine encoded it


def test_every_route_that_takes_chat_messages_takes_images(vision):
    for path in ("/v1/chat/completions", "/v3/chat/completions", "/chat/completions?api-version=2024-05-01-preview"):
        assert chat(vision, ask(data_url()), path).status_code == 200, path
    raw = base64.b64encode(IMG).decode()  # DJL LMI's url: base64 without a data: prefix
    r = httpx.post(vision.base_url + "/invocations", json={"messages": ask(raw), "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(vision.base_url + "/v1/responses", json={"model": vision.model, "max_output_tokens": 3, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "what?"},
                                     {"type": "input_image", "image_url": data_url(), "detail": "auto"}]}]}, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(vision.base_url + "/v1/messages", json={"model": vision.model, "max_tokens": 3, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                   "data": raw}},
                                     {"type": "text", "text": "what?"}]}]}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] + r.json()["usage"].get("cache_read_input_tokens", 0) > 8


def test_the_same_image_again_is_read_from_the_prefix_cache(vision):
    messages = ask(data_url(), "a question long enough to be worth caching, with an image after it")
    first = chat(vision, messages).json()["usage"]
    second = chat(vision, messages).json()["usage"]
    assert second["prompt_tokens_details"]["cached_tokens"] == first["prompt_tokens"] - 1


@pytest.mark.parametrize(("url", "code"), [
    ("data:image/png;base64,@@notbase64@@", "invalid_image"),
    ("data:image/png,rawpixels", "invalid_image"),
    (data_url(b"GIF-but-not-an-image"), "invalid_image"),
    ("data:image/png;base64,", "invalid_image"),
    ("ftp://example.com/a.png", "invalid_image"),
    ("https://example.com/a.png", "invalid_image"),  # not an allowed domain
])
def test_a_bad_image_is_a_400_that_names_its_part(vision, url, code):
    r = chat(vision, [{"role": "system", "content": "Be brief."}, *ask(url)])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[1].content[1]" and err["code"] == code


def test_an_image_over_the_size_limit_is_a_400(fake_server_factory):
    server = fake_server_factory(projector=FakeProjector(), image_sources=ImageSources(max_bytes=1024))
    r = chat(server, ask(data_url(IMG + b"x" * 2000)))
    assert r.status_code == 400 and r.json()["error"]["code"] == "image_too_large"
    assert r.json()["error"]["param"] == "messages[0].content[1]"


def test_prompt_logprobs_of_a_prompt_with_an_image_is_a_400(vision):
    r = chat(vision, ask(data_url()), prompt_logprobs=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_models_say_which_reads_images(vision, fake_server):
    card = httpx.get(vision.base_url + "/v1/models").json()["data"][0]
    assert card["modalities"] == {"vision": True, "audio": False}
    assert httpx.get(fake_server.base_url + "/v1/models").json()["data"][0]["modalities"]["vision"] is False


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/img.png":
            self.send_response(200)
            self.send_header("Content-Length", str(len(IMG)))
            self.end_headers()
            self.wfile.write(IMG)
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "https://example.com/img.png")
            self.end_headers()
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def image_host():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()  # its listening socket: left to the collector it is a ResourceWarning


def test_http_images_are_fetched_from_allowed_domains_only(fake_server_factory, image_host):
    server = fake_server_factory(projector=FakeProjector(), image_sources=ImageSources(allowed_domains=("127.0.0.1",)))
    assert chat(server, ask(f"{image_host}/img.png")).status_code == 200
    for path in ("/missing.png", "/moved"):  # a 404 there; a redirect (it could leave the allowed domains)
        r = chat(server, ask(f"{image_host}{path}"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1]", path
    start = time.monotonic()
    r = chat(server, ask("http://127.0.0.1:9/unreachable.png"))  # the discard port: nothing listens
    assert r.status_code == 400 and time.monotonic() - start < 5
