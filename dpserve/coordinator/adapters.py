"""LoRA adapters across the engines: LOAD_ADAPTER and UNLOAD_ADAPTER relayed from a client to
every engine, each engine's ADAPTER_ACK gathered into one answer, and the adapters loaded this
way sent to every engine that registers later (a restarted engine gets them back). The
adapters each engine reports with its heartbeats are checked here (``check_adapter_report``)
before STATUS shows them.

A restarted coordinator does not know what was loaded through its predecessor; the engines do,
and say so when they register again (REGISTER's ``adapters``, checked by
``check_runtime_adapters``): what this coordinator does not know is adopted into ``loaded``, so
that replacement and new engines get it too.

Unlike control signals these change no control state: any number may be in flight at once,
each under an id of the coordinator's own (clients' control ids may collide)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dpserve import protocol
from dpserve.coordinator.registry import Engine
from dpserve.coordinator.shared import SharedState
from dpserve.limits import DEFAULT_LORA_LIMITS
from dpserve.protocol import AdapterAck, ErrorCode, LoadAdapter, ProtocolError, UnloadAdapter
from dpserve.sampling import InvalidSamplingParams, check_lora_name

log = logging.getLogger("dpserve.coordinator")


class MalformedAdapterReport(ProtocolError):
    """An engine's heartbeat ``adapters`` that the coordinator will not keep."""


def check_adapter_report(raw: object) -> dict[str, Any]:
    """An engine's ``{"max_loras": n, "adapters": {name: [loaded, running, waiting]}}``,
    checked (``MalformedAdapterReport`` otherwise)."""
    if not isinstance(raw, dict) or set(raw) != {"max_loras", "adapters"}:
        raise MalformedAdapterReport("adapters must be a map of max_loras and adapters")
    max_loras, adapters = raw["max_loras"], raw["adapters"]
    if type(max_loras) is not int or not isinstance(adapters, dict):
        raise MalformedAdapterReport("adapters: max_loras must be an integer, adapters a map")
    _check_names(adapters)
    for name, counts in adapters.items():
        if not (
            isinstance(counts, list)
            and len(counts) == 3
            and all(type(count) is int and count >= 0 for count in counts)
        ):
            raise MalformedAdapterReport(f"adapter {name}: want [loaded, running, waiting]")
    return {"max_loras": max_loras, "adapters": dict(adapters)}


