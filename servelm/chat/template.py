"""Render chat messages with the model's own chat template (from the GGUF metadata) in a jinja2 sandbox, or, for a
model file without one, with llama.cpp's built-in template for its architecture (BuiltinTemplate), or ChatML."""

from __future__ import annotations

from collections.abc import Callable
from datetime import date
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used only when a model file carries no chat template of its own and llama.cpp has none for its architecture; its
# end marker is then a stop string (a model whose vocabulary lacks it would write it as text and go on)
CHATML_END = "<|im_end|>"
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateError(ValueError):
    """The template refused the messages (its own raise_exception, or it could not render them)."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
    import json

    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


class ChatTemplate:
    """`origin`: where the template came from, as /v1/models reports it: gguf (the model file's), file
    (--chat-template), builtin:NAME (llama.cpp's, BuiltinTemplate) or fallback (ChatML)."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "", origin: str = "gguf") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: date.today().strftime(fmt)
        env.filters["tojson"] = _tojson
        self.source = source or CHATML
        self.origin = origin if source else "fallback"
        self._template = env.from_string(self.source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the model's chat template could not render these messages: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise TemplateError(f"the model's chat template could not render these messages: {exc}") from exc


class BuiltinTemplate(ChatTemplate):
    """llama.cpp's built-in template `name` (runners/llamacpp.py renders it): roles and text only, so tools are
    described in the prompt (chat/tools.py's non-native style) and a tool's answer is a user turn."""

    def __init__(self, name: str, apply: Callable[[str, list[tuple[str, str]], bool], str]) -> None:
        super().__init__(None)
        self.origin = f"builtin:{name}"
        self.source = ""  # nothing for detect_style or the reasoning markers to read
        self._name, self._apply = name, apply

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        turns = [("user" if m.get("role") == "tool" else str(m.get("role", "user")), _content(m.get("content")))
                 for m in messages]
        try:
            return self._apply(self._name, turns, add_generation_prompt)
        except ValueError as exc:
            raise TemplateError(str(exc)) from exc


def _content(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)
