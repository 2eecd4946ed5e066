"""The kopf handlers and the API layer, against kmock's in-memory Kubernetes API.

The real operator (``kopf.operator`` with this package's handlers and login) runs in the
test's event loop and talks HTTP to kmock through a kubeconfig, like it would to a cluster.
kmock 0.8 quirks worked around here: objects get no ``resourceVersion`` (the fixtures set
one, kopf's JSON-patches test it), every watch replays all objects as ADDED (handlers must be
idempotent anyway), ``GET /api/v1/namespaces`` fails to parse (the operator runs
cluster-wide, where kopf does not list namespaces), and events POSTed without a name collide
(assertions read the event requests, not the stored events).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import pytest
import yaml
from kmock import Response
from kmock import resource as kmock_resource
from kubernetes.client import Configuration

from dpserve_operator import cluster as cluster_module
from dpserve_operator import handlers, main, rbac
from dpserve_operator.cluster import (
    ApiError,
    Cluster,
    bearer_token,
    choose_pdb_api_version,
    contains,
    replacement_for,
)
from tests import waiting

CR = "dpserve.io/v1alpha1/inferencedeployments"
NS = "default"
UID = "0d6c9a0e-0000-4000-8000-000000000001"
IMAGE = "ghcr.io/dpserve/runtime-cpu:0.1.0"
HEALTH_PATH = f"/api/v1/namespaces/{NS}/services/demo-coordinator:http/proxy/ready"
CHILDREN = [
    ("v1/services", "demo-coordinator"),
    ("v1/services", "demo-engine"),
    ("networking.k8s.io/v1/networkpolicies", "demo-coordinator"),
    ("networking.k8s.io/v1/networkpolicies", "demo-engine"),
    ("policy/v1/poddisruptionbudgets", "demo-engine"),
    ("apps/v1/deployments", "demo-coordinator"),
    ("apps/v1/statefulsets", "demo-engine"),
]

pytestmark = pytest.mark.timeout(90)


# --------------------------------------------------------------------------- fixtures


class Health:
    """What the fake coordinator's /health answers (mutable during a test)."""

    def __init__(self) -> None:
        self.status = 503
        self.engines = 0

    def response(self) -> Response:
        body = {"status": "ok" if self.engines else "no_engines", "engines": self.engines,
                "draining": 0, "queued": 0, "state": "running"}  # fmt: skip
        return Response(status=self.status, payload=body)


@pytest.fixture
def health() -> Health:
    return Health()


@pytest.fixture
def api(kmock: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, health: Health) -> Any:
    """kmock as a Kubernetes API with the CRD installed, reachable through $KUBECONFIG."""
    kmock.resources.load_bundled()
    kmock.resources[CR] = kmock.ResourceInfo(
        kind="InferenceDeployment",
        singular="inferencedeployment",
        namespaced=True,
        shortnames={"infd"},
        subresources={"status", "scale"},
        verbs={"list", "watch", "patch", "get", "create", "update", "delete"},
    )
    kmock["get", HEALTH_PATH] << (lambda: health.response())
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
                "users": [{"name": "operator", "user": {"token": "test-token"}}],
                "contexts": [
                    {"name": "kmock", "context": {"cluster": "kmock", "user": "operator"}}
                ],
                "current-context": "kmock",
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return kmock


def add_resource(api: Any, spec: dict[str, Any], *, name: str = "demo") -> None:
    api.objects[CR, NS, name] = {
        "apiVersion": "dpserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": UID,
            "generation": 1,
            "resourceVersion": "1",
        },
        "spec": spec,
    }


def live(api: Any, resource: str, name: str) -> dict[str, Any] | None:
    key = (kmock_resource(resource), NS, name)  # `in` does not parse "group/version/plural"
    if key not in api.objects or api.objects[key].deleted:
        return None
    raw: dict[str, Any] = api.objects[key].raw
    return raw


def resource_status(api: Any) -> dict[str, Any]:
    return (live(api, CR, "demo") or {}).get("status") or {}


def posted_events(api: Any) -> list[dict[str, Any]]:
    return [
        request.data
        for request in api
        if request.method == "POST" and request.url.path.endswith("/events")
    ]


# The operator's handlers run in kopf's own loop and thread: give them time.
eventually = functools.partial(waiting.eventually, within=20.0, interval=0.1)