def check_runtime_adapters(raw: object) -> dict[str, str]:
    """An engine's REGISTER ``adapters``, ``{name: directory}`` of those it loaded at run time,
    checked as a load through the API is (``MalformedAdapterReport`` otherwise)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise MalformedAdapterReport("adapters must be a map of name to directory")
    limits = DEFAULT_LORA_LIMITS
    _check_names(raw)
    for name, path in raw.items():
        if not isinstance(path, str) or not path:
            raise MalformedAdapterReport(f"adapter {name}: the directory must be a string")
        if len(path) > limits.max_lora_path_chars:
            raise MalformedAdapterReport(
                f"adapter {name}: the directory has more than "
                f"{limits.max_lora_path_chars} characters"
            )
    return dict(raw)


def _check_names(adapters: dict[Any, Any]) -> None:
    """The adapter names an engine reports: how many, and each one valid."""
    if len(adapters) > DEFAULT_LORA_LIMITS.max_registered_loras:
        raise MalformedAdapterReport(f"adapters: {len(adapters)} adapters is too many")
    for name in adapters:
        try:
            check_lora_name(name)
        except InvalidSamplingParams as exc:
            raise MalformedAdapterReport(str(exc)) from None


@dataclass(slots=True)
class _Operation:
    requester: bytes
    control_id: int  # the requester's
    waiting_for: set[bytes]
    errors: list[str] = field(default_factory=list)
    load: LoadAdapter | None = None  # a load: forgotten again if no engine could load it
    answered: int = 0  # engines that answered


class AdapterRelay:
    """Adapter loads and unloads in flight, and the adapters engines that join must load."""

    def __init__(self, shared: SharedState) -> None:
        self.shared = shared
        self.loaded: dict[str, str] = {}  # name -> path, loaded through this coordinator
        self._operations: dict[int, _Operation] = {}  # by the coordinator's own id
        self._ids = itertools.count(1)  # 0: the loads sent to a joining engine

    def on_signal(self, identity: bytes, record: LoadAdapter | UnloadAdapter) -> None:
        """A client's LOAD_ADAPTER or UNLOAD_ADAPTER."""
        if identity not in self.shared.clients:
            self.shared.transport.error(
                identity, record.control_id, ErrorCode.UNKNOWN_PEER, "connect first"
            )
            return
        try:
            check_lora_name(record.name)
        except InvalidSamplingParams as exc:
            code = ErrorCode.BAD_REQUEST
            self.shared.transport.error(identity, record.control_id, code, str(exc))
            return
        engines = set(self.shared.registry.engines)
        operation = _Operation(identity, record.control_id, set(engines))
        own_id = next(self._ids)
        if isinstance(record, LoadAdapter):
            if len(record.path) > DEFAULT_LORA_LIMITS.max_lora_path_chars:
                self.shared.transport.error(
                    identity, record.control_id, ErrorCode.BAD_REQUEST, "adapter path too long"
                )
                return
            self.loaded[record.name] = record.path
            operation.load = record
            relayed: Any = LoadAdapter(own_id, record.name, record.path)
        else:
            self.loaded.pop(record.name, None)
            relayed = UnloadAdapter(own_id, record.name)
        log.info("%s %s on %d engine(s)", type(record).__name__, record.name, len(engines))
        self._operations[own_id] = operation
        payload = protocol.encode(relayed)
        for engine in engines:
            self.shared.transport.send(engine, payload)
        self._maybe_finish(own_id)

    def on_ack(self, engine: Engine, ack: AdapterAck) -> None:
        operation = self._operations.get(ack.control_id)
        if ack.control_id == 0 or operation is None:
            if ack.error is not None:  # a joining engine's load, or one given up on
                log.warning("engine rank %d: adapter: %s", engine.rank, ack.error)
            return
        if engine.identity not in operation.waiting_for:
            return
        operation.waiting_for.discard(engine.identity)
        operation.answered += 1
        if ack.error is not None:
            operation.errors.append(f"engine rank {engine.rank}: {ack.error}")
        self._maybe_finish(ack.control_id)

    def engine_joined(self, engine: Engine, reported: Mapping[str, str] | None = None) -> None:
        """A new engine loads every adapter loaded through this coordinator but those it
        reports holding. ``reported``: the adapters it loaded at run time (REGISTER's, checked);
        one this coordinator does not know was loaded through a coordinator before it (a
        restart): it is adopted, and sent to the engines registered before this one."""
        reported = reported or {}
        for name, path in reported.items():
            known = self.loaded.get(name)
            if known is None:
                self._adopt(engine, name, path)
            elif known != path:
                log.warning(
                    "engine rank %d holds adapter %s from %s; keeping %s, the directory this "
                    "coordinator knows",
                    engine.rank,
                    name,
                    path,
                    known,
                )
        for name, path in self.loaded.items():
            if name not in reported:  # one it holds under another directory: a load would fail
                payload = protocol.encode(LoadAdapter(0, name, path))
                self.shared.transport.send(engine.identity, payload)

    def _adopt(self, reporter: Engine, name: str, path: str) -> None:
        """Adapter ``name``, reported by an engine that registered, was loaded through a
        coordinator before this one. The engines registered before it cannot hold it (it
        would have been adopted from them, or loaded through this coordinator): they load
        it now, as those that register later will."""
        self.loaded[name] = path
        others = [e for e in self.shared.registry.engines if e != reporter.identity]
        log.info(
            "adapter %s (%s) adopted from engine rank %d; loading it on %d other engine(s)",
            name,
            path,
            reporter.rank,
            len(others),
        )
        payload = protocol.encode(LoadAdapter(0, name, path))
        for identity in others:
            self.shared.transport.send(identity, payload)

    def engine_left(self, engine: Engine) -> None:
        for own_id, operation in list(self._operations.items()):
            if engine.identity in operation.waiting_for:
                operation.waiting_for.discard(engine.identity)
                self._maybe_finish(own_id)

    def _maybe_finish(self, own_id: int) -> None:
        operation = self._operations[own_id]
        if operation.waiting_for:
            return
        del self._operations[own_id]
        error = "; ".join(operation.errors) or None
        load = operation.load
        failed_everywhere = bool(operation.errors) and len(operation.errors) == operation.answered
        if load is not None and failed_everywhere and self.loaded.get(load.name) == load.path:
            del self.loaded[load.name]  # engines that join later must not try it either
        if operation.requester in self.shared.clients:
            self.shared.transport.send(
                operation.requester, protocol.encode(AdapterAck(operation.control_id, error))
            )
