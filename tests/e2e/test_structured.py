"""Structured output through the client: response_format (json_object, json_schema, a parsed pydantic
model), vLLM's structured_outputs and guided_* extensions, constraint errors, and n > 1 under a constraint.

Each request gives the model room to finish by itself and checks finish_reason == "stop" before it
reads the answer, so a truncated answer fails loudly instead of passing. The model writes prose when it
is not constrained (see the prompts' unconstrained answers), so every check here needs the constraint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from .helpers import MODEL, assert_valid_json, chat, user

pytestmark = pytest.mark.e2e

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
PERSON_PROMPT = user("Describe a person as JSON with a name, an age and a role.")

SMALL = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["x", "ok"],
    "additionalProperties": False,
}


def _stopped(out: Any) -> None:
    """The model ended the answer itself: what follows reads a whole answer, not a truncated one."""
    assert all(f == "stop" for f in out.finish_reasons), f"finish_reasons {out.finish_reasons}: {out.texts}"


# -- response_format ------------------------------------------------------------------------------
def test_json_object(client: openai.OpenAI, stream: bool) -> None:
    # Unconstrained, the model answers this with prose around a ```json block.
    messages = [
        {"role": "system", "content": 'Answer with a JSON object like {"city": "Paris", "country": "France"}.'},
        *user("Give me a city."),
    ]
    out = chat(client, stream=stream, messages=messages, max_tokens=80, temperature=0,
               response_format={"type": "json_object"})
    _stopped(out)
    value = json.loads(out.text)
    assert isinstance(value, dict) and value, out.text


def test_json_schema(client: openai.OpenAI, stream: bool) -> None:
    rf = {"type": "json_schema",
          "json_schema": {"name": "person", "description": "A person", "schema": PERSON, "strict": True}}
    for seed in (1, 2):
        out = chat(client, stream=stream, messages=PERSON_PROMPT, max_tokens=100, temperature=0.8, seed=seed,
                   response_format=rf)
        _stopped(out)
        assert_valid_json(out.text, PERSON)


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=20)
    legs: int = Field(ge=0, le=8)
    kind: str = Field(pattern="^(cat|dog|bird)$")


def test_parse_pydantic_model(client: openai.OpenAI, stream: bool) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=user("Describe a pet."), response_format=Pet, max_tokens=100,
                              temperature=0.8, seed=5)
    if stream:
        with client.beta.chat.completions.stream(**kw) as s:
            for _ in s:
                pass
            resp = s.get_final_completion()
    else:
        resp = client.beta.chat.completions.parse(**kw)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice
    parsed = choice.message.parsed
    assert isinstance(parsed, Pet), choice.message
    assert parsed == Pet.model_validate_json(choice.message.content)
    assert parsed.kind in ("cat", "dog", "bird") and 0 <= parsed.legs <= 8 and len(parsed.name) <= 20


# -- vLLM's extensions ----------------------------------------------------------------------------
def _fullmatch(pattern: str) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), f"{text!r} does not fully match {pattern!r}"
    return check


def _one_of(options: list[str]) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert text in options, f"{text!r} is not one of {options}"
    return check


def _schema(schema: dict) -> Callable[[str], None]:
    return lambda text: assert_valid_json(text, schema)


def _object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


LARK = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'
GBNF = 'root ::= "Color: " color "."\ncolor ::= "red" | "green" | "blue"'
EXTENSIONS = [
    ("so_json", {"structured_outputs": {"json": SMALL}}, _schema(SMALL)),
    ("so_json_as_string", {"structured_outputs": {"json": json.dumps(SMALL)}}, _schema(SMALL)),
    ("so_regex", {"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, _fullmatch(r"[0-9]{3}-[0-9]{4}")),
    ("so_choice", {"structured_outputs": {"choice": ["red", "green", "blue"]}}, _one_of(["red", "green", "blue"])),
    ("so_grammar_lark", {"structured_outputs": {"grammar": LARK}}, _fullmatch(r"The answer is [0-9]{1,3}\.")),
    ("so_grammar_gbnf", {"structured_outputs": {"grammar": GBNF}}, _fullmatch(r"Color: (red|green|blue)\.")),
    ("so_json_object", {"structured_outputs": {"json_object": True}}, _object),
    ("guided_json", {"guided_json": SMALL}, _schema(SMALL)),
    ("guided_regex", {"guided_regex": r"[A-Z][a-z]{2,8} \d{1,2}"}, _fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,2}")),
    ("guided_choice", {"guided_choice": ["yes", "no"]}, _one_of(["yes", "no"])),
    ("guided_grammar", {"guided_grammar": GBNF}, _fullmatch(r"Color: (red|green|blue)\.")),
]


@pytest.mark.parametrize(("extra", "check"), [c[1:] for c in EXTENSIONS], ids=[c[0] for c in EXTENSIONS])
def test_structured_outputs_extensions(client: openai.OpenAI, stream: bool, extra: dict, check: Callable) -> None:
    messages = [
        {"role": "system", "content": 'Reply in JSON, like {"x": 3, "ok": true}.'},
        *user("Give me a date, a colour and a phone number."),
    ]
    out = chat(client, stream=stream, messages=messages, max_tokens=60, temperature=0.8, seed=1, extra_body=extra)
    _stopped(out)
    check(out.text)


def test_regex_digit_means_ascii_digit(client: openai.OpenAI, stream: bool) -> None:
    # Push hard toward the first bytes of Arabic-Indic (٣), Devanagari (३) and fullwidth (１) digits:
    # with a Unicode \d they would win; \d must mean [0-9].
    push = {"164": 100, "9310": 100, "8083": 100}
    out = chat(client, stream=stream, messages=user("Pick a number."), max_tokens=20, temperature=0.8, seed=7,
               logit_bias=push, extra_body={"structured_outputs": {"regex": r"\d{3}"}})
    _stopped(out)
    assert re.fullmatch(r"[0-9]{3}", out.text), out.text


# -- errors ---------------------------------------------------------------------------------------
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "frobnicate"}}}
BAD_CONSTRAINTS = [
    ("response_format_schema",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
     "response_format.json_schema.schema"),
    ("response_format_schema_bad_pattern",
     {"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(unclosed"}}}},
     "response_format.json_schema.schema"),
    ("so_json", {"extra_body": {"structured_outputs": {"json": BAD_SCHEMA}}}, "structured_outputs.json"),
    ("so_regex", {"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs.regex"),
    ("so_grammar", {"extra_body": {"structured_outputs": {"grammar": "start: missing_rule"}}},
     "structured_outputs.grammar"),
    ("guided_json", {"extra_body": {"guided_json": BAD_SCHEMA}}, "guided_json"),
    ("guided_json_not_json", {"extra_body": {"guided_json": "{not json"}}, "guided_json"),
    ("guided_regex", {"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
    ("guided_grammar_lark", {"extra_body": {"guided_grammar": "start: missing_rule"}}, "guided_grammar"),
    ("guided_grammar_gbnf", {"extra_body": {"guided_grammar": "root ::= undefined"}}, "guided_grammar"),
]


@pytest.mark.parametrize(("kwargs", "param"), [c[1:] for c in BAD_CONSTRAINTS], ids=[c[0] for c in BAD_CONSTRAINTS])
def test_constraint_that_cannot_compile_is_400(client: openai.OpenAI, stream: bool, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, stream=stream, messages=user("Hi"), max_tokens=4, **kwargs)
    err = info.value.response.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"], err


# -- n > 1 ----------------------------------------------------------------------------------------
def test_every_choice_is_constrained(client: openai.OpenAI, stream: bool) -> None:
    options = ["alpha", "beta", "gamma", "delta"]
    out = chat(client, stream=stream, messages=user("Name a colour."), n=3, max_tokens=10, temperature=1.0,
               seed=11, extra_body={"guided_choice": options})
    _stopped(out)
    assert len(out.texts) == 3 and all(t in options for t in out.texts), out.texts

    out = chat(client, stream=stream, messages=PERSON_PROMPT, n=3, max_tokens=100, temperature=1.0, seed=11,
               response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    _stopped(out)
    assert len(out.texts) == 3
    for text in out.texts:
        assert_valid_json(text, PERSON)
