"""The adapters an engine knows and the ``max_loras`` slots that hold loaded ones.

An adapter is *registered* (a name and a directory: ``--lora-modules`` at start,
``/v1/load_lora_adapter`` later) and *loaded* while it holds a slot. A request of an adapter
takes a slot for as long as the engine holds the request (waiting, running or preempted) and
gives it back when it finishes or is cancelled. A request whose adapter is not loaded when every
slot is held by running requests waits (``acquire`` returns None) until one is given back; an
adapter that holds a slot but no request is evicted, least recently used first, when another
needs its slot, and loaded again from its directory when asked for again.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from dpserve.engine.lora.adapter import AdapterLayout, read_adapter
from dpserve.engine.lora.serving import AdapterError
from dpserve.engine.lora.weights import AdapterWeights
from dpserve.limits import DEFAULT_LORA_LIMITS

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Slot:
    weights: AdapterWeights
    users: int = 0  # requests of the engine that hold it


class LoraSlots:
    """Registered adapters, and up to ``max_loras`` of them loaded."""

    def __init__(
        self,
        layout: AdapterLayout,
        *,
        max_loras: int = DEFAULT_LORA_LIMITS.max_loras,
        max_rank: int = DEFAULT_LORA_LIMITS.max_lora_rank,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"need max_loras >= 1 and max_rank >= 1, got {max_loras}, {max_rank}")
        self.layout = layout
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype, self.device = dtype, device
        self.paths: dict[str, str] = {}  # registered: name -> directory
        self._slots: list[_Slot | None] = [None] * max_loras
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # loaded, least recently used first
        self.loads = 0  # adapters read from disk (start, load API, reload after eviction)
        self.evictions = 0

    # ------------------------------------------------------------------------ registry

    def register(self, name: str, path: str) -> None:
        """Check ``path`` (read and convert it; ``AdapterError`` if it cannot run here) and
        register it as ``name``, loaded into a slot if one is free or evictable. A name
        registered already is replaced when it is unused (``AdapterError`` if requests hold
        it)."""
        if name not in self.paths and len(self.paths) >= DEFAULT_LORA_LIMITS.max_registered_loras:
            raise AdapterError(
                f"this engine has {len(self.paths)} adapters registered, the most it keeps: "
                "unload one first"
            )
        weights = self._read(name, path)
        if name in self.paths:
            self.unregister(name)
        self.paths[name] = path
        slot = self._free_slot()
        if slot is not None:
            self._fill(slot, weights)

    def unregister(self, name: str) -> None:
        """Forget ``name``; ``KeyError`` if unknown, ``AdapterError`` while requests use it."""
        if name not in self.paths:
            raise KeyError(name)
        slot = self._slot_of.get(name)
        if slot is not None:
            held = self._slots[slot]
            assert held is not None
            if held.users:
                raise AdapterError(
                    f"adapter {name!r} is in use by {held.users} request(s): unload it when "
                    "they are done"
                )
            self._empty(slot)
        del self.paths[name]

    def names(self) -> list[str]:
        return sorted(self.paths)

    def loaded(self) -> list[str]:
        return sorted(self._slot_of)

    # ------------------------------------------------------------------------ requests

    def acquire(self, name: str) -> int | None:
        """A slot holding ``name``'s weights for one more request, or None while every slot
        is held by requests of other adapters. ``KeyError`` for an unregistered name,
        ``AdapterError`` if its directory no longer loads."""
        path = self.paths[name]
        slot = self._slot_of.get(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self._fill(slot, self._read(name, path))
        self._slot_of.move_to_end(name)
        held = self._slots[slot]
        assert held is not None
        held.users += 1
        return slot

    def release(self, slot: int) -> None:
        held = self._slots[slot]
        assert held is not None and held.users > 0, f"slot {slot} released more than acquired"
        held.users -= 1

    def weights_of(self) -> dict[int, AdapterWeights]:
        """Slot -> the weights it holds (for a step's ``delta.group_rows``)."""
        return {slot: held.weights for slot, held in enumerate(self._slots) if held is not None}

    def users(self) -> dict[str, int]:
        """Requests held per loaded adapter."""
        found: dict[str, int] = {}
        for name, slot in self._slot_of.items():
            held = self._slots[slot]
            assert held is not None
            found[name] = held.users
        return found

    # --------------------------------------------------------------------------- slots

    def _read(self, name: str, path: str) -> AdapterWeights:
        weights = read_adapter(
            name, path, self.layout, max_rank=self.max_rank, dtype=self.dtype, device=self.device
        )
        self.loads += 1
        return weights

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one no request holds (emptied)."""
        for slot, held in enumerate(self._slots):
            if held is None:
                return slot
        for name, slot in self._slot_of.items():
            held = self._slots[slot]
            assert held is not None
            if not held.users:
                log.info("LoRA adapter %s evicted from slot %d (least recently used)", name, slot)
                self.evictions += 1
                self._empty(slot)
                return slot
        return None

    def _fill(self, slot: int, weights: AdapterWeights) -> None:
        self._slots[slot] = _Slot(weights)
        self._slot_of[weights.name] = slot
        log.info(
            "LoRA adapter %s (rank %d, %.1f MiB) loaded into slot %d from %s",
            weights.name,
            weights.rank,
            weights.nbytes / 2**20,
            slot,
            weights.path,
        )

    def _empty(self, slot: int) -> None:
        held = self._slots[slot]
        assert held is not None
        del self._slot_of[held.weights.name]
        self._slots[slot] = None
