"""LoRA adapters on the HTTP front: which ``model`` names it serves, and the admin endpoints
that load and unload adapters (vLLM's shapes).

A request's ``model`` is the base model's name or an adapter's. The adapters are those the
engines report with their heartbeats (the coordinator's STATUS, ``engine_list[].adapters``),
read again at most once per ``REFRESH_SECONDS`` when a request names one not seen yet, and at
once after this front loads or unloads one. While no engine serves adapters, any ``model`` is
the base model, as before adapters existed (benchmark clients send names of their own); once
engines serve adapters, an unknown name is a 404 naming it, as vLLM answers.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import web

from dpserve.client import ClientError, InferenceClient, RequestFailed
from dpserve.limits import DEFAULT_LORA_LIMITS
from dpserve.openai.errors import HttpError, InvalidRequest
from dpserve.sampling import InvalidSamplingParams, check_lora_name

REFRESH_SECONDS: Final = 1.0
# How long a load or unload through this front outweighs what STATUS says: engines report
# their adapters with their next heartbeat (one a second), so STATUS lags a change.
CHANGE_SECONDS: Final = 5.0
LOAD_ENDPOINT: Final = "/v1/load_lora_adapter"
UNLOAD_ENDPOINT: Final = "/v1/unload_lora_adapter"
# dpserve's own: which engines (by rank) hold each adapter, from STATUS (the operator's
# status.adapters[].ranks). Per-rank residency stays out of /metrics (a label per rank and
# adapter is too many series).
RANKS_ENDPOINT: Final = "/v1/lora_adapters"
# The endpoints only an admin API token may call where the front has API keys
# (security.api_tokens.ApiKeys): a load points every engine at a directory of its choosing.
ADMIN_ENDPOINTS: Final = frozenset({LOAD_ENDPOINT, UNLOAD_ENDPOINT})

Status = Callable[[], Awaitable[dict[str, Any] | None]]


def adapters_of(status: dict[str, Any] | None) -> tuple[bool, dict[str, list[int]]]:
    """Whether any engine serves adapters, and every adapter an engine reports with the
    engines' counts summed: name -> [engines holding it loaded, running, waiting]."""
    enabled = False
    found: dict[str, list[int]] = {}
    for engine in (status or {}).get("engine_list", []):
        report = engine.get("adapters") or {}
        if not report:
            continue
        enabled = True
        for name, (loaded, running, waiting) in report.get("adapters", {}).items():
            total = found.setdefault(name, [0, 0, 0])
            total[0] += loaded
            total[1] += running
            total[2] += waiting
    return enabled, found


def adapter_ranks(status: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Per adapter an engine reports, sorted by name: the ranks of the engines that registered
    it (``ranks``) and of those holding it in a slot (``loaded_ranks``), ascending."""
    found: dict[str, tuple[set[int], set[int]]] = {}
    for engine in (status or {}).get("engine_list", []):
        rank = engine.get("rank")
        if type(rank) is not int:
            continue
        for name, (loaded, _, _) in ((engine.get("adapters") or {}).get("adapters", {})).items():
            registered, in_slot = found.setdefault(name, (set(), set()))
            registered.add(rank)
            if loaded:
                in_slot.add(rank)
    return [
        {"id": name, "object": "lora_adapter", "ranks": sorted(registered),
         "loaded_ranks": sorted(in_slot)}
        for name, (registered, in_slot) in sorted(found.items())
    ]  # fmt: skip


class AdapterDirectory:
    """The ``model`` names this front serves: the base model and the engines' adapters."""

    def __init__(self, base_model: str, status: Status) -> None:
        self.base_model = base_model
        self._status = status
        self.enabled = False  # some engine serves adapters
        self.names: set[str] = set()
        self._refreshed = float("-inf")
        # Adapters this front loaded (True) or unloaded (False) lately, and until when that
        # outweighs STATUS.
        self._changes: dict[str, tuple[bool, float]] = {}

    async def refresh(self) -> None:
        status = await self._status()
        if status is None:
            return
        now = time.monotonic()
        self.enabled, found = adapters_of(status)
        names = set(found)
        for name, (present, until) in list(self._changes.items()):
            if until < now:
                del self._changes[name]
            elif present:
                names.add(name)
            else:
                names.discard(name)
        self.names = names
        self._refreshed = now

    async def resolve(self, model: str | None) -> str | None:
        """The adapter a request's ``model`` names, None for the base model; a 404
        ``InvalidRequest`` for an unknown name where engines serve adapters."""
        if model is None or model == self.base_model:
            return None
        if model not in self.names and time.monotonic() - self._refreshed > REFRESH_SECONDS:
            await self.refresh()
        if model in self.names:
            return model
        if not self.enabled:
            return None
        message = f"The model `{model}` does not exist."
        raise InvalidRequest(message, param="model", code="model_not_found", status=404)

    def loaded(self, name: str) -> None:
        self.names.add(name)
        self.enabled = True
        self._changes[name] = (True, time.monotonic() + CHANGE_SECONDS)

    def unloaded(self, name: str) -> None:
        self.names.discard(name)
        self._changes[name] = (False, time.monotonic() + CHANGE_SECONDS)


def parse_adapter_body(body: dict[str, Any], *, load: bool) -> tuple[str, str]:
    """``{lora_name, lora_path}`` (``lora_path`` for a load only), checked."""
    try:
        name = check_lora_name(body.get("lora_name"))
    except InvalidSamplingParams as exc:
        raise InvalidRequest(str(exc), param="lora_name") from None
    path = body.get("lora_path", "")
    if load and not (isinstance(path, str) and path):
        raise InvalidRequest("lora_path must be a directory (a string)", param="lora_path")
    if isinstance(path, str) and len(path) > DEFAULT_LORA_LIMITS.max_lora_path_chars:
        raise InvalidRequest(
            f"lora_path may have at most {DEFAULT_LORA_LIMITS.max_lora_path_chars} characters",
            param="lora_path",
        )
    return name, path if isinstance(path, str) else ""


async def change_adapter(
    client: InferenceClient, directory: AdapterDirectory, name: str, path: str, *, load: bool
) -> web.Response:
    """Load or unload ``name`` on every engine; 200 with vLLM's text when every engine did,
    else the engines' errors (400; 404 unloading an adapter no engine has)."""
    if not load and name not in directory.names:
        await directory.refresh()
        if name not in directory.names:
            return HttpError.of(
                404, f"The lora adapter '{name}' cannot be found.", code="lora_not_found"
            ).response()
    if load and name in directory.names:
        return HttpError.of(
            400,
            f"The lora adapter '{name}' has already been loaded.",
            param="lora_name",
            code="lora_already_loaded",
        ).response()
    try:
        if load:
            error = await client.load_lora_adapter(name, path)
        else:
            error = await client.unload_lora_adapter(name)
    except RequestFailed as exc:  # refused by the coordinator (the admin role, a bad name)
        status = 403 if exc.code == "forbidden" else 400
        return HttpError.of(status, exc.message, code=exc.code).response()
    except ClientError as exc:
        return HttpError.of(503, f"the coordinator is unavailable: {exc}").response()
    if error is not None:
        return HttpError.of(400, error, code="lora_adapter_error").response()
    if load:
        directory.loaded(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")
    directory.unloaded(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
