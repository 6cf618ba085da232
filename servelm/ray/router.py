"""PrefixAffinityRouter: Ray Serve's request router for a model deployment, aware of the replicas' prefix caches.

Ray Serve runs one router per deployment handle, inside the process that holds the handle (here the
ingress), on its own event loop. For each `generate` call it asks `choose_replicas` for ranked candidates and
then sends the request to the least loaded replica of the first rank that has room (load: the replica's
requests in flight, which is its engine's running plus waiting, as Ray Serve counts them: cached, updated on
every send and completion, and probed when stale).

The policy:
0. Prefer the replicas that hold what the request runs on: the model loaded (an on-demand model's replica that
   joined since may not have it) and every LoRA adapter it names loaded (each replica loads its own, at most
   --max-loras), as the replicas' routing stats say (`ModelReplica.record_routing_stats`, every second) or as
   this router sent them in the last few seconds. Steps 1-3 run among them; every replica stays the last rank.
1. Cut the prompt's token ids into blocks (the chain starting from the request's cache scope and its adapters)
   and look them up in the PrefixTable: the replicas that were sent a prompt with the same beginning, deepest
   match first.
2. Take the deepest-matching replica whose load is at most `imbalance × matched share` above the least
   loaded replica's (matched share: the part of the prompt it was sent before): its prefix cache most likely
   still holds the prompt's beginning (a conversation's earlier turns, a shared system prompt). The more of
   the prompt it would not read again, the more extra load it may carry; a short shared preamble (a chat
   template's default system prompt) only breaks ties. It is the first rank, every replica the second
   (should it be full).
3. Otherwise (no match, or every match overloaded): every replica in one rank, so the least loaded wins
   (ties broken at random).

Once a replica accepted a request (`on_request_routed`), the prompt's blocks are recorded as its own. Replicas
that die or are scaled away are forgotten. Other methods (embed, stats, describe) go to the least loaded.
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from servelm.engine.types import GenerationRequest, adapter_scope
from servelm.ray.prefix_table import PrefixTable

log = logging.getLogger("servelm.ray")

RECENT_S = 3.0  # an adapter sent to a replica this recently counts as loaded there (routing stats lag a second)
MAX_HINTS = 100_000  # prompt_cache_keys remembered (least recently routed forgotten first)
DEFAULT_IMBALANCE = 4  # requests in flight an affine replica may have above the least loaded one


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, block_tokens: int = 16, max_blocks: int = 200_000,
                         imbalance: int = DEFAULT_IMBALANCE, **_: Any) -> None:
        self._table = PrefixTable(block_tokens, max_blocks)
        self._imbalance = imbalance
        self._known: set[str] = set()
        self._hints: OrderedDict[str, str] = OrderedDict()  # prompt_cache_key (in its scope) -> replica, LRU
        self._sent: dict[str, dict[str, float]] = {}  # replica -> adapter -> when a request on it was last sent there

    def _state(self) -> PrefixTable:
        if not hasattr(self, "_table"):  # Ray Serve may update replicas before initialize_state
            self.initialize_state()
        return self._table

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))
        request = generation_request(pending_request)
        if request is None or len(shuffled) < 2:
            return [shuffled]
        table = self._state()
        ready = [r for r in shuffled if self._holds(r, request.adapters)]
        pool = ready if ready else shuffled
        fallback = [pool, shuffled] if len(pool) < len(shuffled) else [shuffled]
        if len(pool) < 2:
            return fallback
        matches = table.match(table.keys(request.prompt_token_ids, adapter_scope(request.cache_scope, request.adapters)))
        hinted = self._hints.get(request.cache_hint) if request.cache_hint else None
        if hinted is not None:  # the client's prompt_cache_key: its replica first, as if it held the whole prompt
            matches = [(hinted, len(request.prompt_token_ids)), *matches]
        if not matches:
            return fallback
        loads = await self._loads(pool)
        least = min(loads.values(), default=0)
        by_id = {r.replica_id.unique_id: r for r in pool}
        for rid, tokens in matches:
            replica = by_id.get(rid)
            allowed = self._imbalance * tokens / len(request.prompt_token_ids)
            if replica is not None and loads.get(rid, least) - least <= allowed:
                return [[replica], *fallback]
        return fallback

    def _holds(self, replica: RunningReplica, adapters: tuple[tuple[str, float], ...]) -> bool:
        """Whether the replica has the model loaded and every adapter (its routing stats, or sent here lately)."""
        stats = getattr(replica, "routing_stats", None) or {}
        if not stats.get("loaded", True):
            return False
        if not adapters:
            return True
        rid = replica.replica_id.unique_id
        recent = time.monotonic() - RECENT_S
        held = set(stats.get("adapters", ())) | {a for a, at in self._sent.get(rid, {}).items() if at >= recent}
        return all(name in held for name, _ in adapters)

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Requests in flight per replica: from Ray Serve's cache, probing the replicas it has no fresh count of."""
        loads: dict[str, int] = {}
        stale: list[RunningReplica] = []
        for r in replicas:
            n = self.replica_queue_len_cache.get(r.replica_id)
            if n is None:
                stale.append(r)
            else:
                loads[r.replica_id.unique_id] = n
        if stale:
            for r, n in await self._probe_queue_lens(stale, 0):
                if n is not None:
                    loads[r.replica_id.unique_id] = n
        return loads

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = generation_request(pending_request)
        if request is not None:
            table = self._state()
            rid = replica_id.unique_id
            table.insert(table.keys(request.prompt_token_ids, adapter_scope(request.cache_scope, request.adapters)), rid)
            if request.adapters:
                now = time.monotonic()
                self._sent.setdefault(rid, {}).update({name: now for name, _ in request.adapters})
            if request.cache_hint:
                self._hints[request.cache_hint] = replica_id.unique_id
                self._hints.move_to_end(request.cache_hint)
                if len(self._hints) > MAX_HINTS:
                    self._hints.popitem(last=False)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        table = self._state()
        now = {r.replica_id.unique_id for r in replicas}
        table.forget(self._known - now)
        self._forget_replicas(self._known - now)
        self._known = now

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._state().forget([replica_id.unique_id])
        self._forget_replicas({replica_id.unique_id})
        log.warning("replica %s died: its prefixes are forgotten", replica_id.unique_id)

    def _forget_replicas(self, replicas: set[str]) -> None:
        """Their hints and the adapters sent to them (their prefixes are the table's to forget)."""
        for rid in replicas:
            self._sent.pop(rid, None)
        for hint in [h for h, r in self._hints.items() if r in replicas]:
            del self._hints[hint]


def generation_request(pending_request: PendingRequest | None) -> GenerationRequest | None:
    """The GenerationRequest of a `generate` call, or None for any other call."""
    if pending_request is None or pending_request.metadata.call_method != "generate" or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if isinstance(request, GenerationRequest) else None
