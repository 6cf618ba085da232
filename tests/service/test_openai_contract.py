"""The contract's rules that live in the services, unit by unit: closed tool schemas, each call once, tool answers
checked as OpenAI checks them, the deprecated functions as tools, and true logprobs for scoring."""

from __future__ import annotations

import pytest

from servelm.chat.tools import HERMES, parse_tool_calls
from servelm.engine.types import TokenLogprob
from servelm.errors import InvalidParameter
from servelm.protocol.chat import ChatCompletionRequest
from servelm.service.chat import ToolCallStream, check_tool_answers, from_functions
from servelm.service.logprobs import UNLIKELY, legacy_logprobs, vllm_prompt_logprobs
from servelm.service.structured import closed


def test_objects_that_list_properties_are_closed_unless_they_allow_more():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "string"}}},
        "b": {"type": "array", "items": {"type": "object", "properties": {"y": {}}}},
        "open": {"type": "object", "properties": {"z": {}}, "additionalProperties": True},
        "typed": {"type": "object", "properties": {}, "additionalProperties": {"type": "number"}},
        "properties": {"type": "object", "properties": {"w": {}}},  # a property named "properties"
    }, "$defs": {"d": {"properties": {"q": {}}}}, "anyOf": [{"properties": {"r": {}}}]}
    out = closed(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["a"]["additionalProperties"] is False
    assert props["b"]["items"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True and props["typed"]["additionalProperties"] == {"type": "number"}
    assert props["properties"]["additionalProperties"] is False and "additionalProperties" not in props
    assert out["$defs"]["d"]["additionalProperties"] is False and out["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema, "the request's own schema is left as it was"
    assert closed({"type": "string"}) == {"type": "string"} and closed(True) is True


def hermes(*calls: str) -> str:
    return "".join(f"<tool_call>\n{c}\n</tool_call>\n" for c in calls)


def test_a_repeated_call_and_a_call_cut_off_are_dropped():
    a, b = '{"name": "f", "arguments": {"x": 1}}', '{"name": "g", "arguments": {}}'
    _, calls = parse_tool_calls(HERMES, hermes(a, b, a, b) + '<tool_call>\n{"name": "f", "arguments": {"x"')
    assert calls == [("f", '{"x": 1}'), ("g", "{}")]
    _, calls = parse_tool_calls(HERMES, '<tool_call>\n{"name": "f", "arguments": {"x"')
    assert calls == [("f", '{"x"')], "a lone call cut off is still shown (finish_reason says length)"


def test_a_stream_sends_each_call_once_and_says_when_the_model_repeats_one():
    stream = ToolCallStream(HERMES)
    a, b = '{"name": "f", "arguments": {"x": 1}}', '{"name": "g", "arguments": {}}'
    text = hermes(a, b, a)
    deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i : i + 3])]
    calls = [c for d in deltas for c in d.tool_calls or ()]
    assert [c.index for c in calls if c.id] == [0, 1]
    assert "".join(c.function.arguments for c in calls if c.index == 0) == '{"x": 1}'
    assert [c.function.arguments for c in calls if c.index == 1] == ["", "{}"], "a later call is sent whole"
    assert stream.repeated and stream.has_calls


def test_a_later_call_cut_off_is_never_sent():
    stream = ToolCallStream(HERMES)
    deltas = stream.feed(hermes('{"name": "f", "arguments": {}}') + '<tool_call>\n{"name": "g", "arguments": {"k') \
        + stream.finish()
    assert [c.function.name for d in deltas for c in d.tool_calls or () if c.id] == ["f"]


def chat(messages, **kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **kw})


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_every_tool_call_must_be_answered_before_the_conversation_goes_on():
    answered = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "r"}, {"role": "user", "content": "more"}]
    check_tool_answers(chat(answered))
    check_tool_answers(chat(answered[:2]))  # ending on the calls: the model is asked to go on from them
    with pytest.raises(InvalidParameter, match="call_1") as err:
        check_tool_answers(chat([*answered[:2], {"role": "user", "content": "more"}]))
    assert err.value.param == "messages.[1].role"
    with pytest.raises(InvalidParameter, match="call_9"):
        check_tool_answers(chat([*answered[:2], {"role": "tool", "tool_call_id": "call_9", "content": "r"}]))


def test_tool_answers_that_end_the_conversation_must_answer_every_call():
    """OpenAI's 400 when the last messages answer only some of the assistant's calls (issue 31: it was accepted)."""
    second = {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}
    calls = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [CALL, second]}]
    with pytest.raises(InvalidParameter, match="call_2") as err:
        check_tool_answers(chat([*calls, {"role": "tool", "tool_call_id": "call_1", "content": "r"}]))
    assert err.value.param == "messages.[1].tool_calls"
    check_tool_answers(chat([*calls, {"role": "tool", "tool_call_id": "call_1", "content": "r"},
                             {"role": "tool", "tool_call_id": "call_2", "content": "s"}]))


def test_the_deprecated_functions_become_tools_with_their_history():
    fn = {"name": "f", "parameters": {"type": "object"}}
    req = from_functions(chat([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "function", "name": "f", "content": "42"},
    ], functions=[fn], function_call={"name": "f"}))
    assert req.functions is None and [t.function.name for t in req.tools] == ["f"]
    assert req.tool_choice.function.name == "f" and req.parallel_tool_calls is False
    call = req.messages[1].tool_calls[0]
    assert req.messages[2].role == "tool" and req.messages[2].tool_call_id == call.id
    check_tool_answers(req)
    with pytest.raises(InvalidParameter):
        from_functions(chat([{"role": "user", "content": "q"}], functions=[fn], tools=[{"type": "function",
                                                                                      "function": fn}]))


def test_legacy_logprobs_are_the_true_values_whatever_the_rank():
    """lm-evaluation-harness sums them to score a text: a placeholder for unlikely tokens makes scores wrong."""
    entries = [None, TokenLogprob(5, -12.5, ((7, -0.1),), 900), TokenLogprob(6, float("-inf"), (), 1000)]
    out, _ = legacy_logprobs([4, 5, 6], entries, lambda t: b"t%d" % t)
    assert out["token_logprobs"] == [None, -12.5, UNLIKELY]
    assert out["top_logprobs"][1] == {"t7": -0.1, "t5": -12.5}


def test_an_echoed_prompts_bos_takes_no_characters_of_the_text():
    """Issue 31: "<bos>The quick" echoed as "The quick" had offsets [0, 5, 9]: the BOS counted as five characters."""
    pieces = {1: b"<bos>", 2: b"The", 3: b" quick"}
    entries = [None, TokenLogprob(2, -1.0, (), 1), TokenLogprob(3, -2.0, (), 1)]
    out, end = legacy_logprobs([1, 2, 3], entries, pieces.__getitem__, 0, 9, zero_width=1)
    assert out["tokens"] == ["<bos>", "The", " quick"]
    assert out["text_offset"] == [0, 0, 3] and end == 9


def test_vllm_prompt_logprobs_hold_the_prompt_token_and_the_most_likely():
    entries = [None, TokenLogprob(5, -3.0, ((7, -0.2), (5, -3.0)), 2)]
    out = vllm_prompt_logprobs([4, 5], entries, lambda t: b"t%d" % t)
    assert out == [None, {"5": {"logprob": -3.0, "rank": 2, "decoded_token": "t5"},
                          "7": {"logprob": -0.2, "rank": 1, "decoded_token": "t7"}}]
