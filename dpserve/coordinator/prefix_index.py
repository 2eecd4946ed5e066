"""``PrefixIndex``: which engines hold which KV-cache blocks, from their KV events.

Each engine's events (``protocol.KvEvents``) say which block hashes (``dpserve.block_hash``)
its cache gained and lost. The index keeps, per hash, the engines that hold it, plus
*predictions*: after a request is routed to an engine, that engine is counted as holding the
request's blocks until a TTL passes (its events normally confirm it long before), so a burst
of requests with the same prefix lands together instead of spreading before the first one has
even been prefilled.

It stays true under faults:

* an engine that leaves or dies: ``remove_engine`` drops all it held (re-dispatch then finds
  only the survivors);
* a restarted engine registers with a new instance id: a new, empty entry; events of the old
  instance are ignored;
* events are numbered per instance: a gap drops the engine's entries and asks for a snapshot
  (``apply`` returns True), and nothing is applied until a batch that starts with *cleared*;
* a restarted coordinator starts empty and fills from the snapshots engines send when they
  register again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice, takewhile

from dpserve.block_hash import BlockHash, unpack_hashes
from dpserve.limits import DEFAULT_PREFIX_CACHE_LIMITS
from dpserve.protocol import KvEvents, ProtocolError

STORED, REMOVED, CLEARED = 0, 1, 2


@dataclass(slots=True, eq=False)
class EngineCache:
    instance: str
    block_size: int | None = None  # known from the engine's first events
    hashes: set[BlockHash] = field(default_factory=set)
    next_number: int | None = None  # None: waiting for a snapshot
    predicted: dict[BlockHash, float] = field(default_factory=dict)  # hash -> expiry


class PrefixIndex:
    def __init__(
        self,
        prediction_ttl: float = 2.0,
        max_hashes_per_engine: int = DEFAULT_PREFIX_CACHE_LIMITS.max_hashes_per_engine,
    ) -> None:
        self.prediction_ttl = prediction_ttl
        self.max_hashes_per_engine = max_hashes_per_engine
        self.engines: dict[bytes, EngineCache] = {}
        self.holders: dict[BlockHash, set[bytes]] = {}
        self._expiring: deque[tuple[float, bytes, list[BlockHash]]] = deque()
        self.gaps = 0  # event batches found missing (each asked for a snapshot)
        self.stale_batches = 0  # from an instance that is not the registered one
        # The smallest block size any engine reported (None: none yet): a prompt of no more
        # tokens cannot have a cached block anywhere, and is routed without hashing it.
        self.smallest_block_size: int | None = None

    # ------------------------------------------------------------------ membership

    def add_engine(self, identity: bytes, instance: str) -> None:
        """A (re)registered engine: an empty entry, filled by the snapshot it sends next."""
        existing = self.engines.get(identity)
        if existing is not None and existing.instance == instance:
            return  # a repeated REGISTER of the same process
        self.remove_engine(identity)
        self.engines[identity] = EngineCache(instance)

    def remove_engine(self, identity: bytes) -> None:
        cache = self.engines.pop(identity, None)
        if cache is not None:
            self._drop_all(identity, cache)
            self._block_sizes_changed()

    # ---------------------------------------------------------------------- events

    def apply(self, identity: bytes, batch: KvEvents) -> bool:
        """Apply one KV_EVENTS batch; True when the engine must be asked for a snapshot.
        Raises ``ProtocolError`` for a malformed batch (nothing applied)."""
        cache = self.engines.get(identity)
        if cache is None:
            return False
        if batch.instance != cache.instance:
            self.stale_batches += 1
            return False
        events = self._checked(batch)
        resyncs = bool(events) and events[0][0] == CLEARED
        if not resyncs:
            if cache.next_number is None:
                return False  # waiting for the snapshot already asked for
            if batch.number != cache.next_number:
                self.gaps += 1
                self._drop_all(identity, cache)
                cache.next_number = None
                return True
        cache.next_number = batch.number + 1
        if cache.block_size != batch.block_size:
            self._drop_all(identity, cache)
            cache.block_size = batch.block_size
            self._block_sizes_changed()
        for kind, hashes, _parent in events:
            if kind == CLEARED:
                self._drop_all(identity, cache)
            elif kind == STORED:
                self._store(identity, cache, hashes)
            else:
                self._remove(identity, cache, hashes)
        if len(cache.hashes) > self.max_hashes_per_engine:
            self._drop_all(identity, cache)
            cache.next_number = None
            return True
        return False

    @staticmethod
    def _checked(batch: KvEvents) -> list[tuple[int, list[BlockHash], int | None]]:
        if batch.block_size < 1:
            raise ProtocolError(f"KV_EVENTS block size must be >= 1, got {batch.block_size}")
        # ``protocol.decode`` checked each event's shape and types already.
        events = []
        for kind, packed, parent in batch.events:
            if kind not in (STORED, REMOVED, CLEARED):
                raise ProtocolError(f"unknown KV event kind {kind}")
            try:
                events.append((kind, unpack_hashes(packed), parent))
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
        return events

    def _block_sizes_changed(self) -> None:
        sizes = [c.block_size for c in self.engines.values() if c.block_size is not None]
        self.smallest_block_size = min(sizes, default=None)

    def _store(self, identity: bytes, cache: EngineCache, hashes: Iterable[BlockHash]) -> None:
        holders = self.holders
        for block_hash in hashes:
            if block_hash not in cache.hashes:
                cache.hashes.add(block_hash)
                holders.setdefault(block_hash, set()).add(identity)

    def _remove(self, identity: bytes, cache: EngineCache, hashes: Iterable[BlockHash]) -> None:
        holders = self.holders
        for block_hash in hashes:
            cache.predicted.pop(block_hash, None)
            if block_hash in cache.hashes:
                cache.hashes.discard(block_hash)
                engines = holders[block_hash]
                engines.discard(identity)
                if not engines:
                    del holders[block_hash]

    def _drop_all(self, identity: bytes, cache: EngineCache) -> None:
        self._remove(identity, cache, list(cache.hashes))
        cache.predicted.clear()

    # --------------------------------------------------------------------- routing

    def block_size(self, identity: bytes) -> int | None:
        cache = self.engines.get(identity)
        return None if cache is None else cache.block_size

    def predict(self, identity: bytes, hashes: list[BlockHash], now: float) -> None:
        """Count ``identity`` as holding ``hashes`` for ``prediction_ttl`` seconds. ``now``
        never goes back between calls (the router's monotonic clock), so predictions expire in
        the order they were made."""
        self.expire(now)
        cache = self.engines.get(identity)
        if cache is None or not hashes:
            return
        expiry = now + self.prediction_ttl
        cache.predicted.update(dict.fromkeys(hashes, expiry))
        self._expiring.append((expiry, identity, hashes))

    def expire(self, now: float) -> None:
        """Forget the predictions whose TTL passed: afterwards every prediction left is live.
        A hash predicted again later carries a later expiry and stays."""
        expiring = self._expiring
        while expiring and expiring[0][0] <= now:
            expiry, identity, hashes = expiring.popleft()
            cache = self.engines.get(identity)
            if cache is None:
                continue
            predicted = cache.predicted
            # Those of the hashes still at this expiry; found and dropped at C speed (a prompt
            # has hundreds of blocks, and one expires for nearly every request routed).
            stale = predicted.items() & dict.fromkeys(hashes, expiry).items()
            _consume(map(predicted.pop, dict(stale)))

    def matched_blocks(
        self,
        hashes: list[BlockHash],
        identities: Iterable[bytes],
        now: float,
        *,
        confirmed_only: bool = False,
    ) -> dict[bytes, int]:
        """For each engine, how many of ``hashes`` (a prompt's blocks, in order) it holds as a
        prefix: by its events, or (unless ``confirmed_only``) by a live prediction."""
        self.expire(now)  # every prediction left is live: holding one is membership alone
        matched = dict.fromkeys(identities, 0)
        if not hashes:
            return matched
        first, engines = hashes[0], self.engines
        for identity in matched:
            cache = engines.get(identity)
            if cache is None:
                continue
            predicted = None if confirmed_only else cache.predicted
            # Most engines hold none of a given prompt: one lookup each tells.
            if first in cache.hashes or (predicted is not None and first in predicted):
                matched[identity] = _leading(hashes, cache.hashes, predicted)
        return matched

    def held(self, identity: bytes) -> int:
        cache = self.engines.get(identity)
        return 0 if cache is None else len(cache.hashes)


def _consume(iterator: Iterator[object]) -> None:
    """Run an iterator to its end in C (a deque that keeps nothing)."""
    deque(iterator, maxlen=0)


def _leading(
    hashes: list[BlockHash], held: set[BlockHash], predicted: dict[BlockHash, float] | None
) -> int:
    """How many of ``hashes``, from the first on, are in ``held`` or ``predicted``: each run
    of one or the other is counted in C (``takewhile`` over ``__contains__``), so a prompt
    of hundreds of blocks costs a few calls, not a Python step per block."""
    count, total = 0, len(hashes)
    while count < total:
        count += len(list(takewhile(held.__contains__, islice(hashes, count, None))))
        if predicted is None or count == total:
            break
        run = len(list(takewhile(predicted.__contains__, islice(hashes, count, None))))
        if not run:
            break
        count += run
    return count
