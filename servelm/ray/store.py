"""The stored responses and conversations under `--ray`: one named Ray actor holds each store (service/store.py's
MemoryStore and service/conversations.py's MemoryConversations, with the server's bounds), and every ingress replica
reaches it by name, so a response or conversation kept through one is read, continued or deleted through any other,
and outlives the restart of the replica that stored it."""

from __future__ import annotations

from typing import Any

import ray

from servelm.protocol.conversations import ConversationObject
from servelm.service.conversations import ConversationLimits, MemoryConversations
from servelm.service.store import MemoryStore, StoredResponse, StoreLimits

ACTOR_NAME = "servelm-response-store"
ACTOR_NAMESPACE = "servelm"  # the same for every replica, whichever namespace Ray Serve runs it in


@ray.remote(num_cpus=0)
class StoreActor:
    def __init__(self, limits: StoreLimits) -> None:
        self.store = MemoryStore(limits.max_entries, limits.max_bytes, limits.max_age_s)

    def put(self, owner: str, response_id: str, entry: StoredResponse) -> None:
        self.store.put(owner, response_id, entry)

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        return self.store.get(owner, response_id)

    def delete(self, owner: str, response_id: str) -> bool:
        return self.store.delete(owner, response_id)

    def claim(self, owner: str, key: str) -> bool:
        return self.store.claim(owner, key)


class RayStore:
    """A ResponseStore whose entries live in the shared actor (created by the first replica that asks). Called
    from worker threads (the services prepare off the event loop), so its calls may block on the actor."""

    kept = "ray actor"  # what /health's `kept` says: it outlives an ingress replica, not the cluster

    def __init__(self, limits: StoreLimits) -> None:
        options = {"name": ACTOR_NAME, "namespace": ACTOR_NAMESPACE, "get_if_exists": True, "lifetime": "detached"}
        self._actor = StoreActor.options(**options).remote(limits)  # type: ignore[attr-defined]  # ray.remote adds it

    def put(self, owner: str, response_id: str, entry: StoredResponse) -> None:
        ray.get(self._actor.put.remote(owner, response_id, entry))

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        found: StoredResponse | None = ray.get(self._actor.get.remote(owner, response_id))
        return found

    def delete(self, owner: str, response_id: str) -> bool:
        deleted: bool = ray.get(self._actor.delete.remote(owner, response_id))
        return deleted

    def claim(self, owner: str, key: str) -> bool:
        first: bool = ray.get(self._actor.claim.remote(owner, key))
        return first


CONVERSATIONS_ACTOR = "servelm-conversations"


@ray.remote(num_cpus=0)
class ConversationsActor:
    def __init__(self, limits: ConversationLimits) -> None:
        self.store = MemoryConversations(limits)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.store, method)(*args)


class RayConversations:
    """A ConversationStore whose conversations live in one shared actor, as RayStore's responses do (a
    ConversationsService error, such as a bound reached, comes back as itself)."""

    kept = "ray actor"

    def __init__(self, limits: ConversationLimits) -> None:
        options = {"name": CONVERSATIONS_ACTOR, "namespace": ACTOR_NAMESPACE, "get_if_exists": True,
                   "lifetime": "detached"}
        self._actor = ConversationsActor.options(**options).remote(limits)  # type: ignore[attr-defined]
        self.limits = limits

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return ray.get(self._actor.call.remote(method, *args))
        except ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None

    def create(self, owner: str, metadata: dict[str, str], items: list[dict[str, Any]]) -> ConversationObject:
        created: ConversationObject = self._call("create", owner, metadata, items)
        return created

    def get(self, owner: str, conversation_id: str) -> ConversationObject | None:
        found: ConversationObject | None = self._call("get", owner, conversation_id)
        return found

    def update(self, owner: str, conversation_id: str, metadata: dict[str, str]) -> ConversationObject | None:
        found: ConversationObject | None = self._call("update", owner, conversation_id, metadata)
        return found

    def delete(self, owner: str, conversation_id: str) -> bool:
        return bool(self._call("delete", owner, conversation_id))

    def add(self, owner: str, conversation_id: str, items: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        kept: list[dict[str, Any]] | None = self._call("add", owner, conversation_id, items)
        return kept

    def items(self, owner: str, conversation_id: str) -> list[dict[str, Any]] | None:
        found: list[dict[str, Any]] | None = self._call("items", owner, conversation_id)
        return found

    def page(self, owner: str, conversation_id: str, order: str, limit: int,
             after: str | None) -> tuple[list[dict[str, Any]], bool] | None:
        found: tuple[list[dict[str, Any]], bool] | None = self._call("page", owner, conversation_id, order, limit, after)
        return found

    def item(self, owner: str, conversation_id: str, item_id: str) -> dict[str, Any] | None:
        found: dict[str, Any] | None = self._call("item", owner, conversation_id, item_id)
        return found

    def remove_item(self, owner: str, conversation_id: str, item_id: str) -> bool:
        return bool(self._call("remove_item", owner, conversation_id, item_id))
