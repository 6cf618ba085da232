"""A chat request's messages as its model's chat template takes them: roles, text parts, tool calls and tool
results (chat/template.py renders them)."""

from __future__ import annotations

import json
from typing import Any

from servelm.chat.template import TemplateError
from servelm.chat.tools import HERMES, tool_response_text
from servelm.engine.types import MediaChunk, MediaSpan
from servelm.errors import ContextLengthExceeded, InvalidParameter
from servelm.protocol.chat import ChatCompletionRequest, ChatMessage, ImagePart
from servelm.service.media import Piece
from servelm.service.registry.deployments import TextDeployment


def template_messages(req: ChatCompletionRequest, system_text: str, native: bool,
                      image_mark: str = "") -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them, with tool calls and results rendered (natively,
    or as Hermes-style text for a template that knows no tools) and `system_text` (the tools' instructions)
    joined to the system message. Each image part becomes `image_mark` in its message's text, where the prompt
    takes the image (image_parts lists them in the same order)."""
    names = {c.id: c.function.name for m in req.messages for c in (m.tool_calls or ())}
    messages = [_message(m, native, names, image_mark) for m in req.messages]
    if system_text:
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{system_text}".lstrip()}
        else:
            messages.insert(0, {"role": "system", "content": system_text})
    return messages


def image_parts(req: ChatCompletionRequest) -> list[tuple[str, str]]:
    """(where, url) of every image part, in message order: `messages[1].content[0]`."""
    return [(f"messages[{i}].content[{j}]", part.image_url.url)
            for i, m in enumerate(req.messages) if isinstance(m.content, list)
            for j, part in enumerate(m.content) if isinstance(part, ImagePart)]


def _message(m: ChatMessage, native: bool, names: dict[str, str], image_mark: str) -> dict[str, Any]:
    content = _text(m, image_mark)
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


def _text(m: ChatMessage, image_mark: str) -> str:
    if not isinstance(m.content, list):
        return m.content or ""
    return "\n".join(image_mark if isinstance(part, ImagePart) else part.text for part in m.content)


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


def prompt_ids(dep: TextDeployment, messages: list[dict[str, Any]], extra: dict[str, Any], image_mark: str = "",
               images: list[list[Piece]] | None = None) -> tuple[list[int], tuple[MediaSpan, ...], str]:
    """The chat prompt's token ids: the messages rendered with the deployment's template, its control tokens the
    template's own (the request's text stays text: chat/markers.py); and where each image's pieces go in place of
    its mark: their tokens, and media spans whose positions hold the image's placeholder ids; and the rendered text
    (what the content filter reads as the prompt as a whole)."""
    markers = dep.markers
    if markers is not None:
        messages, extra = markers.escape(messages), markers.escape(extra)
    try:
        text = dep.template.render(messages, add_generation_prompt=True, **extra)
    except TemplateError as exc:
        raise InvalidParameter(str(exc), "messages") from None
    at_least = len(text.encode("utf-8", errors="replace")) // dep.vocab.max_token_bytes
    if at_least >= dep.context_window:  # refused before the tokenizer spends time on it (it would be refused after)
        raise ContextLengthExceeded(
            f"This model's maximum context length is {dep.context_window} tokens. However, your messages resulted in "
            f"at least {at_least} tokens. Please reduce the length of the messages.", "messages")
    texts = text.split(image_mark) if images else [text]
    if len(texts) != len(images or ()) + 1:
        raise InvalidParameter("The model's chat template did not place every image of the messages in the prompt.",
                               "messages")
    ids: list[int] = []
    spans: list[MediaSpan] = []
    for n, piece in enumerate(texts):
        if n:
            for part in (images or [])[n - 1]:
                if isinstance(part, MediaChunk):
                    spans.append(MediaSpan(len(ids), part))
                    ids.extend([part.placeholder] * part.length)
                else:
                    ids.extend(part)
        if markers is not None:
            ids.extend(markers.tokenize(piece, lambda t: dep.vocab.tokenize_bare(t, False), dep.bos_id if not n else None))
        elif n:
            ids.extend(dep.vocab.tokenize_bare(piece, True))
        else:
            ids.extend(dep.vocab.tokenize(piece))
    return ids, tuple(spans), text
