"""The PrefixAffinityRouter's policy without a cluster: replicas are stand-ins with a queue length each."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytestmark = pytest.mark.ray


@dataclass
class FakeReplica:
    """What the router reads of Ray Serve's RunningReplica."""

    replica_id: object
    queue_len: int = 0
    max_ongoing_requests: int = 16
    routing_stats: dict | None = None  # what ModelReplica.record_routing_stats said (None: nothing yet)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def make_router(**state):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from servelm.ray.router import PrefixAffinityRouter

    router = PrefixAffinityRouter(DeploymentID("model", "app"), DeploymentHandleSource.UNKNOWN,
                                  use_replica_queue_len_cache=True)
    router.initialize_state(block_tokens=4, **state)
    return router


def replicas(*loads: int) -> list[FakeReplica]:
    from ray.serve._private.common import DeploymentID, ReplicaID

    return [FakeReplica(ReplicaID(f"r{i}", DeploymentID("model", "app")), n) for i, n in enumerate(loads)]


def pending(prompt: list[int], method: str = "generate", hint: str = "", adapters: tuple = ()):
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    from servelm.engine.types import GenerationRequest, SamplingParams

    request = GenerationRequest("req", tuple(prompt), SamplingParams(max_tokens=4), cache_hint=hint, adapters=adapters)
    return PendingRequest(args=[request], kwargs={}, metadata=RequestMetadata("id", "internal", call_method=method))


def with_loads(router, rs: list[FakeReplica]) -> None:
    for r in rs:
        router.replica_queue_len_cache.update(r.replica_id, r.queue_len)


async def routed(router, rs: list[FakeReplica], prompt: list[int], adapters: tuple = ()) -> list[list[str]]:
    with_loads(router, rs)
    ranks = await router.choose_replicas(rs, pending(prompt, adapters=adapters))
    return [sorted(r.replica_id.unique_id for r in rank) for rank in ranks]


CONVERSATION = list(range(100, 164))  # 16 blocks of 4


async def test_a_new_prompt_goes_to_every_replica_so_the_least_loaded_wins() -> None:
    router = make_router()
    assert await routed(router, replicas(0, 3), CONVERSATION) == [["r0", "r1"]]


async def test_a_known_prefix_goes_to_its_replica_first() -> None:
    router = make_router()
    rs = replicas(2, 0)
    router.on_request_routed(pending(CONVERSATION[:40]), rs[0].replica_id, None)
    assert await routed(router, rs, CONVERSATION) == [["r0"], ["r0", "r1"]]


async def test_an_overloaded_holder_is_passed_over() -> None:
    router = make_router(imbalance=4)
    rs = replicas(9, 0)
    router.on_request_routed(pending(CONVERSATION), rs[0].replica_id, None)
    assert await routed(router, rs, CONVERSATION) == [["r0", "r1"]]


async def test_a_short_shared_preamble_only_breaks_ties() -> None:
    router = make_router(imbalance=4)
    rs = replicas(1, 0)
    router.on_request_routed(pending(CONVERSATION[:4]), rs[0].replica_id, None)  # 4 of 64 tokens in common
    assert await routed(router, rs, CONVERSATION) == [["r0", "r1"]]
    assert await routed(router, replicas(0, 0), CONVERSATION) == [["r0"], ["r0", "r1"]]


async def test_other_methods_are_not_affine() -> None:
    router = make_router()
    rs = replicas(0, 0)
    router.on_request_routed(pending(CONVERSATION), rs[0].replica_id, None)
    with_loads(router, rs)
    ranks = await router.choose_replicas(rs, pending(CONVERSATION, method="embed"))
    assert [len(rank) for rank in ranks] == [2]


async def test_a_dead_replica_is_forgotten() -> None:
    router = make_router()
    rs = replicas(0, 0)
    router.on_request_routed(pending(CONVERSATION), rs[0].replica_id, None)
    router.on_replica_actor_died(rs[0].replica_id)
    assert await routed(router, rs[1:], CONVERSATION) == [["r1"]]
    assert router._state().match(router._state().keys(CONVERSATION)) == []


