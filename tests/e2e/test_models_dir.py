"""Models that come and go (issue 36) on the real models, through the official client: a server started with only
--models-dir serves SmolLM2 and Gemma 3 270M from it, loads each when a request names it, evicts the least recently
used past --models-max, loads and unloads by route with an admin key, and a model unloaded and woken again answers
a resumed conversation from its prefix cache on disk, the same answer."""

from __future__ import annotations

import httpx
import openai
import pytest

from servelm.config import embedded_model_path, gemma_model_path

from . import ray_mode
from .conftest import own_server
from .helpers import client_for

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(ray_mode.ENABLED, reason="under --ray: tests/ray/test_runtime_models.py")]

HISTORY = "The harbour records list every ship that came in, with its cargo, its captain and the weather. " * 40
LONG = [{"role": "system", "content": HISTORY}, {"role": "user", "content": "Which ship came in first?"}]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("models")
    (directory / "smol.gguf").symlink_to(embedded_model_path())
    (directory / "gemma.gguf").symlink_to(gemma_model_path())
    (directory / "gemma.toml").write_text("embedding_window = 0\n[engine]\nmax_num_seqs = 4\n")
    return directory


def statuses(base_url: str, key: str = "none") -> dict[str, str]:
    with client_for(base_url, key) as client:
        cards = client.models.list().data
    return {c.id: c.model_extra["status"]["value"] for c in cards}


@pytest.mark.slow
def test_only_a_models_dir_serves_its_models_on_demand_with_lru_and_admin_routes(models_dir, tmp_path_factory):
    with own_server(tmp_path_factory, "--models-dir", str(models_dir), "--models-max", "1", "--api-key", "sk-user",
                    "--admin-key", "sk-admin", "--idle-unload-s", "-1") as srv, \
            client_for(srv.base_url, "sk-user") as user:  # closed before its server stops
        assert statuses(srv.base_url, "sk-user") == {"smol": "unloaded", "gemma": "unloaded"}
        smol = user.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=8, temperature=0)
        assert smol.choices[0].message.content and smol.model == "smol"
        assert statuses(srv.base_url, "sk-user") == {"smol": "loaded", "gemma": "unloaded"}
        gemma = user.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "Say hi."}],
                                             max_tokens=8, temperature=0)
        assert gemma.choices[0].message.content and gemma.model == "gemma"
        assert statuses(srv.base_url, "sk-user") == {"smol": "unloaded", "gemma": "loaded"}  # LRU at --models-max 1

        def post(path: str, key: str) -> httpx.Response:
            return httpx.post(f"{srv.base_url}{path}", json={"model": "smol"}, timeout=120,
                              headers={"Authorization": f"Bearer {key}"})

        assert post("/models/load", "sk-user").status_code == 403
        assert post("/models/load", "sk-admin").json()["status"] == {"value": "loaded"}
        assert statuses(srv.base_url, "sk-admin") == {"smol": "loaded", "gemma": "unloaded"}
        again = user.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hi."}],
                                             max_tokens=8, temperature=0)
        assert again.choices[0].message.content == smol.choices[0].message.content
        assert post("/models/unload", "sk-admin").json()["status"] == {"value": "unloaded"}
        with pytest.raises(openai.NotFoundError):
            user.chat.completions.create(model="nothing-here", messages=[{"role": "user", "content": "x"}])
        metrics = httpx.get(f"{srv.base_url}/metrics").status_code  # keys on: /metrics is a monitor key's
        assert metrics == 401
        log = srv.log_path.read_text()
    assert "loaded 'smol'" in log and "unloaded 'smol' (evicted)" in log


def test_a_model_woken_from_disk_answers_a_resumed_conversation_warm(models_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("prefix-cache")
    with own_server(tmp_path_factory, "--models-dir", str(models_dir), "--prefix-cache-dir", str(cache)) as srv:
        client = client_for(srv.base_url)
        first = client.chat.completions.create(model="smol", messages=LONG, max_tokens=12, temperature=0)
        r = httpx.post(f"{srv.base_url}/models/unload", json={"model": "smol"}, timeout=120)
        assert r.json()["status"] == {"value": "unloaded"}
        assert list((cache / "smol").glob("*.kvstate")), "the unload wrote its prefix cache to disk"
        woken = client.chat.completions.create(model="smol", messages=LONG, max_tokens=12, temperature=0)
        follow = client.chat.completions.create(
            model="smol", max_tokens=12, temperature=0,
            messages=[*LONG, {"role": "assistant", "content": woken.choices[0].message.content},
                      {"role": "user", "content": "And the second?"}])
    assert first.usage.prompt_tokens > 800
    assert woken.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1, "read from disk"
    assert woken.choices[0].message.content == first.choices[0].message.content
    # the next turn reuses the woken entry's whole tiles of 64 (the rest was read in rows: docs/exactness.md)
    assert follow.usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens - 2) // 64 * 64