@asynccontextmanager
async def operator_running() -> AsyncIterator[None]:
    """The operator in its own thread and event loop, as ``dpserve operator`` would run.

    Not in the test's loop: on exit kopf waits for, then cancels, every task of its loop,
    which would include kmock's server tasks.
    """
    stop = threading.Event()
    failures: list[BaseException] = []

    def run() -> None:
        try:
            settings = kopf.OperatorSettings()
            # Per-object workers linger this long after their last event; kopf's shutdown
            # waits for them (5 s by default).
            settings.queueing.idle_timeout = 0.5
            operator = kopf.operator(
                standalone=True, clusterwide=True, stop_flag=stop, settings=settings
            )
            asyncio.run(operator)
        except BaseException as error:  # reported in the test's thread below
            failures.append(error)

    thread = threading.Thread(target=run, name="operator", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 30)
        assert not thread.is_alive(), "the operator did not stop"
        if failures:
            raise failures[0]


def handler_failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name.startswith("kopf")
        and re.search(r"failed with an exception|will retry|permanently", record.getMessage())
    ]


# --------------------------------------------------------------------------- the operator


async def test_reconcile_creates_children_owned_by_the_resource(
    api: Any, caplog: pytest.LogCaptureFixture
) -> None:
    add_resource(api, {"model": "smollm2-135m-instruct", "image": IMAGE, "dataParallelSize": 2})
    async with operator_running():
        await eventually(lambda: all(live(api, res, name) for res, name in CHILDREN))
        await eventually(lambda: resource_status(api).get("observedGeneration") == 1)

    for resource, name in CHILDREN:
        child = live(api, resource, name)
        assert child is not None
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner["uid"] == UID
        assert (owner["kind"], owner["name"]) == ("InferenceDeployment", "demo")
        assert owner["controller"] is True and owner["blockOwnerDeletion"] is True
    statefulset = live(api, "apps/v1/statefulsets", "demo-engine")
    assert statefulset is not None
    assert statefulset["spec"]["replicas"] == 2
    command = statefulset["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--rank") + 1] == "auto"
    assert "tcp://demo-coordinator.default.svc:5555" in command

    status = resource_status(api)
    assert status["selector"] == (
        "app.kubernetes.io/component=engine,app.kubernetes.io/instance=demo,"
        "app.kubernetes.io/name=dpserve"
    )
    assert status["phase"] == "Pending"  # no engine pod runs in kmock
    assert status["registeredEngines"] == 0  # read from the 503 answer of /health
    applied = [e for e in posted_events(api) if e["reason"] == "Applied"]
    assert applied and "created StatefulSet/demo-engine" in applied[0]["message"]
    assert handler_failures(caplog) == []


async def test_invalid_spec_degrades_without_raising(
    api: Any, caplog: pytest.LogCaptureFixture
) -> None:
    add_resource(api, {"model": "m", "image": "not an image", "dataParallelSize": "two"})

    def invalid_spec_warnings() -> list[dict[str, Any]]:
        return [e for e in posted_events(api) if e["reason"] == "InvalidSpec"]

    async with operator_running():
        await eventually(lambda: resource_status(api).get("phase") == "Degraded")
        # kmock's watch replays the object listed just before, and all its versions share one
        # resourceVersion, so kopf may handle the creation twice (a real server: once).
        await asyncio.sleep(1)
        warned = len(invalid_spec_warnings())
        assert warned in (1, 2)
        await asyncio.sleep(3)  # a status refresh or two: it must stay Degraded, silently
        assert len(invalid_spec_warnings()) == warned

    status = resource_status(api)
    degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert "spec.image: 'not an image'" in degraded["message"]
    assert "spec.dataParallelSize: must be an integer" in degraded["message"]
    assert status["observedGeneration"] == 1
    warning = invalid_spec_warnings()[0]
    assert warning["type"] == "Warning"
    assert warning["involvedObject"]["uid"] == UID
    assert warning["message"] == degraded["message"]
    assert all(live(api, resource, name) is None for resource, name in CHILDREN)
    assert handler_failures(caplog) == []


