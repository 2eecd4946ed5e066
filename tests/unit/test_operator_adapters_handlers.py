"""spec.adapters through the real operator (kopf, the handlers, the API layer) against kmock's
in-memory Kubernetes API, whose service proxy answers for a coordinator front that keeps an
adapter set: the loads and unloads it receives, with which key, and status.adapters."""

# The fixtures come from test_operator_handlers: each test's `api` parameter is the fixture.
# ruff: noqa: F811

from __future__ import annotations

import base64
from typing import Any

import pytest
from kmock import Response
from kmock import resource as kmock_resource

from dpserve_operator import adapters, credentials, handlers
from tests.unit.test_operator_handlers import (  # noqa: F401 (fixtures)
    CR,
    IMAGE,
    NS,
    api,
    eventually,
    health,
    live,
    operator_running,
    posted_events,
    resource_status,
)

PROXY = f"/api/v1/namespaces/{NS}/services/demo-coordinator:http/proxy"
MODELS = {"claimName": "models"}

pytestmark = pytest.mark.timeout(90)


class FakeFront:
    """The coordinator's front as the operator sees it: /metrics from the adapters it holds,
    the two endpoints with the front's answers, and what it was sent."""

    def __init__(self, engines: int = 1) -> None:
        self.engines = engines
        self.held: dict[str, str] = {}
        self.sent: list[tuple[str, dict[str, Any], str | None]] = []
        self.broken: set[str] = set()  # paths whose load the engines refuse
        self.rank_keys: list[str | None] = []  # the key of each /v1/lora_adapters

    def metrics(self) -> Response:
        lines = [f"dpserve_registered_engines {self.engines}.0"]
        lines += [f'dpserve_lora_adapter_loaded{{adapter="{n}"}} 1.0' for n in self.held]
        return Response(status=200, payload="\n".join(lines) + "\n")

    def ranks(self, request: Any) -> Response:
        """/v1/lora_adapters: every engine holds every adapter (needs the admin token here,
        as the operator sends it)."""
        self.rank_keys.append(request.headers.get("X-Api-Key"))
        data = [{"id": n, "ranks": list(range(self.engines)), "loaded_ranks": []}
                for n in sorted(self.held)]  # fmt: skip
        return Response(status=200, payload={"object": "list", "data": data})

    def change(self, request: Any) -> Response:
        endpoint = "/" + request.url.path.split("/proxy/", 1)[1]
        body = dict(request.data)
        self.sent.append((endpoint, body, request.headers.get("X-Api-Key")))
        name = body["lora_name"]
        if endpoint == adapters.UNLOAD_ENDPOINT:
            if self.held.pop(name, None) is None:
                error = {"message": f"The lora adapter '{name}' cannot be found.",
                         "code": "lora_not_found"}  # fmt: skip
                return Response(status=404, payload={"error": error})
            return Response(status=200, payload=f"Success: LoRA adapter '{name}' removed.")
        if body["lora_path"] in self.broken:
            error = {"message": f"engine 0: {body['lora_path']}: no adapter_config.json",
                     "code": "lora_adapter_error"}  # fmt: skip
            return Response(status=400, payload={"error": error})
        self.held[name] = body["lora_path"]
        return Response(status=200, payload=f"Success: LoRA adapter '{name}' added.")


def serve(api: Any, front: FakeFront) -> None:
    api["get", f"{PROXY}/metrics"] << (lambda: front.metrics())
    api["post", f"{PROXY}{adapters.LOAD_ENDPOINT}"] << front.change
    api["post", f"{PROXY}{adapters.UNLOAD_ENDPOINT}"] << front.change
    api["get", f"{PROXY}{adapters.RANKS_ENDPOINT}"] << front.ranks


def add(api: Any, spec: dict[str, Any]) -> None:
    api.objects[CR, NS, "demo"] = {
        "apiVersion": "dpserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "demo", "namespace": NS, "uid": "0d6c9a0e-0000-4000-8000-00000000a0a0",
                     "generation": 1, "resourceVersion": "1"},
        "spec": spec,
    }  # fmt: skip


def token(api: Any, file: str = credentials.ADMIN_API_TOKEN_FILE) -> str:
    secret = live(api, "v1/secrets", credentials.credentials_secret_name("demo"))
    assert secret is not None
    return base64.b64decode(secret["data"][file]).decode().strip()


