"""The deployments config file: TOML and YAML, validation with the file's name, model sources, routing."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from servelm.__main__ import _serve_parser, settings_from_args
from servelm.config import ConfigFile, embedded_model_path, load_config_file
from servelm.errors import ModelNotFound
from servelm.models import resolve_model_source
from servelm.service.registry.deployments import Deployment, Deployments

TOML = """
[server]
port = 9123
max_num_seqs = 3

[[deployments]]
name = "a"
model = "smollm2-135m-instruct"
aliases = ["small", "gpt-4o-mini"]
[deployments.engine]
max_num_seqs = 2
context_window = 512
[deployments.limits]
max_waiting = 5

[[deployments]]
name = "b"
model = "smollm2"

[[endpoints]]
name = "ab"
routes = [{deployment = "a", weight = 3}, {deployment = "b", weight = 1}]
"""

YAML = """
deployments:
  - name: a
    model: smollm2-135m-instruct
    engine: {max_num_seqs: 2}
  - name: e
    model: all-minilm-l6-v2
    kind: embedding
endpoints:
  - name: ab
    routes: [{deployment: a}]
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_toml_and_yaml_files_declare_deployments(tmp_path):
    cfg = load_config_file(write(tmp_path, "d.toml", TOML))
    assert [d.name for d in cfg.deployments] == ["a", "b"]
    a = cfg.deployments[0]
    assert a.aliases == ["small", "gpt-4o-mini"] and a.engine.max_num_seqs == 2 and a.engine.context_window == 512
    assert a.limits.max_waiting == 5 and cfg.endpoints[0].routes[0].weight == 3
    cfg = load_config_file(write(tmp_path, "d.yaml", YAML))
    assert [(d.name, d.kind) for d in cfg.deployments] == [("a", "chat"), ("e", "embedding")]
    quantized = load_config_file(write(tmp_path, "q.toml", '[[deployments]]\nname = "a"\nmodel = "x"\n'
                                       '[deployments.engine]\nkv_cache_type = "q8_0"\n'))
    assert quantized.deployments[0].engine.kv_cache_type == "q8_0"  # per deployment


@pytest.mark.parametrize(("text", "words"), [
    ('[[deployments]]\nname = "a"\nmodel = "x"\n[[deployments]]\nname = "a"\nmodel = "y"\n', "declared twice"),
    ('[[deployments]]\nname = "a"\nmodel = "x"\n[[endpoints]]\nname = "e"\nroutes = [{deployment = "zz"}]\n',
     "not a deployment"),
    ('[[deployments]]\nname = "a"\nmodel = "x"\ncolour = "red"\n', "colour"),
    ('[[deployments]]\nname = "a"\nmodel = "x"\n[deployments.engine]\nmax_num_seqs = 0\n', "max_num_seqs"),
    ('[[deployments]]\nname = "a"\nmodel = "x"\n[deployments.engine]\nkv_cache_type = "q2"\n', "kv_cache_type"),
    ("[[deployments]\n", "not valid TOML"),
    ('[[mcp_servers]]\nlabel = "a"\nurl = "http://127.0.0.1:1/mcp"\n[[mcp_servers]]\nlabel = "a"\ncommand = "x"\n',
     "declared twice"),
    ('[[mcp_servers]]\nlabel = "a"\nurl = "http://127.0.0.1:1/mcp"\ncommand = "x"\n', "either url"),
    ('[[mcp_servers]]\nlabel = "a"\n', "either url"),
    ('[[mcp_servers]]\nlabel = "a"\nurl = "file:///etc/passwd"\n', "must be http"),
    ('[[mcp_servers]]\nlabel = "a b"\ncommand = "x"\n', "label"),
])
def test_a_bad_file_names_itself_and_the_problem(tmp_path, text, words):
    path = write(tmp_path, "bad.toml", text)
    with pytest.raises(ValueError) as exc:
        load_config_file(path)
    assert "bad.toml" in str(exc.value) and words in str(exc.value)


def test_model_sources(tmp_path):
    assert resolve_model_source("smollm2-135m-instruct", "chat") == embedded_model_path()
    with pytest.raises(FileNotFoundError):
        resolve_model_source(str(tmp_path / "missing.gguf"), "chat")
    with pytest.raises(ValueError):
        resolve_model_source("not a model", "chat")


def test_flags_win_over_the_files_server_table(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    path = write(tmp_path, "d.toml", TOML)
    args = parser.parse_args(["serve", "--config", str(path), "--host", "0.0.0.0"])
    del args.verbose_llama, args.command
    s = settings_from_args(args)
    assert s.port == 9123 and s.host == "0.0.0.0" and s.engine.max_num_seqs == 3


def _dep(name: str) -> Deployment:
    return Deployment(name=name, context_window=1, fingerprint="fp")


def test_names_aliases_and_weighted_endpoints_route():
    deps = Deployments([_dep("a"), _dep("b")], aliases={"small": "a"},
                       endpoints={"ab": [("a", 3.0), ("b", 1.0)]}, rng=random.Random(0))
    assert deps.get("a").name == "a" and deps.get("small").name == "a"
    picks = [deps.get("ab").name for _ in range(4000)]
    assert 0.7 < picks.count("a") / len(picks) < 0.8, "a 3:1 split"
    with pytest.raises(ModelNotFound):
        deps.get("c")
    assert [n for n, _ in deps.model_ids()] == ["a", "b", "small", "ab"]
    assert ConfigFile().deployments == []


def test_a_deployment_may_load_on_demand(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[[deployments]]\nname = "later"\nmodel = "smollm2-135m-instruct"\nload = "on-demand"\n'
                    '[[deployments]]\nname = "now"\nmodel = "smollm2-135m-instruct"\n')
    later, now = load_config_file(path).deployments
    assert (later.load, now.load) == ("on-demand", "start")
    path.write_text('[[deployments]]\nname = "x"\nmodel = "smollm2-135m-instruct"\nload = "lazily"\n')
    with pytest.raises(ValueError, match="load"):
        load_config_file(path)