async def test_a_rejected_child_degrades_without_raising(
    api: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # An admission webhook or quota refusing the NetworkPolicy: not worth retrying as is.
    policies = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"
    refusal = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 422,
               "reason": "Invalid", "message": "denied by policy-webhook"}  # fmt: skip
    api["post", policies] << (lambda: Response(status=422, payload=refusal))
    # kmock stores even refused objects; keep them invisible so every attempt fails alike.
    api["get", f"{policies}/demo-coordinator"] << (lambda: Response(status=404, payload={}))
    add_resource(api, {"model": "m", "image": IMAGE})
    async with operator_running():
        await eventually(lambda: resource_status(api).get("phase") == "Degraded")
        await asyncio.sleep(2.5)  # a status refresh keeps it Degraded

    status = resource_status(api)
    degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")
    assert degraded["message"].startswith("NetworkPolicy/demo-coordinator: 422 Invalid")
    assert "denied by policy-webhook" in degraded["message"]
    assert status["phase"] == "Degraded"
    assert any(e["reason"] == "ApplyFailed" for e in posted_events(api))
    assert handler_failures(caplog) == []


async def test_status_turns_ready_when_the_engines_register(api: Any, health: Health) -> None:
    add_resource(api, {"model": "m", "image": IMAGE, "dataParallelSize": 2})
    async with operator_running():
        await eventually(lambda: resource_status(api).get("phase") == "Pending")
        # What the StatefulSet/Deployment controllers and the coordinator would report.
        api.objects["apps/v1/statefulsets", NS, "demo-engine"].patch(
            {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}}
        )
        api.objects["apps/v1/deployments", NS, "demo-coordinator"].patch(
            {"status": {"replicas": 1, "readyReplicas": 1}}
        )
        health.status, health.engines = 200, 2
        await eventually(lambda: resource_status(api).get("phase") == "Ready")

    status = resource_status(api)
    assert (status["replicas"], status["readyReplicas"], status["registeredEngines"]) == (2, 2, 2)
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"]) == ("True", "AllEnginesRegistered")
    assert any(e["reason"] == "Ready" for e in posted_events(api))


async def test_scaling_patches_only_the_statefulset_replicas(api: Any) -> None:
    add_resource(api, {"model": "m", "image": IMAGE, "dataParallelSize": 2})
    async with operator_running():
        await eventually(lambda: resource_status(api).get("observedGeneration") == 1)
        # What `kubectl scale infd/demo --replicas=3` does (and the API server's generation).
        async with aiohttp.ClientSession(base_url=str(api.url)) as session:
            response = await session.patch(
                f"/apis/{CR.rsplit('/', 1)[0]}/namespaces/{NS}/inferencedeployments/demo",
                json={"metadata": {"generation": 2}, "spec": {"dataParallelSize": 3}},
                headers={"Content-Type": "application/merge-patch+json"},
            )
            assert response.status == 200
        await eventually(lambda: resource_status(api).get("observedGeneration") == 2)

    scale_patches = [
        request.data
        for request in api
        if request.method == "PATCH" and request.url.path.endswith("/statefulsets/demo-engine")
    ]
    # Only the replicas (kmock's constant resourceVersion may make kopf repeat the handler).
    assert scale_patches and all(patch == {"spec": {"replicas": 3}} for patch in scale_patches)
    statefulset = live(api, "apps/v1/statefulsets", "demo-engine")
    assert statefulset is not None and statefulset["spec"]["replicas"] == 3
    scaling = [e for e in posted_events(api) if e["reason"] == "Scaling"]
    assert scaling and scaling[0]["message"] == "engines: 2 → 3"


METRICS_PATH = f"/api/v1/namespaces/{NS}/services/demo-coordinator:http/proxy/metrics"
SCALE_PATH = f"/apis/dpserve.io/v1alpha1/namespaces/{NS}/inferencedeployments/demo/scale"
# The coordinator's page while one request is held at zero engines (the front's names).
HELD_AT_ZERO = """\
dpserve_coordinator_up 1.0
dpserve_registered_engines 0.0
dpserve_draining_engines 0.0
dpserve_queued_requests 1.0
dpserve_coordinator_inflight_requests 1.0
"""


