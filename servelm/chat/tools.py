"""Tool calls as text: each model family's syntax, the grammar that forces it, and the parser that reads it.

A ToolFormat describes one syntax: Hermes/Qwen's `<tool_call>` blocks, Llama 3.x's bare JSON objects,
and Mistral's `[TOOL_CALLS]` list. A model whose chat template renders tools gets them through the
template and answers in its own syntax; any other model (the default one) is told about the tools in
a system message and answers in the Hermes syntax. Either way the output is constrained by the grammar
written here, so a call always parses and its arguments always validate against the function's
parameters. ToolCallParser reads that output incrementally: the same code folds a whole answer and
streams one, so streamed arguments concatenate to exactly the non-streamed ones.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# Inside a grammar, a schema compiles to compact JSON with json.dumps' spacing (see constrain/grammars.py).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: dict(NO_PARAMETERS))

    def as_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolFormat:
    name: str
    starts: tuple[str, ...]  # how an answer made of calls begins
    args_key: str = "arguments"  # the key that holds the arguments
    open: str = ""  # before the first call
    call_open: str = ""  # before each call's JSON object
    call_close: str = "}"  # after each call's JSON object (its closing brace included)
    sep: str = "\n"  # between calls
    close: str = ""  # after the last call
    special: tuple[str, ...] = ()  # markers that are a single control token in this family's vocabulary

    def render_call(self, name: str, arguments: str) -> str:
        return f'{self.call_open}{{"name": {json.dumps(name)}, "{self.args_key}": {arguments}{self.call_close}'

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        return self.open + self.sep.join(self.render_call(n, a) for n, a in calls) + self.close


HERMES = ToolFormat("hermes", starts=("<tool_call>",), call_open="<tool_call>\n", call_close="}\n</tool_call>")
LLAMA3_JSON = ToolFormat("llama3_json", starts=('{"name"',), args_key="parameters", sep="; ")
MISTRAL = ToolFormat("mistral", starts=("[TOOL_CALLS]",), open="[TOOL_CALLS][", sep=", ", close="]",
                     special=("[TOOL_CALLS]",))
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


@dataclass(frozen=True)
class ToolStyle:
    """How one deployment's model takes tools: its syntax, and whether its template renders tools."""

    format: ToolFormat
    native: bool


def detect_style(template_source: str | None) -> ToolStyle:
    """Read the chat template for a known tool syntax; a template that renders none gets the generic way."""
    src = template_source or ""
    if "tools" not in src:
        return ToolStyle(HERMES, native=False)
    if "[TOOL_CALLS]" in src:
        return ToolStyle(MISTRAL, native=True)
    if "<tool_call>" in src:
        return ToolStyle(HERMES, native=True)
    if "<|python_tag|>" in src or "ipython" in src:
        return ToolStyle(LLAMA3_JSON, native=True)
    return ToolStyle(HERMES, native=False)


# -- prompts for models that do not know tools ---------------------------------------------------
def tools_system_prompt(functions: Sequence[FunctionSpec], required: str | None) -> str:
    """The system text that teaches a model without tool support to call these functions in Hermes syntax."""
    listing = "\n".join(json.dumps(f.as_openai()["function"], ensure_ascii=False) for f in functions)
    must = ""
    if required == "required":
        must = "You must call at least one function.\n"
    elif required:
        must = f"You must call the function {required}.\n"
    return (
        "You can call functions to help answer. These are the functions, with their parameters as JSON Schema:\n"
        f"{listing}\n{must}"
        "To call a function, answer with a <tool_call></tool_call> block holding a JSON object with the "
        "function's name and its arguments, one block per call:\n"
        '<tool_call>\n{"name": "function_name", "arguments": {"argument_name": "value"}}\n</tool_call>\n'
        "Otherwise answer in plain text."
    )


def tool_response_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


# -- grammars -------------------------------------------------------------------------------------
def _lit(text: str, special_id: Callable[[str], int | None]) -> str:
    """A Lark literal for text; a marker that is one control token becomes that token."""
    if not text:
        return ""
    token = special_id(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


def _with_style(schema: dict[str, Any]) -> dict[str, Any]:
    styled = dict(schema)
    styled["x-guidance"] = {**_JSON_STYLE, **schema.get("x-guidance", {})}
    return styled


def tool_grammar(
    fmt: ToolFormat,
    functions: Sequence[FunctionSpec],
    choice: str,
    *,
    parallel: bool,
    content: str | None = None,
    special_id: Callable[[str], int | None] = lambda _: None,
) -> str:
    """A Lark grammar (llguidance dialect) for an answer under tool_choice.

    choice is "auto", "required", or a function's name. content, for "auto", is the Lark expression the
    answer must match when it is not calls (default: any text that does not begin like a call).
    """
    fns = functions if choice in ("auto", "required") else [f for f in functions if f.name == choice]
    open_lit = " ".join(filter(None, [_lit(m, special_id) for m in _split_special(fmt.open, fmt.special)]))
    rules = []
    for i, f in enumerate(fns):
        head = f'{fmt.call_open}{{"name": {json.dumps(f.name)}, "{fmt.args_key}": '
        rules.append(f"call_{i}: {json.dumps(head)} args_{i} {json.dumps(fmt.call_close)}")
        rules.append(f"args_{i}: %json{json.dumps(_with_style(f.parameters))}")
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(fns))))
    many = parallel and choice in ("auto", "required")
    body = f"call ({json.dumps(fmt.sep)} call)*" if many else "call"
    rules.append(f"calls: {open_lit} {body} {_lit(fmt.close, special_id)}".replace("  ", " "))
    if choice == "auto":
        if content is None:
            starts = "|".join(re.escape(s) for s in fmt.starts)
            rules.append(f"TEXT: /(.|\\n)*/ & ~/\\s*({starts})(.|\\n)*/")
            content = "TEXT"
        rules.append(f"start: calls | {content}")
    else:
        rules.append("start: calls")
    return "\n".join(rules) + "\n"


