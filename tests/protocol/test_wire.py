"""Wire shapes: what a request body may hold, and how an answer is written."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from servelm.protocol.chat import ChatCompletionRequest, ChatMessageOut, FunctionCallOut, ToolCallOut

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("extra", [{"frobnicate": 1}, {"temperature": "0.5"}, {"temperature": float("nan")},
                                   {"seed": 2**64}, {"modalities": ["video"]}, {"metadata": {"k": 1}}])
def test_a_body_is_strict(extra):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**BASE, **extra})


def test_annotations_and_the_deprecated_functions_are_fields():
    req = ChatCompletionRequest.model_validate({
        **BASE, "store": True, "metadata": {"a": "b"}, "service_tier": "auto", "prompt_cache_key": "k",
        "safety_identifier": "s", "verbosity": "low", "modalities": ["text"], "reasoning_effort": "minimal",
        "functions": [{"name": "f"}], "function_call": {"name": "f"}, "seed": -(2**63)})
    assert req.functions[0].name == "f" and req.function_call.name == "f"


def test_an_answer_has_refusal_and_no_null_calls():
    assert ChatMessageOut(content="x").model_dump(mode="json") == {"role": "assistant", "content": "x", "refusal": None}
    call = ToolCallOut(id="c", function=FunctionCallOut(name="f", arguments="{}"))
    dumped = ChatMessageOut(tool_calls=[call]).model_dump(mode="json")
    assert dumped["tool_calls"][0]["function"]["name"] == "f" and "function_call" not in dumped
