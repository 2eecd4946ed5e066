"""Keeping the coordinator's LoRA adapters equal to ``spec.adapters`` (pure, no I/O).

The engines start with ``--enable-lora`` only; which adapters they hold is run-time state of
the coordinator, which relays ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` to
every engine and sends what it loaded to engines that register later. The handlers read
what the engines report (the front's ``/metrics``: ``dpserve_lora_adapter_loaded{adapter}``,
one series per adapter an engine has registered, its value the engines holding it in a
slot), ``plan`` the loads and unloads that make it ``spec.adapters``, send them, and write
``status.adapters`` (``status_entries``), with the ranks holding each from the front's
``/v1/lora_adapters`` (``read_ranks``; not from ``/metrics``, which has no rank label).

The front reports names, not directories: the directory each adapter was last loaded from
is remembered in ``status.adapters[].path``, so that an adapter whose path changed in the
spec is unloaded and loaded again.

A load or unload answered "already so" (the front's 400 ``lora_already_loaded``, 404
``lora_not_found``) counts as done: engines report with their heartbeats, so what ``/metrics``
says may lag a change by a second, and the next round would otherwise fail on its own work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client.parser import text_string_to_metric_families

from .crd import STATUS_SCHEMA
from .spec import Adapter

LOADED_METRIC: Final = "dpserve_lora_adapter_loaded"
ENGINES_METRIC: Final = "dpserve_registered_engines"
# Events on the InferenceDeployment.
LOAD_FAILED: Final = "AdapterLoadFailed"
UNLOAD_FAILED: Final = "AdapterUnloadFailed"
CHANGED: Final = "AdaptersChanged"
LOAD_ENDPOINT: Final = "/v1/load_lora_adapter"
RANKS_ENDPOINT: Final = "/v1/lora_adapters"
# The most ranks status.adapters[].ranks lists, the first ones ascending: the CRD's bound
# (its status schema owns it, as crd.py says).
MAX_LISTED_RANKS: Final[int] = STATUS_SCHEMA["properties"]["adapters"]["items"]["properties"][
    "ranks"
]["maxItems"]
UNLOAD_ENDPOINT: Final = "/v1/unload_lora_adapter"
# The front's error codes that mean the change is already in place.
ALREADY_LOADED: Final = "lora_already_loaded"
NOT_FOUND: Final = "lora_not_found"
# How much of an engine's refusal goes into the status and the event.
MAX_ERROR_CHARS: Final = 1000


class MalformedAdapterMetrics(ValueError):
    """The front's ``/metrics`` page could not be parsed."""


@dataclass(frozen=True)
class Reading:
    """What the front's ``/metrics`` says about adapters."""

    engines: int  # registered engines (dpserve_registered_engines)
    # adapter name -> engines holding it loaded in a slot, for every adapter an engine has
    # registered (loaded in a slot, or evicted and read again on demand).
    adapters: dict[str, int]


def read_metrics(metrics_page: str) -> Reading:
    """The adapters and the registered engines of one ``/metrics`` page."""
    try:
        families = list(text_string_to_metric_families(metrics_page))
    except ValueError as error:
        raise MalformedAdapterMetrics(f"/metrics is not Prometheus text: {error}") from error
    engines: int | None = None
    reported: dict[str, int] = {}
    for family in families:
        if family.name == ENGINES_METRIC and family.samples:
            engines = int(family.samples[0].value)
        elif family.name == LOADED_METRIC:
            for sample in family.samples:
                name = sample.labels.get("adapter")
                if name:
                    reported[name] = int(sample.value)
    if engines is None:
        raise MalformedAdapterMetrics(f"/metrics has no {ENGINES_METRIC}")
    return Reading(engines, reported)


@dataclass(frozen=True)
class Plan:
    """What to send, in this order: unloads, then loads."""

    unloads: tuple[str, ...]
    loads: tuple[Adapter, ...]

    @property
    def empty(self) -> bool:
        return not self.unloads and not self.loads


