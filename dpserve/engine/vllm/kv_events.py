"""vLLM's prefix-cache events as dpserve's block hashes.

vLLM hashes its blocks its own way (its hash function, its extra keys), so its hashes mean
nothing to dpserve's coordinator. But each ``BlockStored`` carries what dpserve's hash is made
of: the blocks' token ids, the parent block, per block the extra keys (the request's
``cache_salt`` for a prompt's first block) and the LoRA adapter's name. ``KVEventTranslator``
recomputes dpserve's chained hash (``dpserve.block_hash``) from them, remembers which of ours
each of vLLM's hashes is, and turns ``BlockRemoved`` / ``AllBlocksCleared`` into the matching
dpserve events. The coordinator's prefix index then predicts what vLLM's cache holds, as for
dpserve's engine.

The events are read by their class names and fields, not their classes, so this module needs
no vLLM to import (``CollectedEvents`` is what vLLM's scheduler publishes them to).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from dpserve.block_hash import ROOT_HASH, BlockHash, extra_keys, hash_block
from dpserve.engine.kv_events import KVEvent, KVEventKind

log = logging.getLogger(__name__)


class CollectedEvents:
    """Stands in for vLLM's event publisher (its scheduler calls ``publish`` with an event
    batch once per step that changed the cache): keeps the batches for the runner to take."""

    def __init__(self) -> None:
        self._events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self._events.extend(batch.events)

    def take(self) -> list[Any]:
        events, self._events = self._events, []
        return events

    def shutdown(self) -> None:
        self._events = []

    def get_publisher_config(self) -> None:
        return None


def _salt_of(keys: Sequence[Any] | None, lora_name: str | None) -> str | None:
    """The cache_salt among one block's extra keys: vLLM puts the LoRA adapter's name first
    (when the request names one), then multimodal (identifier, offset) pairs, the salt, and
    prompt-embedding digests. dpserve requests carry no multimodal input or embeddings, so
    the one string after the adapter's name is the salt."""
    strings = [key for key in keys or () if isinstance(key, str)]
    if lora_name is not None and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[-1] if strings else None


class KVEventTranslator:
    """vLLM's events for one cache of ``block_size``-token blocks -> ``KVEvent``s."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._ours: dict[Hashable, BlockHash] = {}  # vLLM's hash -> dpserve's
        self._extra: dict[BlockHash, bytes] = {}  # dpserve's hash -> the extra keys it mixes in
        # vLLM may hold one hash in several blocks (a block computed twice before it was
        # cached): dpserve's hash is gone only when the last of them is.
        self._copies: Counter[Hashable] = Counter()

    def translate(self, events: Iterable[Any]) -> list[KVEvent]:
        out: list[KVEvent] = []
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                stored = self._stored(event)
                if stored is not None:
                    out.append(stored)
            elif kind == "BlockRemoved":
                removed = self._removed(event.block_hashes)
                if removed:
                    out.append(KVEvent(KVEventKind.REMOVED, removed))
            elif kind == "AllBlocksCleared":
                self._ours.clear()
                self._extra.clear()
                self._copies.clear()
                out.append(KVEvent(KVEventKind.CLEARED))
        return out

    def snapshot(self) -> list[BlockHash]:
        """Every dpserve hash vLLM's cache holds now."""
        return list(self._ours.values())

    def _stored(self, event: Any) -> KVEvent | None:
        if event.block_size != self.block_size:
            log.warning(
                "ignoring vLLM KV event for %d-token blocks (this engine reports %d-token ones)",
                event.block_size,
                self.block_size,
            )
            return None
        vllm_parent = event.parent_block_hash
        if vllm_parent is None:
            parent = ROOT_HASH
            lora_name = getattr(event, "lora_name", None)
            first_keys = event.extra_keys[0] if event.extra_keys else None
            extra = extra_keys(_salt_of(first_keys, lora_name), lora_name)
        elif vllm_parent in self._ours:
            parent = self._ours[vllm_parent]
            extra = self._extra[parent]
        else:
            # The parent's own event was never seen (events started after it was cached):
            # its chain cannot be computed, and the coordinator learns it from a later one.
            log.debug("vLLM stored blocks under an unknown parent: not reported")
            return None
        first_parent = parent
        hashes: list[BlockHash] = []
        tokens = event.token_ids
        size = self.block_size
        for index, vllm_hash in enumerate(event.block_hashes):
            parent = hash_block(parent, tokens[index * size : (index + 1) * size], extra)
            self._copies[vllm_hash] += 1
            self._ours[vllm_hash] = parent
            self._extra[parent] = extra
            hashes.append(parent)
        return KVEvent(KVEventKind.STORED, hashes, first_parent)

    def _removed(self, vllm_hashes: Iterable[Hashable]) -> list[BlockHash]:
        removed: list[BlockHash] = []
        for vllm_hash in vllm_hashes:
            if vllm_hash not in self._ours:
                continue
            self._copies[vllm_hash] -= 1
            if self._copies[vllm_hash] > 0:
                continue
            del self._copies[vllm_hash]
            ours = self._ours.pop(vllm_hash)
            self._extra.pop(ours, None)
            removed.append(ours)
        return removed
