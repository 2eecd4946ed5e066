"""spec.adapters: parsing, what it renders (and what it keeps out of the pod templates), and
the pure diff of ``dpserve_operator.adapters`` between the spec and what the engines report."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dpserve.limits import DEFAULT_LORA_LIMITS
from dpserve.openai import app as front_app
from dpserve.openai.metrics import _lora_metrics
from dpserve_operator import adapters, cluster, credentials, manifests
from dpserve_operator.crd import STATUS_SCHEMA, spec_field
from dpserve_operator.spec import (
    ADAPTER_MOUNT_PATH,
    Adapter,
    DeploymentSpec,
    InvalidSpec,
    parse_spec,
)

IMAGE = "ghcr.io/dpserve/runtime-cpu:0.1.0"
BASE: dict[str, Any] = {"model": "m", "image": IMAGE, "modelVolume": {"claimName": "models"}}


def parsed(**fields: Any) -> DeploymentSpec:
    return parse_spec({**BASE, **fields}, name="demo")


def problems(**fields: Any) -> list[str]:
    with pytest.raises(InvalidSpec) as raised:
        parsed(**fields)
    return raised.value.problems


# --------------------------------------------------------------------------- the spec


def test_adapters_from_the_model_volume_and_the_adapter_volume() -> None:
    spec = parsed(
        adapters=[
            {"name": "sql-lora", "path": "/models/loras/sql/"},
            {"name": "org/chat@v2", "path": "/adapters/./chat"},
        ],
        adapterVolume={"claimName": "loras"},
        engine={"maxLoras": 2},
    )
    assert spec.adapters is not None
    assert spec.adapters.adapters == (
        Adapter("sql-lora", "/models/loras/sql"),
        Adapter("org/chat@v2", "/adapters/chat"),
    )
    assert spec.adapters.volume_claim == "loras"
    assert spec.engine.max_loras == 2
    assert parsed().adapters is None
    assert parsed(adapters=[]).adapters is not None


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"adapters": [{"name": "a b", "path": "/models/a"}]}, "spec.adapters[0].name: a LoRA"),
        ({"adapters": [{"name": "-a", "path": "/models/a"}]}, "spec.adapters[0].name: a LoRA"),
        ({"adapters": [{"name": "a" * 129, "path": "/models/a"}]}, "spec.adapters[0].name"),
        (
            {"adapters": [{"name": "a", "path": "/models/a"}, {"name": "a", "path": "/models/b"}]},
            "spec.adapters[1].name: 'a' is listed twice",
        ),
        ({"adapters": [{"name": "a", "path": "models/a"}]}, "spec.adapters[0].path: must be"),
        ({"adapters": [{"name": "a", "path": "/models/../etc"}]}, "spec.adapters[0].path: "),
        (
            {"adapters": [{"name": "a", "path": "/adapters/a"}]},
            "spec.adapters[0].path: '/adapters/a' is not inside /models",
        ),
        ({"adapters": [{"name": "a", "path": "/models"}]}, "spec.adapters[0].path: '/models' is"),
        ({"engine": {"maxLoras": 2}}, "spec.engine.maxLoras: is for spec.adapters"),
        ({"adapterVolume": {"claimName": "x"}}, "spec.adapterVolume: is for spec.adapters"),
        (
            {
                "adapters": [],
                "adapterVolume": {"claimName": "x"},
                "modelVolume": {"claimName": "m", "mountPath": "/adapters"},
            },
            "spec.modelVolume.mountPath: /adapters is where spec.adapterVolume is mounted",
        ),
    ],
)
def test_bad_adapters_are_refused_naming_the_field(fields: dict[str, Any], expected: str) -> None:
    found = problems(**fields)
    assert any(problem.startswith(expected) for problem in found), found


def test_an_adapter_needs_a_mounted_volume() -> None:
    with pytest.raises(InvalidSpec) as raised:
        parse_spec(
            {"model": "m", "image": IMAGE, "adapters": [{"name": "a", "path": "/x/a"}]},
            name="demo",
        )
    assert raised.value.problems == [
        "spec.adapters[0].path: needs a volume to read from: spec.modelVolume, or "
        "spec.adapterVolume (mounted at /adapters)"
    ]


def test_the_crd_bounds_are_the_runtime_limits() -> None:
    limits = DEFAULT_LORA_LIMITS
    assert spec_field("adapters")["maxItems"] == limits.max_registered_loras
    items = spec_field("adapters")["items"]["properties"]
    assert items["name"]["maxLength"] == limits.max_lora_name_chars
    assert items["path"]["maxLength"] == limits.max_lora_path_chars
    assert spec_field("engine.maxLoras")["maximum"] == limits.max_registered_loras
    too_many = [{"name": f"a{i}", "path": f"/models/{i}"} for i in range(1025)]
    assert "spec.adapters: has 1025 adapters; at most 1024" in problems(adapters=too_many)


# --------------------------------------------------------------------------- manifests


def engine_container(spec: DeploymentSpec) -> dict[str, Any]:
    statefulset = manifests.engine_statefulset("demo", "ns", spec)
    container: dict[str, Any] = statefulset["spec"]["template"]["spec"]["containers"][0]
    return container


def test_engines_serve_adapters_whenever_the_list_is_present() -> None:
    assert "--enable-lora" not in engine_container(parsed())["command"]
    command = engine_container(parsed(adapters=[]))["command"]
    assert "--enable-lora" in command and "--max-loras" not in command
    command = engine_container(parsed(adapters=[], engine={"maxLoras": 3}))["command"]
    assert command[command.index("--max-loras") + 1] == "3"


def test_vllm_engines_serve_adapters_too() -> None:
    command = engine_container(parsed(adapters=[], engine={"backend": "vllm", "maxLoras": 2}))[
        "command"
    ]
    assert "--backend" in command and command[command.index("--backend") + 1] == "vllm"
    assert "--enable-lora" in command and command[command.index("--max-loras") + 1] == "2"


def test_editing_the_list_changes_no_pod_template() -> None:
    one = parsed(adapters=[{"name": "a", "path": "/models/a"}])
    other = parsed(
        adapters=[{"name": "b", "path": "/models/b"}, {"name": "c", "path": "/models/c"}]
    )
    for render in (manifests.engine_statefulset, manifests.coordinator_deployment):
        assert render("demo", "ns", one) == render("demo", "ns", other)
        assert "/models/a" not in json.dumps(render("demo", "ns", one))


def test_the_adapter_volume_is_mounted_read_only_in_the_engines_only() -> None:
    spec = parsed(adapters=[], adapterVolume={"claimName": "loras"})
    statefulset = manifests.engine_statefulset("demo", "ns", spec)
    volumes = statefulset["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "adapters",
        "persistentVolumeClaim": {"claimName": "loras", "readOnly": True},
    } in volumes
    mounts = engine_container(spec)["volumeMounts"]
    assert {"name": "adapters", "mountPath": ADAPTER_MOUNT_PATH, "readOnly": True} in mounts
    coordinator = manifests.coordinator_deployment("demo", "ns", spec)
    assert "loras" not in json.dumps(coordinator)


def coordinator_items(spec: DeploymentSpec) -> list[str]:
    deployment = manifests.coordinator_deployment("demo", "ns", spec)
    (volume,) = [
        v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "credentials"
    ]
    return [item["key"] for item in volume["secret"]["items"]]


def test_only_a_coordinator_with_adapters_gets_the_admin_key() -> None:
    assert "admin.key_secret" not in coordinator_items(parsed())
    assert "admin.key_secret" in coordinator_items(parsed(adapters=[]))
    statefulset = manifests.engine_statefulset("demo", "ns", parsed(adapters=[]))
    assert "admin" not in json.dumps(statefulset["spec"]["template"]["spec"]["volumes"])
    assert set(credentials.COORDINATOR_ADMIN_ITEMS) - set(credentials.COORDINATOR_ITEMS) == {
        ("admin.key_secret", "admin.key_secret")
    }


def test_the_operator_sends_the_header_the_front_reads() -> None:
    assert cluster.API_KEY_HEADER == front_app.API_KEY_HEADER


# --------------------------------------------------------------------------- the diff


A, B, C = Adapter("a", "/models/a"), Adapter("b", "/models/b"), Adapter("c", "/models/c")


def test_plan_loads_the_missing_and_unloads_the_unwanted() -> None:
    todo = adapters.plan([B, C], {"a": 1, "b": 2}, {"a": "/models/a", "b": "/models/b"})
    assert todo == adapters.Plan(unloads=("a",), loads=(C,))
    assert adapters.plan([A, B], {"a": 0, "b": 1}, {}).empty
    assert adapters.plan([], {}, {}).empty


def test_plan_reloads_an_adapter_whose_path_changed() -> None:
    moved = Adapter("a", "/models/a-v2")
    todo = adapters.plan([moved, B], {"a": 1, "b": 1}, {"a": "/models/a", "b": "/models/b"})
    assert todo == adapters.Plan(unloads=("a",), loads=(moved,))


def test_plan_leaves_a_wanted_name_of_unknown_origin_alone() -> None:
    # Reported, but not in status.adapters (an operator restart with an empty status, or an
    # adapter loaded by hand): same name, so it stays as it is.
    assert adapters.plan([A], {"a": 1}, {}).empty


def test_outcomes_of_the_fronts_answers() -> None:
    assert adapters.outcome(200, "Success: LoRA adapter 'a' added successfully.").done
    already = {"error": {"message": "The lora adapter 'a' has already been loaded.",
                         "code": "lora_already_loaded"}}  # fmt: skip
    assert adapters.outcome(400, already).done
    gone = {"error": {"message": "The lora adapter 'a' cannot be found.", "code": "lora_not_found"}}
    assert adapters.outcome(404, gone).done
    failed = {"error": {"message": "engine 1: /models/x: no adapter_config.json",
                        "code": "lora_adapter_error"}}  # fmt: skip
    outcome = adapters.outcome(400, failed)
    assert not outcome.done and outcome.error == "400: engine 1: /models/x: no adapter_config.json"
    assert (
        adapters.outcome(400, "x" * 5000).error
        == ("400: " + "x" * 5000)[: adapters.MAX_ERROR_CHARS]
    )


def test_the_fronts_own_metrics_are_read() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    class Collector:
        def collect(self) -> Any:
            report = {"max_loras": 2, "adapters": {"a": [1, 0, 0], "b": [0, 1, 1]}}
            yield from _lora_metrics([{"adapters": report}, {"adapters": {**report}}])

    registry = CollectorRegistry()
    registry.register(Collector())  # type: ignore[arg-type]
    page = generate_latest(registry).decode() + "dpserve_registered_engines 2.0\n"
    reading = adapters.read_metrics(page)
    assert reading == adapters.Reading(engines=2, adapters={"a": 2, "b": 0})
    assert adapters.read_metrics("dpserve_registered_engines 0.0\n").adapters == {}
    with pytest.raises(adapters.MalformedAdapterMetrics):
        adapters.read_metrics("dpserve_coordinator_up 1.0\n")


def test_the_ranks_holding_each_adapter_are_read_and_bounded() -> None:
    from dpserve.openai.adapters import adapter_ranks

    status = {"engine_list": [
        {"rank": 1, "adapters": {"max_loras": 2, "adapters": {"a": [1, 0, 0], "b": [0, 0, 0]}}},
        {"rank": 0, "adapters": {"max_loras": 2, "adapters": {"a": [0, 2, 0]}}},
        {"rank": 2, "adapters": None},
    ]}  # fmt: skip
    page = {"object": "list", "data": adapter_ranks(status)}  # what the front answers
    assert page["data"][0] == {"id": "a", "object": "lora_adapter", "ranks": [0, 1],
                               "loaded_ranks": [1]}  # fmt: skip
    assert adapters.read_ranks(page) == {"a": [0, 1], "b": [1]}
    many = {"data": [{"id": "a", "ranks": list(range(500, -1, -1))}]}
    assert adapters.read_ranks(many)["a"] == list(range(adapters.MAX_LISTED_RANKS))
    for bad in ("nope", {"data": [{"id": 3, "ranks": []}]}, {"data": [{"id": "a"}]}):
        with pytest.raises(adapters.MalformedAdapterMetrics):
            adapters.read_ranks(bad)
    # The CRD allows what the status writes, and says the bound.
    ranks = STATUS_SCHEMA["properties"]["adapters"]["items"]["properties"]["ranks"]
    assert ranks["maxItems"] == adapters.MAX_LISTED_RANKS == 64
    assert "the first 64" in " ".join(ranks["description"].split())


def test_status_entries_round_trip_through_the_status() -> None:
    moved = Adapter("a", "/models/a-v2")
    entries = adapters.status_entries(
        [moved, B, C], {"a": 1, "b": 0}, {"c": "400: no such directory"}, {"a": "/models/a"}
    )
    assert entries == [
        {"name": "a", "path": "/models/a", "loaded": True, "loadedEngines": 1},
        {"name": "b", "path": "/models/b", "loaded": True, "loadedEngines": 0},
        {"name": "c", "path": "/models/c", "loaded": False, "loadedEngines": 0,
         "error": "400: no such directory"},
    ]  # fmt: skip
    assert adapters.previous_paths(entries) == {"a": "/models/a", "b": "/models/b"}
    assert adapters.previous_errors(entries) == {"c": "400: no such directory"}
    assert adapters.previous_paths(None) == {} == adapters.previous_errors([])
