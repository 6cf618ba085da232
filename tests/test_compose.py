"""compose's one assembly path: the Plan every entry point reads once, and deployments built whole."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from servelm.compose import Builder, DeploymentOptions, Plan, build_deployment
from servelm.config import DEFAULT_MODEL_ID, ServerSettings
from servelm.runners.fake import FakeRunner


def settings(tmp_path: Path, config: str | None = None, **kw) -> ServerSettings:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    if config is not None:
        (tmp_path / "c.toml").write_text(config.replace("MODEL", str(model)))
        kw["config"] = tmp_path / "c.toml"
    return ServerSettings(model_path=kw.pop("model_path", model), embedding_model=False, **kw)


CONFIG = """
[[keys]]
key = "sk-from-file"

[[deployments]]
name = "a"
model = "MODEL"

[[deployments]]
name = "b"
model = "MODEL"
load = "on-demand"

[[endpoints]]
name = "ab"
routes = [{deployment = "a"}]
"""


def test_the_config_file_is_split_into_deployments_at_start_and_on_demand(tmp_path):
    plan = Plan.read(settings(tmp_path, CONFIG))
    assert [s.name for s in plan.specs] == ["a"] and [s.name for s in plan.on_demand] == ["b"]
    assert [e.name for e in plan.endpoints] == ["ab"] and len(plan.keys) == 1


def test_servelm_batch_loads_every_deployment_at_start_and_reads_no_keys(tmp_path):
    plan = Plan.read(settings(tmp_path, CONFIG), serving=False)
    assert [s.name for s in plan.specs] == ["a", "b"] and plan.on_demand == () and plan.keys == ()


def test_without_a_config_the_command_line_model_is_served(tmp_path):
    plan = Plan.read(settings(tmp_path, model_id="mine"))
    assert [(s.name, s.kind) for s in plan.specs] == [("mine", "chat")] and plan.on_demand == ()


def test_with_only_a_models_dir_its_models_are_all_a_server_has(tmp_path):
    s = settings(tmp_path, model_path=None, models_dir=tmp_path)
    assert Plan.read(s).specs == ()


def test_the_blocklist_reaches_every_chat_deployment_of_the_plan_and_the_builder(tmp_path):
    words = tmp_path / "words.txt"
    words.write_text("bad\n")
    plan = Plan.read(settings(tmp_path, CONFIG, content_blocklist=words))
    assert all(s.content_filter is not None and s.content_filter.blocklist == [words]
               for s in (*plan.specs, *plan.on_demand))
    assert plan.builder() == Builder(False, plan.builder().images, words, plan.settings.self_check_dir())


def test_the_plan_and_its_settings_are_frozen(tmp_path):
    plan = Plan.read(settings(tmp_path))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.specs = ()  # type: ignore[misc]
    with pytest.raises(ValueError, match="frozen"):
        plan.settings.port = 1
    with pytest.raises(ValueError, match="frozen"):
        plan.specs[0].engine.max_num_seqs = 1


def test_a_deployment_is_built_whole_and_never_changed():
    deployment, _ = build_deployment("m", FakeRunner(), DeploymentOptions(max_waiting=3, min_priority=-2))
    assert (deployment.max_waiting, deployment.min_priority, deployment.adapters is not None) == (3, -2, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        deployment.max_waiting = 4  # type: ignore[misc]


def test_a_model_file_is_served_under_its_own_name_unless_given_one(tmp_path):
    """/v1/models must not name the embedded model for another file: without --model-id, a --model-path file is
    served under its file's name (as the reranker is), and the embedded model under its own."""
    assert [s.name for s in Plan.read(settings(tmp_path)).specs] == ["m"]
    assert [s.name for s in Plan.read(settings(tmp_path, model_id="mine")).specs] == ["mine"]
    embedded = ServerSettings(embedding_model=False)
    assert [s.name for s in Plan.read(embedded).specs] == [DEFAULT_MODEL_ID]
