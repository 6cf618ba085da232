"""A deployment's name is the operator's, but every answer names it in a header: one outside Latin-1 (HTTP headers
are Latin-1) must not turn every generating route into a 500."""

from __future__ import annotations

import json
from urllib.parse import unquote

import httpx
import pytest
from pydantic import ValidationError

from servelm.config import EngineSettings, ServerSettings, embedded_model_path, load_config_file
from servelm.fleet import scan_models_dir
from servelm.http.routes import deployment_header

NAME = "модель-1 🙂 100%"


def test_a_deployment_named_outside_latin1_answers_and_its_header_is_percent_encoded(fake_server_factory):
    server = fake_server_factory(extra_deployments=(NAME,))
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for path, body in (("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "stream": True}),
                       ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 3, "stream": True})):
        r = httpx.post(server.base_url + path, json=body, timeout=20)
        assert r.status_code == 200, r.text
        header = r.headers["x-servelm-deployment"]
        assert header.isascii() and unquote(header) == NAME
    plain = httpx.post(server.base_url + "/v1/chat/completions", json={**chat, "model": "fake-model"}, timeout=20)
    assert plain.headers["x-servelm-deployment"] == "fake-model"  # an ordinary name is left as it is



def test_the_header_embeddings_and_rerank_send_encodes_the_same_way():
    header = deployment_header(NAME)["x-servelm-deployment"]
    assert header.isascii() and unquote(header) == NAME
    assert deployment_header("a/b:c d")["x-servelm-deployment"] == "a/b:c d"


@pytest.mark.parametrize("name", ["a\nb", "nul\x00", "tab\tname", "line\u2028sep"])
def test_a_model_id_with_a_control_character_or_line_break_is_refused_at_start(tmp_path, name):
    with pytest.raises(ValidationError, match="printable"):
        ServerSettings(model_id=name)
    with pytest.raises(ValidationError, match="printable"):
        ServerSettings(embedding_model_id=name)
    path = tmp_path / "bad.toml"
    path.write_text(f'[[deployments]]\nname = {json.dumps(name)}\nmodel = "x"\n')
    with pytest.raises(ValueError, match="printable"):
        load_config_file(path)
    path.write_text(f'[[deployments]]\nname = "a"\nmodel = "x"\naliases = [{json.dumps(name)}]\n')
    with pytest.raises(ValueError, match="printable"):
        load_config_file(path)
    assert ServerSettings(model_id=NAME).model_id == NAME  # printable beyond ASCII is a name like any other


def test_a_models_dir_file_named_with_a_line_break_is_listed_as_failed_not_served(tmp_path):
    good = tmp_path / "fine.gguf"
    good.write_bytes(embedded_model_path().read_bytes()[:4096])  # its header is enough to be listed
    (tmp_path / "bad\nname.gguf").write_bytes(good.read_bytes())
    specs, failed = scan_models_dir(tmp_path, EngineSettings())
    assert [s.name for s in specs] == ["fine"]
    assert "printable" in failed["bad\nname"]
