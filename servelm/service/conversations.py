"""OpenAI's Conversations API (/v1/conversations): a conversation is a list of items (messages, tool calls and their
outputs, reasoning, MCP items) that responses.create continues with `conversation` and appends to, and that
clients such as the Agents SDK's OpenAIConversationsSession read and write directly.

Conversations are scoped per API key (another key's id reads as not found) and bounded per key: at most
ConversationLimits.max_conversations of them, max_items items in each, max_bytes of items in all. Past a bound a
write is refused (400 `conversation_limit_reached`), never made room for by dropping what was accepted.
MemoryConversations keeps them in the server's memory (a restart loses them, and /health and the docs say so);
with --state-dir, service/durable.py's SqlConversations keeps them in the state directory's database."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from servelm.errors import ClientError, InvalidParameter, NotFound
from servelm.protocol.conversations import (
    AddItems,
    ConversationItemList,
    ConversationObject,
    CreateConversation,
    DeletedConversation,
    UpdateConversation,
)
from servelm.protocol.responses import InputItem

T = TypeVar("T")
MAX_PAGE = 100  # items one list may answer (OpenAI's bound)
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # an item id a client may choose
ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
               "mcp_approval_response": "mcpa", "mcp_call": "mcp", "mcp_list_tools": "mcpl",
               "mcp_approval_request": "mcpr"}


class LimitReached(ClientError):
    def __init__(self, message: str) -> None:
        super().__init__(message, code="conversation_limit_reached")


@dataclass(frozen=True)
class ConversationLimits:
    """Each key's bounds (ServerSettings' conversations_*)."""

    max_conversations: int = 1000
    max_items: int = 10_000  # in one conversation
    max_bytes: int = 64 << 20  # of items (as JSON) in all of a key's conversations

    @classmethod
    def from_settings(cls, settings: Any) -> ConversationLimits:
        return cls(settings.conversations_max, settings.conversation_max_items, settings.conversations_mib << 20)

    def check(self, items: int, key_bytes: int) -> None:
        """LimitReached when a conversation would hold `items`, or its key's conversations `key_bytes`."""
        if items > self.max_items:
            raise LimitReached(f"A conversation holds at most {self.max_items} items.")
        if key_bytes > self.max_bytes:
            raise LimitReached(f"This key's conversations hold at most {self.max_bytes} bytes of items.")

    def check_count(self, count: int) -> None:
        """LimitReached when the key has `count` conversations already: the most it may keep."""
        if count >= self.max_conversations:
            raise LimitReached(f"This key has {count} conversations, the most it may keep; delete one first.")


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    items: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)
    bytes: int = 0

    def wire(self) -> ConversationObject:
        return ConversationObject(id=self.id, created_at=self.created_at, metadata=self.metadata)


