"""Attacks on the self-check's memory (runners/selfcheck.CheckMemo, `--self-check-cache`): a file there that is
corrupt, foreign, huge, of another key or not a file, or a directory that cannot be written, never makes a start
take a finding it did not check, never crashes it, and is replaced by the next check's finding."""

from __future__ import annotations

import json

import pytest

from servelm.config import ServerSettings, embedded_model_path
from servelm.runners import llamacpp


@pytest.fixture
def checks(monkeypatch):
    calls: list[int] = []

    def check(runner) -> str:
        calls.append(1)
        return ""

    monkeypatch.setattr(llamacpp, "check_exactness", check)
    return calls


def _load(memo_dir):
    runner = llamacpp.load_exact(embedded_model_path(), memo_dir=memo_dir, num_slots=2, context_window=256)
    try:
        return runner.exactness
    finally:
        runner.close()


def _kept(memo_dir):
    files = list(memo_dir.glob("*.json"))
    assert len(files) == 1, files
    return files[0]


@pytest.mark.parametrize("spoil", ["garbage", "empty", "json list", "other key", "a bool for the fence",
                                   "missing field", "fence past the list", "huge", "a directory"])
def test_a_spoiled_finding_is_checked_again_and_replaced(checks, tmp_path, spoil) -> None:
    assert _load(tmp_path).exact and len(checks) == 1
    path = _kept(tmp_path)
    good = json.loads(path.read_text())
    if spoil == "garbage":
        path.write_bytes(b"\x00\xff{not json")
    elif spoil == "empty":
        path.write_bytes(b"")
    elif spoil == "json list":
        path.write_text("[1, 2]")
    elif spoil == "other key":
        path.write_text(json.dumps({**good, "key": "0" * 64}))
    elif spoil == "a bool for the fence":
        path.write_text(json.dumps({**good, "fence": True}))
    elif spoil == "missing field":
        path.write_text(json.dumps({k: v for k, v in good.items() if k != "reason"}))
    elif spoil == "fence past the list":
        path.write_text(json.dumps({**good, "fence": 10_000}))
    elif spoil == "huge":
        path.write_text(json.dumps({**good, "reason": "x" * (1 << 20)}))
    elif spoil == "a directory":
        path.unlink()
        path.mkdir()
    exactness = _load(tmp_path)
    assert len(checks) == 2, "a spoiled finding was taken without a check"
    assert exactness.exact
    if spoil != "a directory":
        assert json.loads(path.read_text()) | {"checked_at": 0} == good | {"checked_at": 0}, "not replaced"


def test_a_directory_that_cannot_be_written_leaves_every_start_checking(checks, tmp_path, caplog) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    assert _load(blocked / "selfcheck").exact and _load(blocked / "selfcheck").exact
    assert len(checks) == 2
    assert blocked.read_text() == "not a directory"
    assert "could not be kept" in caplog.text


def test_the_setting_names_the_directory_and_off_keeps_none(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ServerSettings().self_check_dir() == tmp_path / "servelm" / "selfcheck"
    assert ServerSettings(self_check_cache=False).self_check_dir() is None