async def test_the_autoscaler_scales_from_zero_through_the_scale_subresource(api: Any) -> None:
    api["get", METRICS_PATH] << (lambda: Response(status=200, payload=HELD_AT_ZERO))

    def scaled(request: Any) -> Response:
        # What the API server does with a scale PATCH: spec.dataParallelSize follows.
        replicas = request.data["spec"]["replicas"]
        api.objects[CR, NS, "demo"].patch({"spec": {"dataParallelSize": replicas}})
        return Response(status=200, payload={"kind": "Scale", "spec": {"replicas": replicas}})

    api["patch", SCALE_PATH] << scaled
    autoscaling = {"minReplicas": 0, "maxReplicas": 3, "scaleDownWindowSeconds": 60}
    add_resource(api, {"model": "m", "image": IMAGE, "dataParallelSize": 0,
                       "autoscaling": autoscaling})  # fmt: skip
    async with operator_running():
        await eventually(
            lambda: (
                (resource_status(api).get("autoscaling") or {}).get("reason") == "ScaledFromZero"
            )
        )

    patches = [r.data for r in api if r.method == "PATCH" and r.url.path == SCALE_PATH]
    assert patches[0] == {"spec": {"replicas": 1}}
    status = resource_status(api)["autoscaling"]
    assert status["desiredReplicas"] == 1 and status["heldRequests"] == 1
    assert status["metric"] == "QueuedRequestsPerEngine" and "1 held" in status["signal"]
    events = [e for e in posted_events(api) if e["reason"] == "ScaledFromZero"]
    assert events and events[0]["message"].startswith("engines 0 → 1: ")
    coordinator = live(api, "apps/v1/deployments", "demo-coordinator")
    assert coordinator is not None
    assert (
        "--ready-without-engines"
        in coordinator["spec"]["template"]["spec"]["containers"][0]["command"]
    )


async def test_without_builtin_autoscaling_nothing_is_scaled(api: Any) -> None:
    api["get", METRICS_PATH] << (lambda: Response(status=200, payload=HELD_AT_ZERO))
    add_resource(api, {"model": "m", "image": IMAGE, "dataParallelSize": 0,
                       "autoscaling": {"mode": "External"}})  # fmt: skip
    async with operator_running():
        await eventually(lambda: resource_status(api).get("observedGeneration") == 1)
        await asyncio.sleep(3 * handlers.AUTOSCALE_TICK_SECONDS)
    assert not [r for r in api if r.url.path in (SCALE_PATH, METRICS_PATH)]
    assert "autoscaling" not in resource_status(api)


async def test_a_kubernetes_1_20_server_gets_a_policy_v1beta1_budget(api: Any) -> None:
    del api.resources["policy/v1/poddisruptionbudgets"]
    api.resources["policy/v1beta1/poddisruptionbudgets"] = api.ResourceInfo(
        kind="PodDisruptionBudget", namespaced=True, verbs={"get", "create", "update"}
    )
    add_resource(api, {"model": "m", "image": IMAGE})
    async with operator_running():
        await eventually(lambda: live(api, "apps/v1/statefulsets", "demo-engine") is not None)
    budget = live(api, "policy/v1beta1/poddisruptionbudgets", "demo-engine")
    assert budget is not None and budget["apiVersion"] == "policy/v1beta1"
    assert live(api, "policy/v1/poddisruptionbudgets", "demo-engine") is None


async def test_every_api_call_is_declared_in_the_rbac_table(api: Any) -> None:
    add_resource(api, {"model": "m", "image": IMAGE, "dataParallelSize": 2})
    async with operator_running():
        await eventually(lambda: resource_status(api).get("observedGeneration") == 1)
        await asyncio.sleep(2.5)  # at least one status refresh (reads + service proxy)

    used = {permission_of(request) for request in api} - {None}
    assert ("", "services/proxy", "get") in used and ("apps", "statefulsets", "create") in used
    assert used <= rbac.PERMISSIONS, used - rbac.PERMISSIONS


