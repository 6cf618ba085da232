"""The playground at / in a real browser: Debian's headless Chromium, driven by Selenium through its chromedriver,
against the real model. Each test saves a screenshot under test-artifacts/ (SERVELM_ARTIFACTS overrides)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait

from .conftest import REPO_ROOT, own_server
from .helpers import MODEL, wait_idle

ARTIFACTS = Path(os.environ.get("SERVELM_ARTIFACTS") or REPO_ROOT / "test-artifacts")
KEY = "sk-playground-e2e"
SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
          "required": ["colour"], "additionalProperties": False}


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "Debian's chromium and chromium-driver are missing: `make install` installs them"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,860"):
        options.add_argument(flag)
    b = webdriver.Chrome(service=Service(driver), options=options)  # both paths given: nothing is downloaded
    b.set_page_load_timeout(30)
    try:
        yield b
    finally:
        b.quit()


def until(b: WebDriver, condition: Callable[[WebDriver], Any], timeout: float = 60.0) -> Any:
    return WebDriverWait(b, timeout, poll_frequency=0.05).until(condition)


def shot(b: WebDriver, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    b.save_screenshot(str(ARTIFACTS / f"playground-{name}.png"))


def open_page(b: WebDriver, base_url: str) -> None:
    b.get(base_url + "/")
    b.execute_script("sessionStorage.clear()")
    b.get(base_url + "/")


def set_field(b: WebDriver, field: str, value: str) -> None:
    el = b.find_element(By.ID, field)
    el.clear()
    if value:
        el.send_keys(value)


def count_updates(b: WebDriver) -> None:
    """Count the times the last answer's text changes (each streamed chunk is one)."""
    b.execute_script("""
        window.updates = 0;
        new MutationObserver(() => { window.updates += 1; })
          .observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    """)


def answers(b: WebDriver) -> list[str]:
    return [e.text for e in b.find_elements(By.CSS_SELECTOR, ".msg.assistant .text")]


def stats(b: WebDriver) -> list[str]:
    return [e.text for e in b.find_elements(By.CSS_SELECTOR, ".stats")]


def send(b: WebDriver, text: str) -> None:
    b.find_element(By.ID, "input").send_keys(text)
    b.find_element(By.ID, "send").click()


def test_a_message_streams_in_with_timings_and_usage(browser: WebDriver, base_url: str) -> None:
    open_page(browser, base_url)
    until(browser, lambda b: MODEL in [o.text for o in Select(b.find_element(By.ID, "model")).options])
    set_field(browser, "system", "You are a terse assistant.")
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "48")
    set_field(browser, "seed", "7")
    count_updates(browser)
    send(browser, "Name three colours of the rainbow.")
    until(browser, lambda b: len(stats(b)) == 1)
    reply = answers(browser)[-1]
    assert reply.strip()
    assert browser.execute_script("return window.updates") > 3  # it came in pieces, not at once
    line = stats(browser)[-1]
    assert "first token" in line and "tokens/s" in line and "finish: " in line
    assert "prompt" in line and "completion" in line  # the stream's usage
    shot(browser, "chat")
    # the same question at temperature 0 answers the same through the API: the page sent what it showed
    body = {"model": MODEL, "max_tokens": 48, "temperature": 0, "top_p": 1, "seed": 7,
            "messages": [{"role": "system", "content": "You are a terse assistant."},
                         {"role": "user", "content": "Name three colours of the rainbow."}]}
    direct = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60).json()
    assert direct["choices"][0]["message"]["content"].strip() == reply.strip()
    # a second turn carries the first: the conversation grows
    send(browser, "And one more?")
    until(browser, lambda b: len(stats(b)) == 2)
    assert len(answers(browser)) == 2


def test_stop_ends_a_stream_and_frees_the_server(browser: WebDriver, base_url: str) -> None:
    open_page(browser, base_url)
    until(browser, lambda b: Select(b.find_element(By.ID, "model")).options)
    set_field(browser, "max_tokens", "1500")
    set_field(browser, "temperature", "1")
    send(browser, "Write a very long story about a lighthouse keeper, chapter by chapter.")
    until(browser, lambda b: answers(b) and len(answers(b)[-1]) > 20)
    browser.find_element(By.ID, "stop").click()
    until(browser, lambda b: stats(b))
    assert "finish: stopped" in stats(browser)[-1]
    assert browser.find_element(By.ID, "send").is_enabled() and not browser.find_element(By.ID, "stop").is_enabled()
    shown = answers(browser)[-1]
    time.sleep(0.5)
    assert answers(browser)[-1] == shown  # nothing more arrives after stop
    idle, seen = wait_idle(base_url, 10.0)
    assert idle, f"the stopped request still runs: {seen}"
    shot(browser, "stopped")


def test_a_schema_gives_json_that_follows_it(browser: WebDriver, base_url: str) -> None:
    open_page(browser, base_url)
    until(browser, lambda b: Select(b.find_element(By.ID, "model")).options)
    set_field(browser, "max_tokens", "40")
    set_field(browser, "temperature", "0.7")
    set_field(browser, "schema", json.dumps(SCHEMA))
    send(browser, "Pick a colour.")
    until(browser, lambda b: stats(b))
    value = json.loads(answers(browser)[-1])
    assert value["colour"] in ("red", "green", "blue") and set(value) == {"colour"}
    assert "finish: stop" in stats(browser)[-1]
    shot(browser, "schema")
    set_field(browser, "schema", "{not json")
    send(browser, "Again.")
    until(browser, lambda b: b.find_element(By.ID, "error").is_displayed())
    assert "not valid JSON" in browser.find_element(By.ID, "error").text
    assert len(answers(browser)) == 1  # nothing was sent


def test_with_keys_the_page_asks_for_one_and_reveals_nothing(browser: WebDriver, tmp_path_factory) -> None:
    with own_server(tmp_path_factory, "--api-key", KEY, "--no-embedding-model") as srv:
        page = httpx.get(srv.base_url + "/", timeout=10)
        assert page.status_code == 200 and KEY not in page.text  # open, and it holds no key
        assert httpx.get(srv.base_url + "/v1/models", timeout=10).status_code == 401
        open_page(browser, srv.base_url)
        until(browser, lambda b: b.find_element(By.ID, "keybox").is_displayed())
        browser.find_element(By.ID, "apikey").send_keys("sk-wrong")
        browser.find_element(By.ID, "savekey").click()
        until(browser, lambda b: "not accepted" in b.find_element(By.ID, "keyerror").text)
        browser.find_element(By.ID, "apikey").send_keys(KEY)
        browser.find_element(By.ID, "savekey").click()
        until(browser, lambda b: MODEL in [o.text for o in Select(b.find_element(By.ID, "model")).options])
        assert not browser.find_element(By.ID, "keybox").is_displayed()
        assert KEY not in browser.page_source  # the key field is emptied; the key lives in the tab's storage only
        set_field(browser, "max_tokens", "8")
        send(browser, "Hello.")
        until(browser, lambda b: stats(b))
        assert answers(browser)[-1].strip() and not browser.find_element(By.ID, "error").is_displayed()
        shot(browser, "keys")