def plan(
    wanted: Iterable[Adapter], reported: Mapping[str, int], loaded_from: Mapping[str, str]
) -> Plan:
    """The changes that turn the ``reported`` adapters into ``wanted``.

    ``loaded_from``: name -> the directory it was last loaded from (``status.adapters``).
    An adapter no longer wanted is unloaded; a wanted one not reported is loaded; a wanted
    one reported but last loaded from another directory is unloaded and loaded again. An
    adapter reported whose directory is unknown (loaded by someone else under a wanted name)
    is left alone: the names match, and reloading it on every restart of the operator would
    drop the engines' cached prefixes for nothing.
    """
    wanted = tuple(wanted)
    paths = {adapter.name: adapter.path for adapter in wanted}
    moved = {
        name
        for name, path in paths.items()
        if name in reported and loaded_from.get(name, path) != path
    }
    unloads = tuple(sorted({name for name in reported if name not in paths} | moved))
    loads = tuple(
        adapter for adapter in wanted if adapter.name not in reported or adapter.name in moved
    )
    return Plan(unloads, loads)


@dataclass(frozen=True)
class Outcome:
    """The front's answer to one load or unload: done, or why not."""

    done: bool
    error: str | None = None


def outcome(status: int, payload: Any) -> Outcome:
    """Read the front's answer (HTTP status and decoded body) to a load or unload."""
    if 200 <= status < 300:
        return Outcome(True)
    error = payload.get("error") if isinstance(payload, Mapping) else None
    if isinstance(error, Mapping):
        if error.get("code") in (ALREADY_LOADED, NOT_FOUND):
            return Outcome(True)
        message = str(error.get("message") or error)
    else:
        message = str(payload)
    return Outcome(False, f"{status}: {message}"[:MAX_ERROR_CHARS])


def read_ranks(payload: Any) -> dict[str, list[int]]:
    """name -> the ranks of the engines holding it, from the front's ``/v1/lora_adapters``;
    ``MalformedAdapterMetrics`` for anything else."""
    data = payload.get("data") if isinstance(payload, Mapping) else None
    if not isinstance(data, list):
        raise MalformedAdapterMetrics(f"{RANKS_ENDPOINT} answered {str(payload)[:200]}")
    ranks: dict[str, list[int]] = {}
    for entry in data:
        name = entry.get("id") if isinstance(entry, Mapping) else None
        held = entry.get("ranks") if isinstance(entry, Mapping) else None
        if not isinstance(name, str) or not isinstance(held, list):
            raise MalformedAdapterMetrics(f"{RANKS_ENDPOINT}: bad entry {str(entry)[:200]}")
        ranks[name] = sorted(r for r in held if type(r) is int and r >= 0)[:MAX_LISTED_RANKS]
    return ranks


def status_entries(
    wanted: Iterable[Adapter],
    reported: Mapping[str, int],
    errors: Mapping[str, str],
    loaded_from: Mapping[str, str],
    ranks: Mapping[str, list[int]] | None = None,
) -> list[dict[str, Any]]:
    """``status.adapters``: each wanted adapter, whether engines have it, in how many slots,
    which engines (``ranks``, the first ``MAX_LISTED_RANKS``; left out when the front did not
    say), the directory it was loaded from, and the last error loading it (kept until it
    loads)."""
    entries: list[dict[str, Any]] = []
    for adapter in wanted:
        loaded = adapter.name in reported
        entry: dict[str, Any] = {
            "name": adapter.name,
            "path": loaded_from.get(adapter.name, adapter.path) if loaded else adapter.path,
            "loaded": loaded,
            "loadedEngines": reported.get(adapter.name, 0),
        }
        if ranks is not None:
            entry["ranks"] = list(ranks.get(adapter.name, []))[:MAX_LISTED_RANKS]
        if adapter.name in errors:
            entry["error"] = errors[adapter.name]
        entries.append(entry)
    return entries


def previous_paths(status_adapters: Any) -> dict[str, str]:
    """name -> path of the adapters ``status.adapters`` says are loaded."""
    paths: dict[str, str] = {}
    for entry in status_adapters or ():
        if isinstance(entry, Mapping) and entry.get("loaded") and entry.get("path"):
            paths[str(entry["name"])] = str(entry["path"])
    return paths


def previous_errors(status_adapters: Any) -> dict[str, str]:
    """name -> the error ``status.adapters`` holds for it."""
    return {
        str(entry["name"]): str(entry["error"])
        for entry in status_adapters or ()
        if isinstance(entry, Mapping) and entry.get("error")
    }