def permission_of(request: Any) -> tuple[str, str, str] | None:
    """The RBAC (group, resource, verb) a request needs; None for discovery."""
    match = re.match(
        r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)"
        r"(?:/namespaces/[^/]+)?/(?P<resource>[^/]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?",
        request.url.path,
    )
    if match is None or (request.url.path.count("/") < 3 and match["group"] is not None):
        return None  # /api, /apis, /apis/group, /apis/group/version
    resource = match["resource"] + (f"/{match['sub']}" if match["sub"] else "")
    if request.method == "GET":
        verb = "get" if match["name"] else ("watch" if request.params.get("watch") else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[
            str(request.method.value)
        ]
    return (match["group"] or "", resource, verb)


# --------------------------------------------------------------------------- Cluster, direct


@pytest.fixture
def cluster(api: Any) -> Cluster:
    return Cluster.from_environment()


SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "demo-coordinator", "namespace": NS, "labels": {"a": "b"}},
    "spec": {"selector": {"a": "b"}, "ports": [{"name": "http", "port": 8000}]},
}


async def test_apply_creates_then_leaves_alone_then_replaces(api: Any, cluster: Cluster) -> None:
    # kmock 0.8 has no PUT: answer it with the object sent, as a server would.
    api["put", f"/api/v1/namespaces/{NS}/services/demo-coordinator"] << (
        lambda request: request.data
    )
    assert await asyncio.to_thread(cluster.apply, SERVICE) == "created"
    # The server's additions (clusterIP, resourceVersion, foreign annotations) stay put.
    api.objects["v1/services", NS, "demo-coordinator"].patch(
        {
            "metadata": {"resourceVersion": "42", "annotations": {"other": "keep"}},
            "spec": {"clusterIP": "10.0.0.7", "ports": [{"name": "http", "port": 8000,
                                                         "protocol": "TCP"}]},
        }
    )  # fmt: skip
    assert await asyncio.to_thread(cluster.apply, SERVICE) == "unchanged"

    changed = {**SERVICE, "spec": {**SERVICE["spec"], "ports": [{"name": "http", "port": 9000}]}}
    assert await asyncio.to_thread(cluster.apply, changed) == "updated"
    (put,) = [request for request in api if request.method == "PUT"]
    assert put.data["metadata"]["resourceVersion"] == "42"
    assert put.data["metadata"]["annotations"] == {"other": "keep"}
    assert put.data["spec"]["clusterIP"] == "10.0.0.7"
    assert put.data["spec"]["ports"] == [{"name": "http", "port": 9000}]


async def test_scaling_a_missing_statefulset_reports_false(cluster: Cluster) -> None:
    assert await asyncio.to_thread(cluster.scale_statefulset, NS, "nothing", 3) is False


async def test_health_reads_the_coordinator_json_also_on_503(
    cluster: Cluster, health: Health
) -> None:
    body, error = await asyncio.to_thread(
        cluster.coordinator_health, NS, "demo-coordinator", "http"
    )
    assert error is None and body is not None
    assert (body["status"], body["engines"]) == ("no_engines", 0)


async def test_health_tells_an_api_server_error_from_the_coordinator(
    api: Any, cluster: Cluster
) -> None:
    no_endpoints = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": 503,
        "message": 'no endpoints available for service "other:http"',
    }
    api["get", f"/api/v1/namespaces/{NS}/services/other:http/proxy/ready"] << (
        lambda: Response(status=503, payload=no_endpoints)
    )
    body, error = await asyncio.to_thread(cluster.coordinator_health, NS, "other", "http")
    assert body is None
    assert error is not None and "no endpoints available" in error
    # A service without any answer at all (404 from kmock) is unreachable too.
    body, error = await asyncio.to_thread(cluster.coordinator_health, NS, "missing", "http")
    assert body is None and error is not None


async def test_undeclared_permissions_are_refused_before_any_request(
    api: Any, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rbac, "PERMISSIONS", rbac.PERMISSIONS - {("apps", "deployments", "get")})
    before = len(list(api))
    with pytest.raises(rbac.UndeclaredPermission, match="deployments"):
        await asyncio.to_thread(cluster.read, "apps/v1", "Deployment", NS, "demo-coordinator")
    assert len(list(api)) == before


async def test_api_errors_are_classified(cluster: Cluster) -> None:
    with pytest.raises(ApiError) as raised:
        await asyncio.to_thread(
            cluster.request, "GET", "/apis/apps/v1/namespaces/default/deployments/none"
        )
    assert raised.value.status == 404 and not raised.value.transient
    assert ApiError(409, "Conflict", "").transient and ApiError(503, "", "").transient
    assert ApiError(0, "ConnectionError", "").transient
    assert not ApiError(422, "Invalid", "").transient


