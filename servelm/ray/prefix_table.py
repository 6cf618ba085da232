"""PrefixTable: which replicas were last sent a prompt beginning with these tokens.

A prompt is cut into blocks of `block_tokens` token ids; block i's key hashes block i's tokens together with
block i-1's key, so one key stands for the whole prefix up to the end of its block (the scheme of vLLM's
and SGLang's prefix caches, kept here on the router's side). Each key remembers the few replicas most
recently sent a prompt with that prefix. `match` walks a new prompt's keys from the start and reports, for
every replica found, how many leading tokens it was sent: the deeper the match, the more of the prompt that
replica's prefix cache may still hold.

The table is bounded: past `max_blocks` keys the least recently used go first. It is a hint, never a
promise: the replica's own cache decides what it reuses (and reports it as cached_tokens).

Pure data: no Ray, no asyncio; the router calls it from one event loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

HOLDERS_PER_BLOCK = 4  # replicas remembered per prefix (a shared system prompt may live on several)


def block_keys(tokens: Sequence[int], block_tokens: int, scope: str = "") -> list[int]:
    """One key per whole block of the prompt, each covering everything before it (a partial tail has none). The
    chain starts from the request's prefix-cache scope, so the same prompt under two API keys (or salts) shares
    no key: routing never follows another key's prefix (the replica's own cache would not share it either)."""
    keys: list[int] = []
    key = hash(scope) if scope else 0
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        key = hash((key, tuple(tokens[start:start + block_tokens])))
        keys.append(key)
    return keys


class PrefixTable:
    def __init__(self, block_tokens: int = 16, max_blocks: int = 200_000) -> None:
        if block_tokens < 1 or max_blocks < 1:
            raise ValueError("block_tokens and max_blocks must be at least 1")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self._holders: OrderedDict[int, list[str]] = OrderedDict()  # key → replicas, most recent last

    def __len__(self) -> int:
        return len(self._holders)

    def keys(self, tokens: Sequence[int], scope: str = "") -> list[int]:
        return block_keys(tokens, self.block_tokens, scope)

    def match(self, keys: Sequence[int]) -> list[tuple[str, int]]:
        """(replica, tokens matched) for every replica holding a leading run of `keys`, deepest first (ties:
        the most recently sent first)."""
        depth: dict[str, int] = {}
        for i, key in enumerate(keys):
            holders = self._holders.get(key)
            if not holders:
                break
            for r in holders:
                if depth.get(r, 0) == i:  # held every block before this one too
                    depth[r] = i + 1

        def rank(r: str) -> tuple[int, int]:  # deeper first; then the latest holder of its last block
            d = depth[r]
            return -d, -self._holders[keys[d - 1]].index(r)

        return [(r, depth[r] * self.block_tokens) for r in sorted(depth, key=rank)]

    def insert(self, keys: Iterable[int], replica: str) -> None:
        """Remember that `replica` was sent a prompt with these blocks (the most recent holder of each)."""
        for key in keys:
            holders = self._holders.get(key)
            if holders is None:
                self._holders[key] = [replica]
            else:
                if replica in holders:
                    holders.remove(replica)
                holders.append(replica)
                del holders[:-HOLDERS_PER_BLOCK]
                self._holders.move_to_end(key)
        while len(self._holders) > self.max_blocks:
            self._holders.popitem(last=False)

    def forget(self, replicas: Iterable[str]) -> None:
        """Drop replicas that are gone (dead, scaled down) from every key."""
        gone = set(replicas)
        if not gone:
            return
        for key in list(self._holders):
            holders = [r for r in self._holders[key] if r not in gone]
            if holders:
                self._holders[key] = holders
            else:
                del self._holders[key]

