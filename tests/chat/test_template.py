"""Which chat template a deployment gets (compose.template_of) and how the built-in one renders: the model file's,
else llama.cpp's built-in one for its architecture, else ChatML, whose end marker then stops answers (issue 31:
a model without <|im_end|> in its vocabulary wrote it as text and went on)."""

from __future__ import annotations

import logging

import pytest

from servelm.chat.template import CHATML_END, BuiltinTemplate, TemplateError
from servelm.compose import DeploymentOptions, build_deployment
from servelm.engine.types import SamplingParams
from servelm.protocol.chat import ChatCompletionRequest
from servelm.runners.fake import FakeModel, FakeRunner
from servelm.service.params import EndpointParams, sampling_params


class _Builtin(FakeModel):
    def builtin_template(self) -> str | None:
        return "turns"

    def apply_builtin_template(self, name, messages, add_generation_prompt):
        return "".join(f"[{r}]{t}" for r, t in messages) + ("[model]" if add_generation_prompt else "")


def _params(dep) -> SamplingParams:
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stop=["x"])
    return sampling_params(req, dep, 3, EndpointParams(max_tokens=4, prompt_param="messages"))


def test_the_model_files_template_is_used_as_it_is():
    dep, _ = build_deployment("m", FakeRunner())
    assert dep.template.origin == "gguf" and dep.template_stops == ()
    assert _params(dep).stop == ("x",)


def test_without_one_llama_cpps_built_in_template_for_the_architecture_renders(caplog):
    runner = FakeRunner(model=_Builtin())
    runner.model.chat_template = None
    with caplog.at_level(logging.WARNING):
        dep, _ = build_deployment("m", runner)
    assert dep.template.origin == "builtin:turns" and dep.template_stops == ()
    assert "built-in 'turns' template" in caplog.text
    text = dep.template.render([{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "q"}]},
                                {"role": "assistant", "content": None, "tool_calls": [{}]},
                                {"role": "tool", "content": "r"}])
    assert text == "[system]s[user]q[assistant][user]r[model]"


def test_with_neither_chatml_is_used_and_its_end_marker_stops_every_answer(caplog):
    runner = FakeRunner()
    runner.model.chat_template = None
    with caplog.at_level(logging.WARNING):
        dep, _ = build_deployment("m", runner)
    assert dep.template.origin == "fallback" and "using ChatML" in caplog.text
    assert dep.template_stops == (CHATML_END,)
    assert _params(dep).stop == ("x", CHATML_END)


def test_a_template_file_wins_over_the_model_files():
    dep, _ = build_deployment("m", FakeRunner(), DeploymentOptions(chat_template="{{ messages[0]['content'] }}"))
    assert dep.template.origin == "file" and dep.template.render([{"role": "user", "content": "q"}]) == "q"


def test_a_built_in_template_that_fails_is_a_template_error():
    def refuse(name, messages, add):
        raise ValueError("no")

    with pytest.raises(TemplateError):
        BuiltinTemplate("x", refuse).render([{"role": "user", "content": "q"}])