def entries(api: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = resource_status(api).get("adapters") or []
    return found


async def test_the_list_is_loaded_then_edited_through_the_front(api: Any) -> None:
    front = FakeFront()
    serve(api, front)
    wanted = [{"name": "a", "path": "/models/a"}, {"name": "b", "path": "/models/b"}]
    add(api, {"model": "m", "image": IMAGE, "modelVolume": MODELS, "adapters": wanted})
    async with operator_running():
        await eventually(lambda: front.held == {"a": "/models/a", "b": "/models/b"})
        await eventually(lambda: [e["loaded"] for e in entries(api)] == [True, True])
        engines = live(api, "apps/v1/statefulsets", "demo-engine")
        assert engines is not None
        command = engines["spec"]["template"]["spec"]["containers"][0]["command"]
        assert "--enable-lora" in command and "/models/a" not in command
        # The edit: b stays, a goes, c comes; b moves to a new directory.
        edited = [{"name": "b", "path": "/models/b2"}, {"name": "c", "path": "/models/c"}]
        api.objects[CR, NS, "demo"].patch({"spec": {"adapters": edited}})
        await eventually(lambda: front.held == {"b": "/models/b2", "c": "/models/c"})
        await eventually(
            lambda: (
                [(e["name"], e["path"]) for e in entries(api)]
                == [("b", "/models/b2"), ("c", "/models/c")]
            )
        )
    keys = {key for _, _, key in front.sent}
    assert keys == {token(api)}, "every change carries the deployment's admin token"
    assert token(api) != token(api, credentials.API_TOKEN_FILE)
    unloads = [body["lora_name"] for endpoint, body, _ in front.sent
               if endpoint == adapters.UNLOAD_ENDPOINT]  # fmt: skip
    assert sorted(unloads) == ["a", "b"]
    changed = [e["message"] for e in posted_events(api) if e["reason"] == adapters.CHANGED]
    assert any("loaded c from /models/c" in message for message in changed), changed


async def test_a_failed_load_is_an_event_and_an_error_in_the_status(api: Any) -> None:
    front = FakeFront()
    front.broken.add("/models/bad")
    serve(api, front)
    wanted = [{"name": "good", "path": "/models/good"}, {"name": "bad", "path": "/models/bad"}]
    add(api, {"model": "m", "image": IMAGE, "modelVolume": MODELS, "adapters": wanted})
    async with operator_running():
        await eventually(lambda: any(e.get("error") for e in entries(api)))
        await eventually(lambda: any(e["loaded"] for e in entries(api)))
        front.broken.clear()  # the directory got fixed: the next tick loads it
        await eventually(lambda: front.held.keys() == {"good", "bad"})
        await eventually(lambda: not any(e.get("error") for e in entries(api)))
    failures = [e for e in posted_events(api) if e["reason"] == adapters.LOAD_FAILED]
    assert len(failures) == 1, "one event per distinct failure, not one per tick"
    assert failures[0]["message"] == "bad: 400: engine 0: /models/bad: no adapter_config.json"
    assert failures[0]["type"] == "Warning"


async def test_nothing_is_sent_without_engines_or_without_adapters(api: Any) -> None:
    front = FakeFront(engines=0)
    serve(api, front)
    add(api, {"model": "m", "image": IMAGE, "modelVolume": MODELS,
              "adapters": [{"name": "a", "path": "/models/a"}]})  # fmt: skip
    async with operator_running():
        await eventually(lambda: entries(api) != [])
        await eventually(lambda: resource_status(api).get("observedGeneration") == 1)
        assert not front.sent
        assert entries(api) == [
            {"name": "a", "path": "/models/a", "loaded": False, "loadedEngines": 0, "ranks": []}
        ]
        front.engines = 2  # engines register: they get the list, and the status names them
        await eventually(lambda: front.held == {"a": "/models/a"})
        await eventually(lambda: [e.get("ranks") for e in entries(api)] == [[0, 1]])
    assert set(front.rank_keys) == {token(api)}
    assert handlers.ADAPTER_SYNC_SECONDS <= 2.0


async def test_a_key_set_from_before_the_admin_token_gets_one_and_keeps_its_keys(
    api: Any,
) -> None:
    """An operator upgrade: ``<name>-credentials`` holds a valid key set but no
    ``http-admin-token``. The token is added, no key rotates, and the operator loads with it."""
    files = credentials.generate_key_files()
    del files[credentials.ADMIN_API_TOKEN_FILE]
    name = credentials.credentials_secret_name("demo")
    old = {key: base64.b64encode(text.encode()).decode() for key, text in files.items()}
    api.objects[kmock_resource("v1/secrets"), NS, name] = {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": name, "namespace": NS, "resourceVersion": "1"}, "data": old,
    }  # fmt: skip
    replaced: list[dict[str, Any]] = []

    def put(request: Any) -> Response:  # kmock has no PUT: keep what the operator sends
        replaced.append(dict(request.data))
        api.objects[kmock_resource("v1/secrets"), NS, name] = replaced[-1]
        return Response(status=200, payload=replaced[-1])

    api["put", f"/api/v1/namespaces/{NS}/secrets/{name}"] << put
    front = FakeFront()
    serve(api, front)
    add(api, {"model": "m", "image": IMAGE, "modelVolume": MODELS,
              "adapters": [{"name": "a", "path": "/models/a"}]})  # fmt: skip
    async with operator_running():
        await eventually(lambda: front.held == {"a": "/models/a"})
    assert len(replaced) == 1, "the token is added once"
    secret = live(api, "v1/secrets", name)
    assert secret is not None
    assert {key: secret["data"][key] for key in old} == old, "no key rotated"
    admin = token(api)
    assert admin and front.sent[0][2] == admin
    client = live(api, "v1/secrets", credentials.client_secret_name("demo"))
    assert client is not None
    assert (
        base64.b64decode(client["data"][credentials.ADMIN_API_TOKEN_FILE]).decode().strip() == admin
    )
