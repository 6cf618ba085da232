"""A chat request's messages as its model's chat template takes them: roles, text parts, tool calls and tool
results (chat/template.py renders them)."""

from __future__ import annotations

import json
from typing import Any

from servelm.chat.tools import HERMES, tool_response_text
from servelm.errors import InvalidParameter
from servelm.protocol.chat import ChatCompletionRequest, ChatMessage, ImagePart


def template_messages(req: ChatCompletionRequest, system_text: str, native: bool) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them, with tool calls and results rendered (natively,
    or as Hermes-style text for a template that knows no tools) and `system_text` (the tools' instructions)
    joined to the system message."""
    names = {c.id: c.function.name for m in req.messages for c in (m.tool_calls or ())}
    messages = [_message(i, m, native, names) for i, m in enumerate(req.messages)]
    if system_text:
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{system_text}".lstrip()}
        else:
            messages.insert(0, {"role": "system", "content": system_text})
    return messages


def _message(i: int, m: ChatMessage, native: bool, names: dict[str, str]) -> dict[str, Any]:
    content = _text(i, m)
    role = "system" if m.role == "developer" else m.role
    msg: dict[str, Any] = {"role": role, "content": content}
    if m.name is not None:
        msg["name"] = m.name
    if m.role == "tool":
        if native:
            msg["tool_call_id"] = m.tool_call_id
            if m.tool_call_id in names:
                msg["name"] = names[m.tool_call_id]
        else:
            msg = {"role": "user", "content": tool_response_text(content)}
    elif m.tool_calls:
        if native:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _args_value(c.function.arguments)}}
                for c in m.tool_calls
            ]
        else:
            calls = HERMES.render_calls([(c.function.name, _args_text(c.function.arguments)) for c in m.tool_calls])
            msg["content"] = f"{content}\n{calls}" if content else calls
    return msg


def _text(i: int, m: ChatMessage) -> str:
    if not isinstance(m.content, list):
        return m.content or ""
    parts = []
    for j, part in enumerate(m.content):
        if isinstance(part, ImagePart):
            raise InvalidParameter(
                "This model does not accept image input; send text parts only.",
                f"messages[{i}].content[{j}]",
                "unsupported_content",
            )
        parts.append(part.text)
    return "\n".join(parts)


def _args_value(arguments: str) -> Any:
    """Templates expect arguments as a mapping (Hugging Face's convention); keep text that is not JSON."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _args_text(arguments: str) -> str:
    try:
        json.loads(arguments)
        return arguments
    except json.JSONDecodeError:
        return json.dumps(arguments)
