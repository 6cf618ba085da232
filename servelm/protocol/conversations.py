"""OpenAI's Conversations API wire shapes (/v1/conversations and its items)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from servelm.protocol.common import ResponseModel, WireModel
from servelm.protocol.responses import InputItem, InputItemList

ConversationItemList = InputItemList  # a page of a conversation's items: the shape of a response's input items

MAX_ITEMS_ADDED = 20  # items one create or add may carry (OpenAI's bound)
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]


class CreateConversation(WireModel):
    metadata: Metadata | None = None
    items: Annotated[list[InputItem], Field(max_length=MAX_ITEMS_ADDED)] | None = None


class UpdateConversation(WireModel):
    metadata: Metadata


class AddItems(WireModel):
    items: Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS_ADDED)]


class ConversationObject(ResponseModel):
    id: str
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str] = {}


class DeletedConversation(ResponseModel):
    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: bool = True
