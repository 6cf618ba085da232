"""The stored responses under `--ray`: one named Ray actor holds the store (service/store.py's MemoryStore, with
the server's bounds), and every ingress replica reaches it by name, so a response stored through one is read,
continued or deleted through any other, and outlives the restart of the replica that stored it."""

from __future__ import annotations

import ray

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