async def test_stale_loads_are_probed() -> None:
    router = make_router(imbalance=4)
    rs = replicas(9, 0)
    router.on_request_routed(pending(CONVERSATION), rs[0].replica_id, None)
    ranks = await router.choose_replicas(rs, pending(CONVERSATION))  # no cached counts: asked of the replicas
    assert [len(rank) for rank in ranks] == [2]


async def test_a_prompt_cache_key_goes_to_the_replica_its_key_went_to() -> None:
    """OpenAI's prompt_cache_key: requests that share one go to one replica, even with no prompt in common,
    unless it is overloaded."""
    router = make_router(imbalance=4)
    rs = replicas(2, 0)
    router.on_request_routed(pending(CONVERSATION, hint="scope\x00user-7"), rs[0].replica_id, None)
    other = list(range(500, 564))
    assert await routed(router, rs, other) == [["r0", "r1"]], "no hint: no affinity"
    with_loads(router, rs)
    ranks = await router.choose_replicas(rs, pending(other, hint="scope\x00user-7"))
    assert [sorted(r.replica_id.unique_id for r in rank) for rank in ranks] == [["r0"], ["r0", "r1"]]
    with_loads(router, replicas(9, 0))
    ranks = await router.choose_replicas(replicas(9, 0), pending(other, hint="scope\x00user-7"))
    assert [len(rank) for rank in ranks] == [2], "an overloaded replica is passed over"
    router.on_replica_actor_died(rs[0].replica_id)
    assert router._hints == {}


TWO = (("two", 1.0),)


async def test_a_replica_without_the_model_loaded_comes_last() -> None:
    """An on-demand model's replica that joined since its load has no model yet: the others are preferred, even
    over a deeper prefix match there."""
    router = make_router()
    rs = replicas(0, 5, 5)
    rs[0].routing_stats = {"loaded": False, "adapters": []}
    router.on_request_routed(pending(CONVERSATION), rs[0].replica_id, None)
    assert await routed(router, rs, CONVERSATION) == [["r1", "r2"], ["r0", "r1", "r2"]]


async def test_a_request_on_an_adapter_goes_where_it_is_loaded_then_by_prefix() -> None:
    router = make_router()
    rs = replicas(3, 0, 0)
    rs[0].routing_stats = {"loaded": True, "adapters": ["two"]}
    rs[1].routing_stats = {"loaded": True, "adapters": ["two"]}
    rs[2].routing_stats = {"loaded": True, "adapters": []}
    assert await routed(router, rs, CONVERSATION, TWO) == [["r0", "r1"], ["r0", "r1", "r2"]]
    assert await routed(router, rs, CONVERSATION) == [["r0", "r1", "r2"]], "the base model: every replica holds it"
    router.on_request_routed(pending(CONVERSATION, adapters=TWO), rs[0].replica_id, None)
    assert await routed(router, rs, CONVERSATION, TWO) == [["r0"], ["r0", "r1"], ["r0", "r1", "r2"]]


async def test_the_prefix_table_is_keyed_by_adapter() -> None:
    """A prompt read under one adapter is no prefix of the same prompt on the base model or another adapter."""
    router = make_router()
    rs = replicas(0, 0)
    router.on_request_routed(pending(CONVERSATION, adapters=TWO), rs[0].replica_id, None)
    assert await routed(router, rs, CONVERSATION) == [["r0", "r1"]]
    assert await routed(router, rs, CONVERSATION, (("three", 1.0),)) == [["r0", "r1"]]
    assert (await routed(router, rs, CONVERSATION, TWO))[0] == ["r0"]


async def test_an_adapter_just_sent_to_a_replica_counts_as_loaded_there() -> None:
    """Routing stats lag a second: a replica the router just sent an adapter's request to holds it meanwhile."""
    router = make_router()
    rs = replicas(0, 0)
    router.on_request_routed(pending([1, 2, 3], adapters=TWO), rs[1].replica_id, None)
    assert await routed(router, rs, CONVERSATION, TWO) == [["r1"], ["r0", "r1"]]
