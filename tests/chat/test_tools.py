import json

import pytest

from servelm.chat.tools import (
    FORMATS,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    ArgsEvent,
    CallStart,
    ContentEvent,
    FunctionSpec,
    ToolCallParser,
    detect_style,
    parse_tool_calls,
    tool_grammar,
)
from tests.constrain.bytevocab import accepts, grammars

WEATHER = FunctionSpec("get_weather", "weather", {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False,
})
TIME = FunctionSpec("get_time")
CALLS = [("get_weather", '{"city": "Paris, \\"FR\\" {x}", "days": 3}'), ("get_time", "{}")]


@pytest.fixture(scope="module")
def g():
    return grammars()


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_whole_answers_parse_back_to_their_calls(fmt):
    content, calls = parse_tool_calls(fmt, fmt.render_calls(CALLS))
    assert content is None and calls == CALLS


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
def test_streamed_in_any_pieces_gives_the_same_arguments(fmt):
    text = fmt.render_calls(CALLS)
    for size in (1, 2, 3, 7):
        p = ToolCallParser(fmt)
        events = []
        for i in range(0, len(text), size):
            events += p.feed(text[i:i + size])
        events += p.finish()
        starts = [e for e in events if isinstance(e, CallStart)]
        assert [(e.index, e.name) for e in starts] == [(0, "get_weather"), (1, "get_time")]
        for i, (_, args) in enumerate(CALLS):
            assert "".join(e.text for e in events if isinstance(e, ArgsEvent) and e.index == i) == args
        assert not [e for e in events if isinstance(e, ContentEvent)]


def test_plain_text_is_content_even_when_it_starts_like_a_marker():
    assert parse_tool_calls(HERMES, "<tool") == ("<tool", [])
    assert parse_tool_calls(HERMES, "hello <tool_call> there") == ("hello <tool_call> there", [])
    assert parse_tool_calls(HERMES, "<tool_call>\nnot json") == ("<tool_call>\nnot json", [])
    p = ToolCallParser(HERMES)
    assert p.feed("<to") == [] and p.feed("day") == [ContentEvent("<today")]


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS)
@pytest.mark.parametrize("parallel", [True, False])
def test_the_grammar_takes_the_formats_own_calls_and_nothing_else(g, fmt, parallel):
    c = g.lark(tool_grammar(fmt, [WEATHER, TIME], "required", parallel=parallel), "tools")
    one = fmt.render_calls(CALLS[:1])
    assert accepts(g, c, one)
    assert accepts(g, c, fmt.render_calls(CALLS)) is parallel
    assert not accepts(g, c, fmt.render_calls([("get_weather", '{"town": "Paris"}')]))  # not its parameters
    assert not accepts(g, c, fmt.render_calls([("get_wether", '{"city": "Paris"}')]))  # no such function
    assert not accepts(g, c, "Sure, the weather is fine.")


def test_named_choice_allows_that_function_only(g):
    c = g.lark(tool_grammar(HERMES, [WEATHER, TIME], "get_time", parallel=True), "tools")
    assert accepts(g, c, HERMES.render_calls([("get_time", "{}")]))
    assert not accepts(g, c, HERMES.render_calls(CALLS[:1]))


def test_auto_takes_text_or_calls(g):
    c = g.lark(tool_grammar(HERMES, [WEATHER], "auto", parallel=True), "tools")
    assert accepts(g, c, "It is sunny.")
    assert accepts(g, c, HERMES.render_calls(CALLS[:1]))
    assert not accepts(g, c, "<tool_call>\nnonsense")
    assert not accepts(g, c, "\n <tool_call>\nnonsense"), "a call cannot hide behind whitespace as text"
    schema = '%json{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    cj = g.lark(tool_grammar(HERMES, [WEATHER], "auto", parallel=True, content=schema), "tools")
    assert accepts(g, cj, '{"a": 1}') and not accepts(g, cj, "It is sunny.")


def test_no_parameters_means_an_empty_object(g):
    c = g.lark(tool_grammar(HERMES, [TIME], "required", parallel=False), "tools")
    assert accepts(g, c, HERMES.render_calls([("get_time", "{}")]))
    assert not accepts(g, c, HERMES.render_calls([("get_time", '{"x": 1}')]))


def test_special_markers_become_their_token(g):
    lark = tool_grammar(MISTRAL, [TIME], "required", parallel=True, special_id={"[TOOL_CALLS]": 7}.get)
    assert "<[7]>" in lark and '"[TOOL_CALLS]' not in lark


def test_template_styles():
    assert detect_style(None).format is HERMES and not detect_style(None).native
    assert detect_style("{{ messages }}").native is False
    assert detect_style("{% if tools %}<tool_call>{% endif %}") .native
    assert detect_style("{% if tools %}[TOOL_CALLS]{% endif %}").format is MISTRAL
    assert detect_style("{% if tools %}<|python_tag|>ipython{% endif %}").format is LLAMA3_JSON
    assert detect_style("{% if tools %}{{ tools }}{% endif %}") .native is False  # unknown syntax: describe them ourselves


def test_rendered_arguments_are_kept_verbatim():
    text = HERMES.render_call("f", '{"b": 1,   "a": [ ]}')
    assert parse_tool_calls(HERMES, text)[1] == [("f", '{"b": 1,   "a": [ ]}')]
    assert json.loads(parse_tool_calls(HERMES, text)[1][0][1]) == {"b": 1, "a": []}
