"""Response shapes checked against OpenAI's published OpenAPI description (tests/data/openai-response-schemas.json:
the schemas our responses must follow, copied unchanged from openai/openai-openapi, MIT licence; see
tests/data/README.md).

The description mixes OpenAPI 3.0's `nullable: true` into 3.1 schemas; a JSON Schema validator ignores it, so it
is read here as what it means (the type, or null). Where OpenAI's API answers differently from its own
description, the test that meets it says so and follows the API."""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012

SCHEMAS = Path(__file__).parent / "data" / "openai-response-schemas.json"


def _nullable(node: Any) -> Any:
    if isinstance(node, dict):
        node = {k: _nullable(v) for k, v in node.items()}
        if node.pop("nullable", False):
            node = {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    return node


@cache
def _document() -> dict:
    return _nullable(json.loads(SCHEMAS.read_text()))


@cache
def _validator(name: str) -> Draft202012Validator:
    registry = Registry().with_resource("urn:openai", DRAFT202012.create_resource(_document()))
    return Draft202012Validator({"$ref": f"urn:openai#/components/schemas/{name}"}, registry=registry)


def errors(name: str, instance: Any) -> list[str]:
    """Every way `instance` departs from the spec's schema `name`, as readable lines ([] when it conforms)."""
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
            for e in _validator(name).iter_errors(copy.deepcopy(instance))]


def assert_conforms(name: str, instance: Any) -> None:
    found = errors(name, instance)
    assert not found, f"not a {name}:\n" + "\n".join(found[:10]) + f"\n{json.dumps(instance)[:2000]}"


def sse_chunks(text: str) -> list[dict]:
    """The JSON chunks of an SSE body, without the [DONE] sentinel."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: "):]))
    return out
