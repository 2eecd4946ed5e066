"""The fake engine's prefix cache: which prompt blocks a real engine would hold, without memory.

It hashes prompts exactly as the paged pool does (``dpserve.block_hash``, whole blocks, never the
last token), keeps up to ``capacity_blocks`` hashes in an LRU, and reports the same KV events, so
the coordinator's index and routing can be tested and benchmarked at many engines without a
model. The fake runner charges a prefill cost per token it did not find here.
"""

from __future__ import annotations

from collections import OrderedDict

from dpserve.block_hash import ROOT_HASH, BlockHash, block_hashes
from dpserve.engine.kv_events import KVEvent, KVEventKind


class SimulatedPrefixCache:
    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        if capacity_blocks < 1 or block_size < 1:
            raise ValueError("the simulated cache needs capacity_blocks >= 1 and block_size >= 1")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()
        self.events: list[KVEvent] = []
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of them found (prefix_cache_hits)
        self.evictions = 0

    def admit(self, prompt: list[int], extra: bytes) -> int:
        """Look a prompt up, then hold all its full blocks; the tokens found cached."""
        hashes = block_hashes(prompt, self.block_size, extra)
        usable = (len(prompt) - 1) // self.block_size
        hit = 0
        for block_hash in hashes[:usable]:
            if block_hash not in self._lru:
                break
            hit += 1
        self.queries += len(prompt)
        self.hits += hit * self.block_size
        for index, block_hash in enumerate(hashes):
            if block_hash in self._lru:
                self._lru.move_to_end(block_hash)
            else:
                self._lru[block_hash] = None
                self._stored(block_hash, hashes[index - 1] if index else ROOT_HASH)
        while len(self._lru) > self.capacity_blocks:
            evicted, _ = self._lru.popitem(last=False)
            self.evictions += 1
            self.events.append(KVEvent(KVEventKind.REMOVED, [evicted]))
        return hit * self.block_size

    def _stored(self, block_hash: BlockHash, parent: BlockHash) -> None:
        last = self.events[-1] if self.events else None
        if last is not None and last.kind is KVEventKind.STORED and last.hashes[-1] == parent:
            last.hashes.append(block_hash)
        else:
            self.events.append(KVEvent(KVEventKind.STORED, [block_hash], parent))

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def snapshot(self) -> list[BlockHash]:
        return list(self._lru)

    def held(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)
