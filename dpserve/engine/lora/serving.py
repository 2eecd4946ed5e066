"""What the engine process asks of a runner that serves LoRA adapters (``ModelRunner`` with
``--enable-lora``): load and unload them at run time (the coordinator relays the HTTP front's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``), and report them with each
heartbeat, so that the front knows which ``model`` names exist and /metrics can count them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class AdapterError(ValueError):
    """An adapter directory this engine cannot run; the message says which and why. (Here,
    not beside the loader in ``adapter``: the engine server catches it, and must not import
    torch for that — a fake engine starts without it.)"""


# What either runner (dpserve's engine, vLLM's) answers a request or a load it cannot serve.
NO_ADAPTERS = "this engine serves no LoRA adapters (start it with --enable-lora)"


def unknown_adapter(name: str, known: Iterable[str]) -> str:
    """The refusal of a request naming an adapter this engine has not registered."""
    listed = ", ".join(sorted(known)) or "none"
    return f"unknown LoRA adapter {name!r} on this engine (loaded: {listed})"


@dataclass(frozen=True, slots=True)
class AdapterReport:
    """An engine's adapters: every registered one with whether it is loaded in a slot and its
    requests running and waiting (those waiting for a slot included)."""

    max_loras: int
    adapters: dict[str, tuple[bool, int, int]] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        """As the HEARTBEAT's ``adapters`` field: ``{"max_loras": n, "adapters": {name:
        [loaded 0/1, running, waiting]}}`` (no bools on the wire)."""
        return {
            "max_loras": self.max_loras,
            "adapters": {
                name: [int(loaded), running, waiting]
                for name, (loaded, running, waiting) in sorted(self.adapters.items())
            },
        }


@runtime_checkable
class ServesAdapters(Protocol):
    def load_adapter(self, name: str, path: str) -> None:
        """Register (and load, if a slot allows) adapter ``name`` from directory ``path``;
        ``AdapterError`` saying why it cannot."""

    def unload_adapter(self, name: str) -> None:
        """Forget adapter ``name``; ``KeyError`` if unknown, ``AdapterError`` while in use."""

    def adapter_report(self) -> AdapterReport | None:
        """The adapters now; None where LoRA is not enabled."""