def _split_special(text: str, special: tuple[str, ...]) -> list[str]:
    """Split text so that each special marker stands alone (it may be a single token)."""
    parts = [text]
    for marker in special:
        parts = [p for part in parts for p in _split_keep(part, marker)]
    return [p for p in parts if p]


def _split_keep(text: str, marker: str) -> list[str]:
    if marker not in text:
        return [text]
    out: list[str] = []
    for i, piece in enumerate(text.split(marker)):
        if i:
            out.append(marker)
        out.append(piece)
    return out


# -- parsing --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ContentEvent:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ArgsEvent:
    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    index: int


Event = ContentEvent | CallStart | ArgsEvent | CallEnd
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class ToolCallParser:
    """Reads an answer as it streams: plain content, or a run of tool calls in the format's syntax."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._buf = ""
        self._raw = ""
        self._mode = "decide"  # then "content" or "calls"
        self._in_args = False
        self._scan = _JsonScanner()
        self.calls: list[tuple[str, str]] = []  # (name, arguments) as parsed so far
        self.complete = 0  # how many of them have their whole arguments

    def feed(self, text: str) -> list[Event]:
        self._raw += text
        self._buf += text
        events: list[Event] = []
        if self._mode == "decide":
            head = self._buf.lstrip()
            if any(head.startswith(s) for s in self.fmt.starts):
                self._mode = "calls"
                self._buf = head
            elif head and not any(s.startswith(head) for s in self.fmt.starts):
                self._mode = "content"
            else:
                return events
        if self._mode == "content":
            if self._buf:
                events.append(ContentEvent(self._buf))
            self._buf = ""
            return events
        self._parse_calls(events)
        return events

    def finish(self) -> list[Event]:
        """The answer ended. An answer that began like calls but held none is content after all."""
        if self._mode == "decide" and self._buf:
            self._mode = "content"
            out, self._buf = self._buf, ""
            return [ContentEvent(out)]
        if self._mode == "calls" and not self.calls:
            self._mode = "content"
            return [ContentEvent(self._raw)]
        return []

    def _parse_calls(self, events: list[Event]) -> None:
        while True:
            if self._in_args:
                if not self._scan.started:  # the space after the key belongs to no one
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        return
                done, used = self._scan.feed(self._buf)
                piece, self._buf = self._buf[:used], self._buf[used:]
                if piece:
                    name, args = self.calls[-1]
                    self.calls[-1] = (name, args + piece)
                    events.append(ArgsEvent(len(self.calls) - 1, piece))
                if not done:
                    return
                self._in_args = False
                self._scan = _JsonScanner()
                self.complete = len(self.calls)
                events.append(CallEnd(len(self.calls) - 1))
                continue
            self._skip_markers()
            m = _HEADER.match(self._buf)
            if m is None:
                return
            self._buf = self._buf[m.end() :]
            name = json.loads(f'"{m.group(1)}"')
            self.calls.append((name, ""))
            events.append(CallStart(len(self.calls) - 1, name))
            self._in_args = True

    def _skip_markers(self) -> None:
        """Drop the text between calls (open/close markers, separators, the close of a call's object)."""
        i = self._buf.find("{")
        if i > 0:
            self._buf = self._buf[i:]


class _JsonScanner:
    """Finds where one JSON value ends, fed in pieces (strings and escapes included)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.started = False

    def feed(self, text: str) -> tuple[bool, int]:
        """(value complete?, characters of text that belong to it)."""
        for i, ch in enumerate(text):
            if not self.started:
                if ch.isspace():
                    continue
                self.started = True
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if self.depth == 0:
                        return True, i + 1
                continue
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                if self.depth == 0:  # the end of the object around a bare value
                    return True, i
                self.depth -= 1
                if self.depth == 0:
                    return True, i + 1
            elif self.depth == 0 and ch in ",;\n":
                return True, i
        return False, len(text)


def parse_tool_calls(fmt: ToolFormat, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole answer → (content or None, [(name, arguments)]): each call once (a repeat of an earlier call of
    the turn is dropped), and a last call cut off before its arguments ended only when no call is whole."""
    parser = ToolCallParser(fmt)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentEvent))
    if parser.calls:
        whole = list(dict.fromkeys(parser.calls[: parser.complete]))
        return (content or None), whole or parser.calls[:1]
    return content, []