class ConversationStore(Protocol):
    limits: ConversationLimits

    def create(self, owner: str, metadata: dict[str, str], items: list[dict[str, Any]]) -> ConversationObject: ...

    def get(self, owner: str, conversation_id: str) -> ConversationObject | None: ...

    def update(self, owner: str, conversation_id: str, metadata: dict[str, str]) -> ConversationObject | None: ...

    def delete(self, owner: str, conversation_id: str) -> bool: ...

    def add(self, owner: str, conversation_id: str, items: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """The items as kept (an id taken already is replaced); None: no such conversation of the owner's
        (LimitReached past a bound: none added)."""
        ...

    def items(self, owner: str, conversation_id: str) -> list[dict[str, Any]] | None:
        """Every item, oldest first (None: no such conversation of the owner's)."""
        ...

    def page(self, owner: str, conversation_id: str, order: str, limit: int,
             after: str | None) -> tuple[list[dict[str, Any]], bool] | None:
        """One page of items, as page_of makes it (None: no such conversation of the owner's)."""
        ...

    def item(self, owner: str, conversation_id: str, item_id: str) -> dict[str, Any] | None: ...

    def remove_item(self, owner: str, conversation_id: str, item_id: str) -> bool: ...


class MemoryConversations:
    """The conversations in this process's memory: thread-safe (the services call it from worker threads)."""

    kept = "memory"  # what /health's `kept` says of it: a restart loses it

    def __init__(self, limits: ConversationLimits = ConversationLimits(), clock: Any = time.time) -> None:
        self.limits = limits
        self._clock = clock
        self._all: dict[str, dict[str, Conversation]] = {}  # owner → id → conversation
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    def create(self, owner: str, metadata: dict[str, str], items: list[dict[str, Any]]) -> ConversationObject:
        with self._lock:
            mine = self._all.setdefault(owner, {})
            self.limits.check_count(len(mine))
            conversation = Conversation(f"conv_{uuid.uuid4().hex}", int(self._clock()), dict(metadata))
            self._append(owner, conversation, items)
            mine[conversation.id] = conversation
            return conversation.wire()

    def get(self, owner: str, conversation_id: str) -> ConversationObject | None:
        with self._lock:
            found = self._find(owner, conversation_id)
            return found.wire() if found is not None else None

    def update(self, owner: str, conversation_id: str, metadata: dict[str, str]) -> ConversationObject | None:
        with self._lock:
            found = self._find(owner, conversation_id)
            if found is None:
                return None
            found.metadata = dict(metadata)
            return found.wire()

    def delete(self, owner: str, conversation_id: str) -> bool:
        with self._lock:
            found = self._all.get(owner, {}).pop(conversation_id, None)
            if found is None:
                return False
            self._bytes[owner] = self._bytes.get(owner, 0) - found.bytes
            return True

    def add(self, owner: str, conversation_id: str, items: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        with self._lock:
            found = self._find(owner, conversation_id)
            return self._append(owner, found, items) if found is not None else None

    def items(self, owner: str, conversation_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            found = self._find(owner, conversation_id)
            return list(found.items.values()) if found is not None else None

    def page(self, owner: str, conversation_id: str, order: str, limit: int,
             after: str | None) -> tuple[list[dict[str, Any]], bool] | None:
        found = self.items(owner, conversation_id)
        return page_of(found, order, limit, after) if found is not None else None

    def item(self, owner: str, conversation_id: str, item_id: str) -> dict[str, Any] | None:
        with self._lock:
            found = self._find(owner, conversation_id)
            return found.items.get(item_id) if found is not None else None

    def remove_item(self, owner: str, conversation_id: str, item_id: str) -> bool:
        with self._lock:
            found = self._find(owner, conversation_id)
            item = found.items.pop(item_id, None) if found is not None else None
            if found is None or item is None:
                return False
            size = _size(item)
            found.bytes -= size
            self._bytes[owner] = self._bytes.get(owner, 0) - size
            return True

    def _find(self, owner: str, conversation_id: str) -> Conversation | None:
        return self._all.get(owner, {}).get(conversation_id)

    def _append(self, owner: str, conversation: Conversation, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """All the items or none (LimitReached past a bound); as kept."""
        kept, size = fresh_ids(items, conversation.items.__contains__)
        self.limits.check(len(conversation.items) + len(kept), self._bytes.get(owner, 0) + size)
        conversation.items.update((item["id"], item) for item in kept)
        conversation.bytes += size
        self._bytes[owner] = self._bytes.get(owner, 0) + size
        return kept


def _size(item: dict[str, Any]) -> int:
    return len(json.dumps(item))


def fresh_ids(items: list[dict[str, Any]], taken: Callable[[str], bool]) -> tuple[list[dict[str, Any]], int]:
    """The items as a conversation keeps them, each id `taken` already (or earlier in the list) replaced by one of
    ours; and their size as JSON."""
    kept: list[dict[str, Any]] = []
    seen: set[str] = set()
    for item in items:
        if item["id"] in seen or taken(item["id"]):  # an id the client chose again: the item is kept under a new one
            item = stored_item({k: v for k, v in item.items() if k != "id"})
        seen.add(item["id"])
        kept.append(item)
    return kept, sum(_size(item) for item in kept)


def stored_item(data: dict[str, Any]) -> dict[str, Any]:
    """An input or output item (JSON) as a conversation keeps it: with an id, a message's text content as a part,
    and a status (OpenAI's Message has one)."""
    data = dict(data)
    if not isinstance(data.get("id"), str) or not _ID.fullmatch(data["id"]):  # none, or one no route could name
        data["id"] = f"{ITEM_PREFIX.get(data.get('type', 'message'), 'item')}_{uuid.uuid4().hex}"
    data.setdefault("type", "message")
    if data["type"] == "message":
        if isinstance(data.get("content"), str):
            kind = "output_text" if data.get("role") == "assistant" else "input_text"
            data["content"] = [{"type": kind, "text": data["content"]}]
        data["content"] = [{**part, "annotations": part.get("annotations") or [], "logprobs": part.get("logprobs") or []}
                           if part.get("type") == "output_text" else part for part in data["content"]]
        data.setdefault("status", "completed")
    return data


def page_of(items: Sequence[dict[str, Any]], order: str, limit: int, after: str | None) -> tuple[list[dict[str, Any]], bool]:
    """One page of items in `order` ("asc" or "desc"), after the item `after` (if any): the page, and whether more
    follow (a 400 naming `after` when no item has that id)."""
    ordered = list(items) if order == "asc" else list(reversed(items))
    if after is not None:
        ids = [i.get("id") for i in ordered]
        if after not in ids:
            raise unknown_after(after)
        ordered = ordered[ids.index(after) + 1:]
    return ordered[:limit], len(ordered) > limit


def unknown_after(after: str) -> InvalidParameter:
    return InvalidParameter(f"after names no item of this list ({after[:64]!r}): give the id of an item it holds.",
                            "after")


class ConversationsService:
    def __init__(self, store: ConversationStore) -> None:
        self.store = store

    def create(self, owner: str, body: CreateConversation) -> ConversationObject:
        return self.store.create(owner, body.metadata or {}, _items(body.items or ()))

    def get(self, owner: str, conversation_id: str) -> ConversationObject:
        return _found(self.store.get(owner, conversation_id), conversation_id)

    def update(self, owner: str, conversation_id: str, body: UpdateConversation) -> ConversationObject:
        return _found(self.store.update(owner, conversation_id, body.metadata), conversation_id)

    def delete(self, owner: str, conversation_id: str) -> DeletedConversation:
        if not self.store.delete(owner, conversation_id):
            raise _not_found(conversation_id)
        return DeletedConversation(id=conversation_id)

    def items(self, owner: str, conversation_id: str, order: str = "desc", limit: int = 20,
              after: str | None = None) -> ConversationItemList:
        page, more = _found(self.store.page(owner, conversation_id, order, limit, after), conversation_id)
        return ConversationItemList(data=page, first_id=page[0]["id"] if page else None,
                                    last_id=page[-1]["id"] if page else None, has_more=more)

    def add(self, owner: str, conversation_id: str, body: AddItems) -> ConversationItemList:
        items = _found(self.store.add(owner, conversation_id, _items(body.items)), conversation_id)
        return ConversationItemList(data=items, first_id=items[0]["id"], last_id=items[-1]["id"], has_more=False)

    def item(self, owner: str, conversation_id: str, item_id: str) -> dict[str, Any]:
        found = self.store.item(owner, conversation_id, item_id)
        if found is None:
            self.get(owner, conversation_id)  # the conversation's 404 first
            raise NotFound(f"Item with id '{item_id}' not found.", param="item_id", code="not_found")
        return found

    def remove_item(self, owner: str, conversation_id: str, item_id: str) -> ConversationObject:
        if not self.store.remove_item(owner, conversation_id, item_id):
            self.get(owner, conversation_id)  # the conversation's 404 first
            raise NotFound(f"Item with id '{item_id}' not found.", param="item_id", code="not_found")
        return self.get(owner, conversation_id)

    def check_room(self, items: int) -> None:
        """LimitReached when a conversation could not hold `items` (a response's room checked before it runs)."""
        self.store.limits.check(items, 0)

    def history(self, owner: str, conversation_id: str) -> list[dict[str, Any]]:
        """Its items, oldest first (a 404 if the owner has no such conversation)."""
        found = self.store.items(owner, conversation_id)
        if found is None:
            raise _not_found(conversation_id)
        return found


def _items(items: Sequence[InputItem]) -> list[dict[str, Any]]:
    return [stored_item(item.model_dump(by_alias=True, exclude_none=True)) for item in items]


def _found(found: T | None, conversation_id: str) -> T:
    if found is None:
        raise _not_found(conversation_id)
    return found


def _not_found(conversation_id: str) -> NotFound:
    return NotFound(f"Conversation with id '{conversation_id}' not found.", param="conversation_id", code="not_found")
