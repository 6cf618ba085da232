"""What a chat request's output must look like: its constraint (a JSON schema, a pattern, a grammar, tool
calls) checked and compiled, and how its tools reach the prompt.

Every constraint is compiled here, before the request is queued, so a schema or grammar that cannot be
compiled is a 400 naming its parameter and never an unconstrained answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from servelm.chat.tools import (
    FunctionSpec,
    ToolFormat,
    ToolStyle,
    tool_grammar,
    tools_system_prompt,
)
from servelm.constrain.constraint import Constraint
from servelm.constrain.grammars import JSON_OPTIONS, GrammarError, Grammars
from servelm.errors import InvalidParameter
from servelm.protocol.chat import ChatCompletionRequest, NamedToolChoice
from servelm.service.registry.deployments import TextDeployment


@dataclass(frozen=True)
class ToolPlan:
    format: ToolFormat
    functions: tuple[FunctionSpec, ...]
    choice: str  # "auto", "required", or the one function's name


@dataclass(frozen=True)
class OutputPlan:
    constraint: Constraint | None = None
    tools: ToolPlan | None = None  # set when the answer may hold tool calls
    template_tools: list[dict[str, Any]] | None = None  # tools for a chat template that renders them
    system_text: str | None = None  # tool instructions for a model whose template does not


@dataclass(frozen=True)
class _Content:
    """The content constraint a request asked for, before compiling."""

    kind: str  # json_schema, json_object, regex, choice, grammar
    value: Any
    param: str


def plan_output(req: ChatCompletionRequest, dep: TextDeployment) -> OutputPlan:
    grammars = dep.grammars
    content = _content_constraint(req)
    functions = _functions(req, grammars)
    choice = _tool_choice(req, functions)
    if choice is None:  # no tool calls can happen: only the content constraint, if any
        return OutputPlan(constraint=_compile_content(content, grammars) if content else None)
    if grammars is None:
        raise InvalidParameter("This deployment has no grammar support, so it cannot call tools.", "tools")
    style: ToolStyle = dep.tool_style
    fmt = style.format
    content_expr = None
    if choice == "auto" and content is not None:
        if content.kind not in ("json_schema", "json_object"):
            raise InvalidParameter(
                f"{content.param} cannot be combined with tools; only a JSON response_format can.", content.param
            )
        _compile_content(content, grammars)  # a bad schema names its own parameter
        schema = content.value if content.kind == "json_schema" else {"type": "object"}
        content_expr = f"%json{json.dumps({**_schema(schema), 'x-guidance': JSON_OPTIONS})}"
    lark = tool_grammar(
        fmt, functions, choice, parallel=req.parallel_tool_calls is not False, content=content_expr,
        special_id=dep.vocab.special_id,
    )
    try:
        constraint = grammars.lark(lark, "tools")
    except GrammarError as exc:
        raise InvalidParameter(f"The tools could not be compiled into a grammar: {exc}", "tools", exc.code) from None
    constraint = replace(constraint, param="tools")
    if choice == "auto" and content_expr is None:
        constraint = replace(constraint, free_unless=fmt.starts)
    plan = ToolPlan(fmt, tuple(functions), choice)
    if style.native:
        return OutputPlan(constraint, plan, template_tools=[f.as_openai() for f in functions])
    return OutputPlan(constraint, plan, system_text=tools_system_prompt(functions, None if choice == "auto" else choice))


# -- the content constraint -----------------------------------------------------------------------
def _content_constraint(req: ChatCompletionRequest) -> _Content | None:
    found: list[_Content] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(_Content("json_object", None, "response_format"))
    elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
        if rf.json_schema.strict:
            schema = closed(schema)
        found.append(_Content("json_schema", schema, "response_format.json_schema.schema"))
    so = req.structured_outputs
    if so is not None:
        if so.json_ is not None:
            found.append(_Content("json_schema", so.json_, "structured_outputs.json"))
        elif so.regex is not None:
            found.append(_Content("regex", so.regex, "structured_outputs.regex"))
        elif so.choice is not None:
            found.append(_Content("choice", so.choice, "structured_outputs.choice"))
        elif so.grammar is not None:
            found.append(_Content("grammar", so.grammar, "structured_outputs.grammar"))
        else:
            found.append(_Content("json_object", None, "structured_outputs.json_object"))
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append(_Content(kind, value, name))
    if len(found) > 1:
        names = ", ".join(c.param.split(".")[0] for c in found)
        raise InvalidParameter(f"Give one output constraint, not several ({names}).", found[1].param.split(".")[0])
    return found[0] if found else None


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "unevaluatedProperties", "additionalItems", "not", "if", "then",
               "else", "contains", "propertyNames")


def closed(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others (`additionalProperties: false`
    where it says nothing), as vLLM's strict mode does: a small model otherwise goes on inventing properties
    until max_tokens. An object that allows more explicitly (true, or a schema) keeps it."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
        elif key == "items" and isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    if ("properties" in out or "patternProperties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _schema(value: Any) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the schema is not valid JSON: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise GrammarError("a JSON schema must be an object or a boolean")
    return value


def _compile_content(content: _Content, grammars: Grammars | None) -> Constraint:
    if grammars is None:
        raise InvalidParameter("This deployment has no grammar support for constrained output.", content.param)
    try:
        if content.kind == "json_object":
            constraint = grammars.json_object()
        elif content.kind == "json_schema":
            constraint = grammars.json_schema(_schema(content.value))
        elif content.kind == "regex":
            constraint = grammars.regex(content.value)
        elif content.kind == "choice":
            constraint = grammars.choice(content.value)
        else:
            constraint = grammars.grammar(content.value)
    except GrammarError as exc:
        what = {"json_schema": "JSON schema", "regex": "regular expression", "choice": "choice list",
                "grammar": "grammar", "json_object": "JSON object grammar"}[content.kind]
        verb = "could not be compiled" if exc.code == "invalid_grammar" else "was refused"
        raise InvalidParameter(f"The {what} {verb}: {exc}", content.param, exc.code) from None
    return replace(constraint, param=content.param)


# -- tools ----------------------------------------------------------------------------------------
def _functions(req: ChatCompletionRequest, grammars: Grammars | None) -> list[FunctionSpec]:
    functions: list[FunctionSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(req.tools or ()):
        fn = tool.function
        if fn.name in seen:
            raise InvalidParameter(f"Two tools are named {fn.name!r}; tool names must be unique.", f"tools[{i}].function.name")
        seen.add(fn.name)
        params = closed(fn.parameters) if fn.parameters is not None else None  # only the declared arguments
        if params is not None and grammars is not None:
            try:
                grammars.json_schema(params)
            except GrammarError as exc:
                raise InvalidParameter(
                    f"The parameters of tool {fn.name!r} are not a usable JSON schema: {exc}",
                    f"tools[{i}].function.parameters", exc.code,
                ) from None
        spec = FunctionSpec(fn.name, fn.description) if params is None else FunctionSpec(fn.name, fn.description, params)
        functions.append(spec)
    return functions


def _tool_choice(req: ChatCompletionRequest, functions: list[FunctionSpec]) -> str | None:
    """"auto", "required" or a function's name when calls may happen; None when they may not."""
    tc = req.tool_choice
    if not functions:
        if tc not in (None, "none"):
            raise InvalidParameter("tool_choice is only allowed when tools are given.", "tool_choice")
        if req.parallel_tool_calls is not None:
            raise InvalidParameter("parallel_tool_calls is only allowed when tools are given.", "parallel_tool_calls")
        return None
    if tc == "none":
        return None
    if isinstance(tc, NamedToolChoice):
        if tc.function.name not in {f.name for f in functions}:
            raise InvalidParameter(f"tool_choice names {tc.function.name!r}, which is not among the tools.", "tool_choice")
        return tc.function.name
    return tc or "auto"
