"""KV events: what an engine tells the coordinator about the block hashes its cache holds.

The pool (``paged.block_pool.BlockPool``, or the fake engine's simulated cache) appends
``KVEvent``s as blocks get hashes or lose them; ``KVEventPublisher`` turns them into KV_EVENTS
messages: numbered per engine incarnation (the coordinator sees a gap as lost events and asks
for a snapshot), at most ``max_hashes_per_message`` hashes each, and a snapshot (a *cleared*
event and every hash held) after each registration or when asked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol, runtime_checkable

from dpserve.block_hash import BlockHash, pack_hashes
from dpserve.limits import DEFAULT_PREFIX_CACHE_LIMITS
from dpserve.protocol import KvEvent, KvEvents


class KVEventKind(IntEnum):
    """The wire numbers of ``protocol.KvEvent.kind``."""

    STORED = 0  # full blocks got hashes: their content can be reused
    REMOVED = 1  # evicted: their hashes are gone
    CLEARED = 2  # every hash is gone (the pool was released)


@dataclass(slots=True)
class KVEvent:
    kind: KVEventKind
    hashes: list[BlockHash] = field(default_factory=list)
    # STORED: the hash of the block before the first one (ROOT_HASH for a prompt's first).
    parent: BlockHash | None = None


@runtime_checkable
class ReportsKVEvents(Protocol):
    """A runner with a prefix cache (the model runner's paged backend, the fake runner)."""

    @property
    def kv_block_size(self) -> int | None:
        """Tokens per block; None when this runner has no prefix cache to report."""

    def kv_events(self) -> list[KVEvent]:
        """The changes since the last call (taken: the next call returns only newer ones)."""

    def kv_snapshot(self) -> list[BlockHash]:
        """Every hash held now."""


class KVEventPublisher:
    """Numbers and splits one engine incarnation's events into KV_EVENTS messages."""

    def __init__(
        self,
        instance: str,
        block_size: int,
        max_hashes: int = DEFAULT_PREFIX_CACHE_LIMITS.max_hashes_per_message,
    ) -> None:
        if max_hashes < 1:
            raise ValueError(f"max_hashes must be >= 1, got {max_hashes}")
        self.instance = instance
        self.block_size = block_size
        self.max_hashes = max_hashes
        self.next_number = 0

    def messages(self, events: list[KVEvent]) -> list[KvEvents]:
        """``events`` as messages, in order; none when there are none."""
        batches: list[KvEvents] = []
        current: list[KvEvent] = []
        room = self.max_hashes
        for event in events:
            for piece in self._pieces(event):
                count = len(piece.hashes) // 8
                if count > room and current:
                    batches.append(self._batch(current))
                    current, room = [], self.max_hashes
                current.append(piece)
                room -= max(count, 1)
        if current:
            batches.append(self._batch(current))
        return batches

    def snapshot(self, hashes: list[BlockHash]) -> list[KvEvents]:
        """A full report: everything before is cleared, then every held hash is stored."""
        events = [KVEvent(KVEventKind.CLEARED)]
        if hashes:
            events.append(KVEvent(KVEventKind.STORED, hashes, None))
        return self.messages(events)

    def _pieces(self, event: KVEvent) -> Iterator[KvEvent]:
        """The event on the wire, split so that no piece has more than ``max_hashes``."""
        if event.kind is KVEventKind.CLEARED:
            yield KvEvent(int(event.kind), b"", None)
            return
        parent = event.parent
        for start in range(0, len(event.hashes), self.max_hashes):
            chunk = event.hashes[start : start + self.max_hashes]
            yield KvEvent(int(event.kind), pack_hashes(chunk), parent)
            if parent is not None:
                parent = chunk[-1]  # the next piece of a stored chain continues this one

    def _batch(self, events: list[KvEvent]) -> KvEvents:
        batch = KvEvents(self.instance, self.next_number, self.block_size, events)
        self.next_number += 1
        return batch


Send = Callable[[KvEvents], None]
