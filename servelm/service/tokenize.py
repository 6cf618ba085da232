"""/tokenize and /detokenize: a prompt (or a chat, rendered as a chat request renders it) → token ids, and back.
A chat's count is the prompt_tokens of the same chat request: both come from ChatService.prepare."""

from __future__ import annotations

from pydantic import ValidationError

from servelm.errors import InvalidParameter
from servelm.protocol.chat import ChatCompletionRequest
from servelm.protocol.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from servelm.service.chat import ChatService
from servelm.service.params import RequestContext
from servelm.service.registry.deployments import TextDeployment


class TokenizeService:
    def __init__(self, chat: ChatService) -> None:
        self.chat = chat
        self.deployments = chat.deployments

    def deployment(self, model: str | None) -> TextDeployment:
        if model is not None:
            return self.deployments.generator(model)
        generators = self.deployments.generators()
        if len(generators) != 1:
            raise InvalidParameter("Several models are served here: name one in `model`.", "model",
                                   "missing_required_parameter")
        return generators[0]

    def tokenize(self, req: TokenizeRequest, ctx: RequestContext = RequestContext()) -> TokenizeResponse:
        dep = self.deployment(req.model)
        if req.messages is not None:
            if req.add_generation_prompt is False:
                raise InvalidParameter("add_generation_prompt false is not supported: a chat is counted as a chat "
                                       "request reads it, with the assistant's turn opened.", "add_generation_prompt",
                                       "unsupported_parameter")
            try:
                chat = ChatCompletionRequest.model_validate(
                    {"model": dep.name, "messages": req.messages, "tools": req.tools,
                     "chat_template_kwargs": req.chat_template_kwargs}, strict=False)
            except ValidationError as exc:
                raise InvalidParameter(f"Invalid messages: {exc.errors()[0]['msg']}.", "messages") from None
            ids = list(self.chat.prepare(chat, ctx).generation.prompt_token_ids)
        else:
            text = req.prompt if req.prompt is not None else req.content or ""
            special = req.add_special_tokens if req.add_special_tokens is not None else req.add_special
            parse = req.parse_special is not False
            if special is False or not parse:
                ids = dep.vocab.tokenize_bare(text, parse)
                if special is not False and dep.bos_id is not None:
                    ids = [dep.bos_id, *ids]
            else:
                ids = dep.vocab.tokenize(text)
        pieces = [dep.vocab.token_bytes(t).decode("utf-8", "replace") for t in ids]
        if req.with_pieces:
            return TokenizeResponse(count=len(ids), max_model_len=dep.context_window,
                                    tokens=[{"id": t, "piece": p} for t, p in zip(ids, pieces)])
        return TokenizeResponse(count=len(ids), max_model_len=dep.context_window, tokens=ids,
                                token_strs=pieces if req.return_token_strs else None)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        dep = self.deployment(req.model)
        for i, t in enumerate(req.tokens):
            if t >= dep.vocab.size:
                raise InvalidParameter(f"tokens[{i}] is {t}, outside the vocabulary (0..{dep.vocab.size - 1}).",
                                       f"tokens[{i}]")
        text = b"".join(dep.vocab.token_bytes(t) for t in req.tokens).decode("utf-8", "replace")
        return DetokenizeResponse(prompt=text, content=text)