# --------------------------------------------------------------------------- pure helpers


def test_pdb_version_choice() -> None:
    def group(*versions: str) -> dict[str, Any]:
        return {"versions": [{"groupVersion": f"policy/{v}", "version": v} for v in versions]}

    assert choose_pdb_api_version(group("v1", "v1beta1")) == "policy/v1"
    assert choose_pdb_api_version(group("v1beta1")) == "policy/v1beta1"
    assert choose_pdb_api_version(None) == "policy/v1"


def test_contains_ignores_server_additions_but_not_changes() -> None:
    desired = {"spec": {"replicas": 2, "resources": {"limits": {"cpu": "0.5"}}, "ingress": []}}
    live_object = {"spec": {"replicas": 2, "resources": {"limits": {"cpu": "500m"}},
                            "extra": True}, "status": {}}  # fmt: skip
    assert contains(live_object, desired)  # omitted [] and canonical quantities are equal
    assert not contains(live_object, {"spec": {"replicas": 3}})
    assert not contains({"a": [1, 2]}, {"a": [1]})
    assert not contains({"a": 1}, {"a": True})  # bool is not int
    assert not contains({"image": "x:1.0"}, {"image": "x:1"})  # only quantities are normalised


def test_replacement_keeps_rollout_restarts_and_foreign_owners() -> None:
    desired = {
        "kind": "Deployment",
        "metadata": {"name": "d", "ownerReferences": [{"uid": "ours"}]},
        "spec": {"template": {"metadata": {"annotations": {"mine": "1"}}}},
    }
    live_object = {
        "metadata": {"resourceVersion": "7", "finalizers": ["f"],
                     "ownerReferences": [{"uid": "ours"}, {"uid": "theirs"}]},
        "spec": {"template": {"metadata": {"annotations": {
            "kubectl.kubernetes.io/restartedAt": "now", "mine": "0"}}}},
    }  # fmt: skip
    replacement = replacement_for(desired, live_object)
    assert replacement["metadata"]["resourceVersion"] == "7"
    assert replacement["metadata"]["finalizers"] == ["f"]
    assert [ref["uid"] for ref in replacement["metadata"]["ownerReferences"]] == ["ours", "theirs"]
    assert replacement["spec"]["template"]["metadata"]["annotations"] == {
        "kubectl.kubernetes.io/restartedAt": "now",
        "mine": "1",
    }
    assert desired["spec"]["template"]["metadata"]["annotations"] == {"mine": "1"}  # untouched


def test_bearer_token_from_a_client_configuration() -> None:
    configuration = Configuration()
    assert bearer_token(configuration) == (None, None)
    configuration.api_key["BearerToken"] = "abc"
    configuration.api_key_prefix["BearerToken"] = "Bearer"
    assert bearer_token(configuration) == ("Bearer", "abc")


def test_login_reads_kubeconfig_at_call_time(api: Any) -> None:
    info = handlers.login(settings=kopf.OperatorSettings(), logger=logging.getLogger("test"))
    assert info.server == str(api.url).rstrip("/")
    assert (info.scheme, info.token) == ("Bearer", "test-token")
    assert cluster_module.load_configuration().host == info.server


async def test_quiet_filter_drops_only_the_status_refresh_successes(
    api: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kopf")
    add_resource(api, {"model": "m", "image": IMAGE})
    async with operator_running():
        await eventually(lambda: "Timer 'refresh-status' succeeded." in caplog.messages, within=10)
    quiet = main.QuietStatusRefresh()
    objects = [record for record in caplog.records if record.name == "kopf.objects"]
    dropped = [record.getMessage() for record in objects if not quiet.filter(record)]
    assert "Timer 'refresh-status' succeeded." in dropped
    assert set(dropped) <= {"Timer 'refresh-status' succeeded.", "Timer 'autoscale' succeeded."}
    assert any(quiet.filter(r) and "succeeded" in r.getMessage() for r in objects)


@pytest.mark.parametrize(("namespace", "all_namespaces"), [(None, False), ("ml", True)])
def test_run_wants_exactly_one_scope(namespace: str | None, all_namespaces: bool) -> None:
    with pytest.raises(ValueError, match="namespace"):
        main.run(namespace, all_namespaces)
