"""The operator the whole way, on the real (v1.20) control plane.

One operator and one InferenceDeployment are shared by the tests of this module, which run
in file order, each building on the state the previous one checked:

1. the CRD from ``crds/`` is applied and Established; the Helm chart's rendered manifests
   are applied like ``helm install`` would, and the node agent runs the chart's operator
   Deployment (``dpserve operator --all-namespaces``) as a local process;
2. a copy of ``examples/inference.yaml`` (tiny model, free ports, 2 engines) is applied;
   the operator creates every child with an owner reference, the pods carry the hardening
   the operator asked for (as stored by the API server), the engines register, the status
   turns Ready with ``registeredEngines == 2`` and ``kubectl get infd`` shows it;
3. the pods run with CURVE (each mounting only its keys); ``dpserve generate``, with the
   client credentials fetched from ``demo-client-credentials`` as docs/kubernetes.md says,
   and the HTTP front answer through the coordinator; no credentials, no answer;
4. under a steady request load, ``kubectl patch`` (2 → 3), ``kubectl edit`` (3 → 1) and
   ``kubectl scale`` (1 → 2) resize the engines without a single failed request; deleting
   ``demo-credentials`` rotates the keys: new Secret, pods rolled, old keys refused;
5. the API server rejects invalid resources naming the field; the operator reports what the
   schema cannot check as Degraded/InvalidSpec;
6. deleting the resource garbage-collects every child; the fixture then uninstalls as
   docs/kubernetes.md says (delete the resources, the chart's objects, then the CRD).

Differences from docs/kubernetes.md forced by the test cluster: ``kubectl port-forward``
needs a kubelet, so clients dial the node agent's loopback (every pod lives on 127.0.0.1)
directly; ``helm install`` is `helm_python`'s render plus ``kubectl apply``; the model is
the tiny test model (a local path works: pods are local processes); the ports come from
`free_ports`, and the operator's liveness port is moved off 8080 the same way (pods share
the host's loopback, and the chart has no value for that port). The operator pod acts with
the agent's admin KUBECONFIG on an AlwaysAllow API server, so the chart's RBAC is applied
but not exercised here (tests/unit/test_chart.py checks it equals operator/rbac.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from dpserve_operator.crd import API_VERSION, GROUP, KIND, PLURAL, VERSION
from tests.e2e import manifests
from tests.e2e.cluster import (
    LOOPBACK,
    Kubectl,
    create_namespace,
    delete_namespace,
    free_ports,
    wait_for,
)
from tests.e2e.conftest import namespace_diagnostics
from tests.e2e.node_agent import NodeAgent

pytestmark = pytest.mark.e2e

JSON = dict[str, Any]

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "inferencedeployment.yaml"
CHART = ROOT / "charts" / "dpserve-operator"
EXAMPLE = ROOT / "examples" / "inference.yaml"
DPSERVE = Path(sys.executable).parent / "dpserve"

CRD_NAME = f"{PLURAL}.{GROUP}"
RELEASE, OPERATOR_NS = "dpserve-operator", "dpserve-system"
NAME = "demo"  # as in examples/inference.yaml
INSTANCE_SELECTOR = f"app.kubernetes.io/instance={NAME}"
ENGINE_SELECTOR = f"{INSTANCE_SELECTOR},app.kubernetes.io/component=engine"
COORDINATOR_SELECTOR = f"{INSTANCE_SELECTOR},app.kubernetes.io/component=coordinator"

STARTUP_TIMEOUT = 60.0  # operator pod, CRD, children
# Engines importing torch on a shared 2-core machine. When each pod still built the CPU kernels
# into its own cache first (before the node gave its pods the image's prebuilt ones, conftest),
# that took 57 s for two at once and 76 s for a third beside two serving this file's load (CI,
# 2026-11-30), which left 90 s short; the margin stays for slower CI machines.
READY_TIMEOUT = 180.0
SCALE_TIMEOUT = 60.0
DELETE_TIMEOUT = 60.0

# (kind as `kubectl get` names it, object name) of every child of InferenceDeployment `demo`.
CHILDREN = [
    ("deployment.apps", f"{NAME}-coordinator", "Deployment"),
    ("service", f"{NAME}-coordinator", "Service"),
    ("service", f"{NAME}-engine", "Service"),
    ("statefulset.apps", f"{NAME}-engine", "StatefulSet"),
    ("poddisruptionbudget.policy", f"{NAME}-engine", "PodDisruptionBudget"),
    ("networkpolicy.networking.k8s.io", f"{NAME}-coordinator", "NetworkPolicy"),
    ("networkpolicy.networking.k8s.io", f"{NAME}-engine", "NetworkPolicy"),
    ("secret", f"{NAME}-credentials", "Secret"),
    ("secret", f"{NAME}-client-credentials", "Secret"),
]
HASH_ANNOTATION = "dpserve.io/credentials-hash"
CLIENT_SECRET = f"{NAME}-client-credentials"
# docs/kubernetes.md, "Talk to it": fetching the client credentials (a test checks the docs
# hold these very lines; the test runs them with `kubectl` pointed at the test cluster).
FETCH_CREDENTIALS = """\
creds="${XDG_RUNTIME_DIR:-$HOME/.config}/dpserve/demo-credentials"   # yours only, not in a clone
(umask 077; mkdir -p "$creds"
 for file in coordinator.key client.key_secret admin.key_secret http-api-token http-admin-token; do
   kubectl get secret demo-client-credentials \\
     -o go-template="{{index .data \\"$file\\" | base64decode}}" > "$creds/$file"
 done)
"""


# -- shared state -------------------------------------------------------------------------


@dataclass
class Operator:
    """The chart's operator, run by the node agent."""

    manifests: list[JSON]
    liveness_port: int
    pod: str = ""


@dataclass
class Inference:
    """The shared InferenceDeployment and what is needed to talk to it."""

    namespace: str
    zmq_port: int
    http_port: int
    manifest_path: Path
    core: k8s.CoreV1Api
    apps: k8s.AppsV1Api
    custom: k8s.CustomObjectsApi
    agent: NodeAgent
    operator: Operator
    workdir: Path
    credentials: Path | None = None  # the client credentials, once fetched

    @property
    def address(self) -> str:
        return f"tcp://{LOOPBACK}:{self.zmq_port}"

    def read(self, name: str = NAME) -> JSON:
        obj: JSON = self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name
        )
        return obj

    def statefulset(self) -> JSON:
        response = self.apps.read_namespaced_stateful_set(
            f"{NAME}-engine", self.namespace, _preload_content=False
        )
        return dict(json.loads(response.data))

    def pods(self, selector: str) -> list[JSON]:
        response = self.core.list_namespaced_pod(
            self.namespace, label_selector=selector, _preload_content=False
        )
        return list(json.loads(response.data).get("items") or [])

    def diagnostics(self) -> str:
        lines = []
        with contextlib.suppress(ApiException):
            status = self.read().get("status")
            lines.append(f"==== status of {NAME}: {json.dumps(status, indent=1)}")
        lines.append(namespace_diagnostics(self.core, self.namespace, self.agent))
        lines.append(operator_log_tail(self.agent, self.operator))
        return "\n".join(lines)

    def wait_status(self, what: str, predicate: Callable[[JSON], bool], timeout: float) -> JSON:
        def check() -> JSON | None:
            status = self.read().get("status") or {}
            return status if predicate(status) else None

        status: JSON = wait_for(
            check, timeout, f"{self.namespace}/{NAME} {what}", diagnostics=self.diagnostics
        )
        return status


def operator_log_tail(agent: NodeAgent, operator: Operator, lines: int = 60) -> str:
    if not operator.pod:
        return "---- operator pod not started"
    text = agent.read_log(OPERATOR_NS, operator.pod)
    return f"---- operator log (last {lines} lines)\n" + "\n".join(text.splitlines()[-lines:])


def ready_with(engines: int) -> Callable[[JSON], bool]:
    def predicate(status: JSON) -> bool:
        return (
            status.get("phase") == "Ready"
            and status.get("registeredEngines") == engines
            and status.get("readyReplicas") == engines
            and status.get("replicas") == engines
        )

    return predicate


def condition(status: JSON, kind: str) -> JSON:
    for item in status.get("conditions") or []:
        if item.get("type") == kind:
            return dict(item)
    raise AssertionError(f"no {kind} condition in {status}")


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}{path}", timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def fetch_client_credentials(kubectl: Kubectl, namespace: str, workdir: Path) -> Path:
    """Run the docs' commands in ``workdir``; returns the credentials directory."""
    workdir.mkdir(parents=True, exist_ok=True)
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    assert FETCH_CREDENTIALS in docs, "docs/kubernetes.md no longer shows FETCH_CREDENTIALS"
    shim = workdir / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "kubectl").write_text(
        f'#!/bin/sh\nexec "{kubectl.binary}" --kubeconfig="{kubectl.kubeconfig}" '
        f'-n "{namespace}" "$@"\n'
    )
    (shim / "kubectl").chmod(0o755)
    result = subprocess.run(
        ["bash", "-ec", FETCH_CREDENTIALS],
        cwd=workdir,
        # $HOME: the workdir, so the keys land in it (no XDG_RUNTIME_DIR).
        env={"PATH": f"{shim}:/usr/bin:/bin", "HOME": str(workdir)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    directory = credentials_directory(workdir)
    assert not (workdir / "demo-credentials").exists()  # not in the current directory
    for file in ("coordinator.key", "client.key_secret", "admin.key_secret"):
        assert "public-key" in (directory / file).read_text(), file
        assert (directory / file).stat().st_mode & 0o077 == 0, file
    assert len((directory / "http-api-token").read_text().strip()) >= 32
    assert (directory / "http-api-token").stat().st_mode & 0o077 == 0
    return directory


def credentials_directory(workdir: Path) -> Path:
    """Where FETCH_CREDENTIALS, run by ``fetch_client_credentials`` in ``workdir``, puts the
    keys: ``$HOME/.config/dpserve/demo-credentials`` with $HOME the workdir."""
    return workdir / ".config" / "dpserve" / "demo-credentials"


def dpserve_generate(
    address: str, credentials: Path | None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    extra = [] if credentials is None else ["--credentials", str(credentials)]
    return subprocess.run(
        [str(DPSERVE), "generate", "Hello", "--address", address, "--max-tokens", "8", *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# -- fixtures -----------------------------------------------------------------------------


def remove_namespace(core: k8s.CoreV1Api, name: str, agent: NodeAgent) -> None:
    """Delete the namespace and wait for its Pods (so their processes) to be gone."""
    delete_namespace(
        core, name, DELETE_TIMEOUT, diagnostics=lambda: namespace_diagnostics(core, name, agent)
    )


def render_chart(liveness_port: int) -> list[JSON]:
    """``helm install dpserve-operator charts/dpserve-operator -n dpserve-system``'s objects."""
    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render({}, name=RELEASE, namespace=OPERATOR_NS, is_install=True)
    objects = [
        doc
        for path, text in sorted(rendered.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["dpserve", "operator", "--all-namespaces"]
    # Pods share the host's loopback here: move kopf's liveness endpoint off 8080.
    container["command"] = [*container["command"], "--liveness-port", str(liveness_port)]
    (port,) = container["ports"]
    assert port["name"] == "liveness" and port["containerPort"] == 8080
    port["containerPort"] = liveness_port
    return objects


def assert_empty_strings_accepted(kubectl: Kubectl) -> None:
    """Fail fast on a control plane that takes "" in a custom resource for null.

    The operator's status conditions carry empty messages; a server that rejects them never
    shows a status, which would otherwise only surface as a 90 s timeout much later.
    """
    probe = bad_resource("empty-string-probe", {"engine": {"env": [{"name": "A", "value": ""}]}})
    probe["metadata"]["namespace"] = "default"
    result = kubectl(
        "create", "--dry-run=server", "--validate=false", "-f", "-", "-o", "json",
        input=yaml.safe_dump(probe), check=False,
    )  # fmt: skip
    assert result.returncode == 0, (
        "the test control plane rejects empty strings in custom resources, so no status "
        "with an empty condition message can be written. kube-apiserver 1.20 built with "
        "Go >= 1.19: kube-openapi's type validator (vendor/k8s.io/kube-openapi/pkg/validation/"
        'validate/type.go) treats a decoded "" as null; see scripts/build-control-plane.sh.\n'
        + result.stderr
    )
    assert json.loads(result.stdout)["spec"]["engine"]["env"] == [{"name": "A", "value": ""}]


@pytest.fixture(scope="module")
def operator(kubectl: Kubectl, node_agent: NodeAgent, k8s_client: Any) -> Iterator[Operator]:
    core = k8s.CoreV1Api(k8s_client)
    (liveness_port,) = free_ports(1)
    installed = Operator(render_chart(liveness_port), liveness_port)

    # Helm installs the chart's crds/ first; it is the same file as crds/ (unit-tested).
    assert (CHART / "crds" / CRD_FILE.name).read_text() == CRD_FILE.read_text()
    kubectl("apply", "-f", str(CRD_FILE))
    created_namespace = False
    try:

        def established() -> bool:
            crd = kubectl.json("get", "crd", CRD_NAME)
            return any(
                c["type"] == "Established" and c["status"] == "True"
                for c in crd.get("status", {}).get("conditions") or []
            )

        wait_for(established, 30, f"CRD {CRD_NAME} to be Established")
        assert_empty_strings_accepted(kubectl)

        create_namespace(core, OPERATOR_NS)  # helm install --create-namespace
        created_namespace = True
        kubectl.apply(installed.manifests)

        def operator_pod() -> str | None:
            response = core.list_namespaced_pod(
                OPERATOR_NS,
                label_selector=f"app.kubernetes.io/instance={RELEASE}",
                _preload_content=False,
            )
            for pod in json.loads(response.data).get("items") or []:
                if pod.get("status", {}).get("phase") == "Running":
                    return str(pod["metadata"]["name"])
            return None

        installed.pod = wait_for(
            operator_pod,
            STARTUP_TIMEOUT,
            "the chart's operator pod to run",
            diagnostics=lambda: namespace_diagnostics(core, OPERATOR_NS, node_agent),
        )

        # kopf's liveness endpoint answers once the operator's event loop runs.
        def live() -> bool:
            with contextlib.suppress(OSError):
                return http_get(liveness_port, "/healthz", timeout=2)[0] == 200
            return False

        wait_for(
            live,
            STARTUP_TIMEOUT,
            "the operator's liveness endpoint",
            diagnostics=lambda: operator_log_tail(node_agent, installed),
        )
        yield installed
    finally:
        # docs/kubernetes.md, "Uninstall": resources first (while the operator still runs
        # to drop kopf's finalizer), then the chart's objects (helm uninstall), then the CRD.
        steps = [
            kubectl(
                "delete", "infd", "--all", "--all-namespaces", "--timeout=60s",
                check=False, timeout=90,
            ),
            kubectl(
                "delete", "--ignore-not-found", "--timeout=60s", "-f", "-",
                input=yaml.safe_dump_all(installed.manifests), check=False, timeout=90,
            ),
        ]  # fmt: skip
        if created_namespace:
            remove_namespace(core, OPERATOR_NS, node_agent)
        steps.append(
            kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--timeout=60s", check=False)
        )
        failed = [f"{' '.join(s.args[2:])}: {s.stderr.strip()}" for s in steps if s.returncode]
        assert not failed, f"uninstalling as documented failed: {failed}"


@pytest.fixture(scope="module")
def inference(
    operator: Operator,
    kubectl: Kubectl,
    node_agent: NodeAgent,
    k8s_client: Any,
    tiny_model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Inference]:
    """examples/inference.yaml with the tiny model, free ports and 2 engines, applied."""
    core = k8s.CoreV1Api(k8s_client)
    namespace = f"e2e-operator-{int(time.time() * 1000) % 1_000_000}"
    create_namespace(core, namespace)
    zmq_port, http_port = free_ports(2)
    manifest = yaml.safe_load(EXAMPLE.read_text())
    assert manifest["metadata"]["name"] == NAME
    manifest["spec"]["model"] = str(tiny_model_path)
    manifest["spec"]["dataParallelSize"] = 2
    manifest["spec"]["coordinator"]["zmqPort"] = zmq_port
    manifest["spec"]["coordinator"]["httpPort"] = http_port
    workdir = tmp_path_factory.mktemp("operator")
    path = workdir / "inference.yaml"
    path.write_text(yaml.safe_dump(manifest))
    state = Inference(
        namespace=namespace,
        zmq_port=zmq_port,
        http_port=http_port,
        manifest_path=path,
        core=core,
        apps=k8s.AppsV1Api(k8s_client),
        custom=k8s.CustomObjectsApi(k8s_client),
        agent=node_agent,
        operator=operator,
        workdir=workdir,
    )
    try:
        kubectl("apply", "-f", str(path), "-n", namespace)
        yield state
    finally:
        kubectl("delete", "infd", "--all", "-n", namespace, "--timeout=60s", check=False)
        remove_namespace(core, namespace, node_agent)


# -- 1. install ---------------------------------------------------------------------------


def test_chart_operator_runs_in_its_pod(
    operator: Operator, node_agent: NodeAgent, k8s_client: Any, kubectl: Kubectl
) -> None:
    core = k8s.CoreV1Api(k8s_client)
    kinds = sorted(obj["kind"] for obj in operator.manifests)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"]
    pod = json.loads(
        core.read_namespaced_pod(operator.pod, OPERATOR_NS, _preload_content=False).data
    )
    assert pod["spec"]["serviceAccountName"] == RELEASE
    assert_hardened(pod, expect_token=True)
    pids = node_agent.pids(OPERATOR_NS, operator.pod)
    assert pids.get("operator") is not None, pids
    assert http_get(operator.liveness_port, "/healthz")[0] == 200
    # The ClusterRole as stored matches what the chart rendered.
    role = kubectl.json("get", "clusterrole", RELEASE)
    (rendered_role,) = [o for o in operator.manifests if o["kind"] == "ClusterRole"]
    assert role["rules"] == rendered_role["rules"]


# -- 2. the InferenceDeployment comes up --------------------------------------------------


def test_children_exist_with_owner_references(inference: Inference, kubectl: Kubectl) -> None:
    owner = inference.read()
    expected_reference = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": NAME,
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }

    def all_children() -> dict[tuple[str, str], JSON] | None:
        found = {}
        for resource, name, _ in CHILDREN:
            result = kubectl(
                "get", resource, name, "-n", inference.namespace, "-o", "json",
                check=False,
            )  # fmt: skip
            if result.returncode != 0:
                return None
            found[(resource, name)] = json.loads(result.stdout)
        return found

    children = wait_for(
        all_children, STARTUP_TIMEOUT, "every child of demo", diagnostics=inference.diagnostics
    )
    for (resource, name), obj in children.items():
        assert obj["metadata"]["ownerReferences"] == [expected_reference], (resource, name)
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "dpserve-operator"
    kinds = sorted(obj["kind"] for obj in children.values())
    assert kinds == sorted(kind for _, _, kind in CHILDREN)
    # Kubernetes 1.20 serves PodDisruptionBudgets only as policy/v1beta1.
    pdb = children[("poddisruptionbudget.policy", f"{NAME}-engine")]
    assert pdb["apiVersion"] == "policy/v1beta1"
    assert pdb["spec"]["maxUnavailable"] == 1
    statefulset = children[("statefulset.apps", f"{NAME}-engine")]
    assert statefulset["spec"]["replicas"] == 2
    service = children[("service", f"{NAME}-coordinator")]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "zmq": inference.zmq_port,
        "http": inference.http_port,
    }


def test_pods_carry_the_security_settings(inference: Inference) -> None:
    def pods() -> list[JSON] | None:
        found = inference.pods(INSTANCE_SELECTOR)
        return found if len(found) == 3 else None

    stored = wait_for(
        pods,
        STARTUP_TIMEOUT,
        "the coordinator and 2 engine pods",
        diagnostics=inference.diagnostics,
    )
    names = sorted(pod["metadata"]["name"] for pod in stored)
    assert names[0].startswith(f"{NAME}-coordinator-"), names
    assert names[1:] == [f"{NAME}-engine-0", f"{NAME}-engine-1"], names
    for pod in stored:
        assert_hardened(pod, expect_token=False)
        assert_credentials_mounted(pod)


def assert_credentials_mounted(pod: JSON) -> None:
    """CURVE, no --insecure; each pod projects only its part of demo-credentials."""
    name = pod["metadata"]["name"]
    (container,) = pod["spec"]["containers"]
    command = container["command"]
    assert "--insecure" not in command, name
    assert command[command.index("--credentials") + 1] == "/etc/dpserve/credentials", name
    assert {"name": "credentials", "mountPath": "/etc/dpserve/credentials", "readOnly": True} in (
        container["volumeMounts"]
    ), name
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "credentials"]
    assert volume["secret"]["secretName"] == f"{NAME}-credentials", name
    assert volume["secret"]["defaultMode"] == 0o440, name
    paths = {item["key"]: item["path"] for item in volume["secret"]["items"]}
    if name.startswith(f"{NAME}-engine-"):
        assert paths == {"engine.key_secret": "engine.key_secret",
                         "coordinator.key": "coordinator.key"}, name  # fmt: skip
    else:
        assert "coordinator.key_secret" in paths and "admin.key_secret" not in paths, name
        assert paths["admin.key"] == "allowed/admin/admin.key", name
    assert len(pod["metadata"]["annotations"][HASH_ANNOTATION]) == 16, name


def assert_hardened(pod: JSON, *, expect_token: bool) -> None:
    """The security settings as the API server stored them (nothing dropped or defaulted)."""
    name = pod["metadata"]["name"]
    pod_context = pod["spec"]["securityContext"]
    assert pod_context["runAsNonRoot"] is True, name
    assert pod_context["runAsUser"] == 10001, name
    assert pod_context["seccompProfile"] == {"type": "RuntimeDefault"}, name
    if not expect_token:
        assert pod["spec"]["automountServiceAccountToken"] is False, name
    for container in pod["spec"]["containers"]:
        context = container["securityContext"]
        assert context["runAsNonRoot"] is True, name
        assert context["readOnlyRootFilesystem"] is True, name
        assert context["allowPrivilegeEscalation"] is False, name
        assert context["capabilities"] == {"drop": ["ALL"]}, name
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name


def test_engines_register_and_status_turns_ready(inference: Inference, kubectl: Kubectl) -> None:
    status = inference.wait_status("Ready with 2 engines", ready_with(2), READY_TIMEOUT)
    generation = inference.read()["metadata"]["generation"]
    assert status["observedGeneration"] == generation
    assert status["selector"] == (
        "app.kubernetes.io/component=engine,app.kubernetes.io/instance=demo,"
        "app.kubernetes.io/name=dpserve"
    )
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "AllEnginesRegistered")
    assert condition(status, "Degraded")["status"] == "False"

    # Each engine took its rank from its pod name and registered with the coordinator.
    (coordinator,) = inference.pods(COORDINATOR_SELECTOR)
    coordinator_log = inference.agent.read_log(inference.namespace, coordinator["metadata"]["name"])
    for rank in (0, 1):
        pod = f"{NAME}-engine-{rank}"
        inference.agent.wait_for_log(
            inference.namespace, pod, rf"engine rank {rank} registered with coordinator", 5
        )
        assert f"engine rank {rank} registered" in coordinator_log

    # The printer columns (docs/kubernetes.md, "Run a model").
    table = kubectl("get", "infd", "-n", inference.namespace).stdout.splitlines()
    assert table[0].split() == [
        "NAME", "DESIRED", "READY", "REGISTERED", "PHASE", "MODEL", "AGE", "AUTOSCALER",
    ]  # fmt: skip
    row = table[1].split()
    assert row[:6] == [NAME, "2", "2", "2", "Ready", str(inference.read()["spec"]["model"])]
    # `kubectl describe` shows the conditions and the operator's events.
    described = kubectl("describe", "infd", NAME, "-n", inference.namespace).stdout
    for text in ("AllEnginesRegistered", "Applied", "created StatefulSet/demo-engine"):
        assert text in described, described


# -- 3. serving ---------------------------------------------------------------------------


def test_generate_through_the_coordinator(inference: Inference, kubectl: Kubectl) -> None:
    # docs/kubernetes.md, "Talk to it", with the loopback in place of port-forward.
    inference.credentials = fetch_client_credentials(
        kubectl, inference.namespace, inference.workdir / "client"
    )
    result = dpserve_generate(inference.address, inference.credentials)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), f"no completion printed: {result.stdout!r} {result.stderr!r}"

    def completion_request(headers: dict[str, str]) -> urllib.request.Request:
        return urllib.request.Request(
            f"http://{LOOPBACK}:{inference.http_port}/v1/completions",
            data=json.dumps(
                {"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 4}
            ).encode(),
            headers={"Content-Type": "application/json", **headers},
        )

    # The HTTP API wants the bearer token from the same Secret.
    with pytest.raises(urllib.error.HTTPError) as unauthorized:
        urllib.request.urlopen(completion_request({}), timeout=30)
    assert unauthorized.value.code == 401
    token = (inference.credentials / "http-api-token").read_text().strip()
    authorized = completion_request({"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(authorized, timeout=30) as reply:
        completion = json.load(reply)
    assert completion["usage"]["completion_tokens"] >= 1, completion
    assert isinstance(completion["choices"][0]["text"], str)

    # /health is liveness only; /ready tells the registered engines.
    code, body = http_get(inference.http_port, "/health")
    assert code == 200, body
    code, body = http_get(inference.http_port, "/ready")
    assert code == 200, body
    assert json.loads(body)["engines"] == 2

    # Without keys, the coordinator does not even complete the handshake.
    refused = subprocess.run(
        [str(DPSERVE), "generate", "Hello", "--address", inference.address, "--timeout", "3"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert refused.returncode != 0, refused.stdout


# -- 4. scaling under load ----------------------------------------------------------------


@dataclass
class Load:
    """Requests of a few tokens each, sent steadily from a thread until stopped."""

    address: str
    credentials: Path
    minimum: int = 100
    concurrency: int = 3
    pause: float = 0.1
    ranks: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    done: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 120.0) -> None:
        """Let the in-flight requests finish (and at least `minimum` be sent), then join."""
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"load still running after {timeout:.0f} s"

    def wait_for_rank(self, rank: int, timeout: float) -> None:
        wait_for(lambda: self.ranks[rank] > 0, timeout, f"a request served by engine {rank}")

    async def _run(self) -> None:
        from dpserve.client import InferenceClient
        from dpserve.sampling import SamplingParams

        # ignore_eos: the random model's greedy answer to some of these prompts is EOS at
        # once (to "Request 2-638: ..." it is), a whole answer of no tokens; every request
        # here is to bring back exactly four.
        params = SamplingParams(num_tokens_to_generate=4, temperature=0.0, ignore_eos=True)
        try:
            async with InferenceClient(self.address, credentials=self.credentials) as client:

                async def worker(index: int) -> None:
                    sequence = 0
                    while not (self._stop.is_set() and self.done >= self.minimum):
                        sequence += 1
                        prompt = f"Request {index}-{sequence}: tell me about the sea"
                        try:
                            record = await asyncio.wait_for(client.add_request(prompt, params), 60)
                        except Exception as error:  # every failure counts, whatever it is
                            self.failures.append(f"{prompt}: {type(error).__name__}: {error}")
                        else:
                            self.ranks[record.engine_rank] += 1
                            if len(record.generated_tokens) != 4:
                                self.failures.append(f"{prompt}: not 4 tokens ({record})")
                        self.done += 1
                        await asyncio.sleep(self.pause)

                await asyncio.gather(*(worker(i) for i in range(self.concurrency)))
        except Exception as error:
            self.failures.append(f"client: {type(error).__name__}: {error}")


def test_scaling_under_load_loses_no_request(
    inference: Inference,
    kubectl: Kubectl,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    ns = inference.namespace
    assert inference.credentials is not None, "test_generate_through_the_coordinator fetches them"
    load = Load(inference.address, inference.credentials)
    load.start()
    try:
        wait_for(lambda: load.done >= 10 or load.failures, 30, "the load to get going")
        assert not load.failures, load.failures

        # 2 → 3 with kubectl patch.
        kubectl(
            "patch", "infd", NAME, "-n", ns, "--type=merge",
            "-p", '{"spec": {"dataParallelSize": 3}}',
        )  # fmt: skip
        wait_for(
            lambda: inference.statefulset()["spec"]["replicas"] == 3,
            10,
            "the StatefulSet to ask for 3 replicas",
            diagnostics=inference.diagnostics,
        )
        inference.wait_status("Ready with 3 engines", ready_with(3), READY_TIMEOUT)
        inference.agent.wait_for_log(ns, f"{NAME}-engine-2", "engine rank 2 registered", 5)
        load.wait_for_rank(2, 30)

        # 3 → 1 with kubectl edit (KUBE_EDITOR rewrites the YAML kubectl hands it).
        editor = tmp_path / "editor.py"
        editor.write_text(
            textwrap.dedent(
                """
                import sys, yaml
                size, path = int(sys.argv[1]), sys.argv[2]
                with open(path) as f:
                    obj = yaml.safe_load(f)
                obj["spec"]["dataParallelSize"] = size
                with open(path, "w") as f:
                    yaml.safe_dump(obj, f)
                """
            )
        )
        monkeypatch.setenv("KUBE_EDITOR", f"{sys.executable} {editor} 1")
        kubectl("edit", f"infd/{NAME}", "-n", ns)
        wait_for(
            lambda: inference.statefulset()["spec"]["replicas"] == 1,
            10,
            "the StatefulSet to ask for 1 replica",
            diagnostics=inference.diagnostics,
        )
        inference.wait_status("Ready with 1 engine", ready_with(1), SCALE_TIMEOUT)
        wait_for(
            lambda: (
                [p["metadata"]["name"] for p in inference.pods(ENGINE_SELECTOR)]
                == [f"{NAME}-engine-0"]
            ),
            SCALE_TIMEOUT,
            "engines 1 and 2 to be gone",
            diagnostics=inference.diagnostics,
        )
        for rank in (1, 2):
            # SIGTERM: the engine handed its requests to engine 0 (or, with no other engine
            # routable, drained them; or, holding none at that moment, left at once: "idle")
            # and left on its own.
            log = inference.agent.read_log(ns, f"{NAME}-engine-{rank}")
            left = rf"engine rank {rank} (drained|idle|handed \d+ request\(s\) to other engines)"
            left += "; leaving"
            assert re.search(left, log), log[-2000:]
        assert not load.failures, load.failures
        served_before = load.done

        # 1 → 2 through the scale subresource.
        kubectl("scale", f"infd/{NAME}", "--replicas=2", "-n", ns)
        assert inference.read()["spec"]["dataParallelSize"] == 2
        wait_for(
            lambda: inference.statefulset()["spec"]["replicas"] == 2,
            10,
            "the StatefulSet to ask for 2 replicas",
            diagnostics=inference.diagnostics,
        )
        status = inference.wait_status("Ready with 2 engines again", ready_with(2), READY_TIMEOUT)
        assert status["observedGeneration"] == inference.read()["metadata"]["generation"]
        wait_for(lambda: load.done > served_before + 10, 30, "more requests after scaling")
    finally:
        load.stop()
    print(f"load: {load.done} requests, by engine rank {dict(sorted(load.ranks.items()))}")

    assert not load.failures, f"{len(load.failures)} of {load.done} failed: {load.failures[:5]}"
    assert load.done >= load.minimum
    # Every engine that existed served: 0 throughout, 1 before and after, 2 while it lived.
    assert set(load.ranks) == {0, 1, 2}, load.ranks
    assert sum(load.ranks.values()) == load.done
    statefulset = inference.statefulset()
    assert statefulset["status"]["replicas"] == 2
    assert statefulset["status"]["readyReplicas"] == 2


def test_deleting_the_credentials_secret_rotates_the_keys(
    inference: Inference, kubectl: Kubectl
) -> None:
    ns = inference.namespace
    old_credentials = inference.credentials
    assert old_credentials is not None
    old_secret = kubectl.json("get", "secret", f"{NAME}-credentials", "-n", ns)
    old_hash = old_secret["metadata"]["annotations"][HASH_ANNOTATION]
    old_client = kubectl.json("get", "secret", CLIENT_SECRET, "-n", ns)["data"]
    old_pods = {p["metadata"]["uid"] for p in inference.pods(INSTANCE_SELECTOR)}
    assert len(old_pods) == 3

    kubectl("delete", "secret", f"{NAME}-credentials", "-n", ns)

    def new_secret() -> JSON | None:
        result = kubectl("get", "secret", f"{NAME}-credentials", "-n", ns, "-o", "json",
                         check=False)  # fmt: skip
        if result.returncode != 0:
            return None
        secret: JSON = json.loads(result.stdout)
        return secret if secret["metadata"]["annotations"][HASH_ANNOTATION] != old_hash else None

    secret = wait_for(new_secret, 30, "a new demo-credentials", diagnostics=inference.diagnostics)
    new_hash = secret["metadata"]["annotations"][HASH_ANNOTATION]
    assert secret["metadata"]["ownerReferences"][0]["name"] == NAME
    # Only public keys are hashed: no key of the Secret appears in its annotation.
    assert all(value not in json.dumps(secret["metadata"]) for value in secret["data"].values())
    new_client = wait_for(
        lambda: (
            data
            if (data := kubectl.json("get", "secret", CLIENT_SECRET, "-n", ns)["data"])
            != old_client
            else None
        ),
        30,
        "demo-client-credentials with the new keys",
    )
    assert new_client["coordinator.key"] != old_client["coordinator.key"]
    assert new_client["admin.key_secret"] != old_client["admin.key_secret"]

    # Every pod rolled onto the new keys, and the deployment serves again.
    def rolled() -> bool:
        pods = inference.pods(INSTANCE_SELECTOR)
        return len(pods) == 3 and all(
            p["metadata"]["uid"] not in old_pods
            and p["metadata"]["annotations"].get(HASH_ANNOTATION) == new_hash
            and not p["metadata"].get("deletionTimestamp")
            for p in pods
        )

    wait_for(rolled, READY_TIMEOUT, "every pod replaced", diagnostics=inference.diagnostics)
    inference.wait_status("Ready with 2 engines after rotation", ready_with(2), READY_TIMEOUT)

    inference.credentials = fetch_client_credentials(kubectl, ns, inference.workdir / "rotated")
    result = dpserve_generate(inference.address, inference.credentials)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    stale = subprocess.run(
        [str(DPSERVE), "generate", "Hello", "--address", inference.address,
         "--credentials", str(old_credentials), "--timeout", "3"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert stale.returncode != 0, f"the old keys still work: {stale.stdout}"
    # The operator never logs key material.
    operator_log = inference.agent.read_log(OPERATOR_NS, inference.operator.pod)
    for value in (*new_client.values(), *old_client.values()):
        text = base64.b64decode(value).decode()
        for line in text.splitlines():
            if "secret-key" in line:
                assert line.split('"')[1] not in operator_log


# -- 5. validation ------------------------------------------------------------------------


def bad_resource(name: str, spec_changes: dict[str, Any], drop: tuple[str, ...] = ()) -> JSON:
    spec: JSON = {
        "model": "/models/anything",
        "image": "ghcr.io/dpserve/runtime-cpu:0.1.0",
        "dataParallelSize": 1,
    }
    for key in drop:
        spec.pop(key)
    spec.update(spec_changes)
    return manifests.inference_deployment(name, spec)


@pytest.mark.parametrize(
    ("name", "changes", "drop", "field_path", "complaint"),
    [
        ("negative", {"dataParallelSize": -1}, (), "spec.dataParallelSize", "greater than"),
        ("words", {"dataParallelSize": "two"}, (), "spec.dataParallelSize", "integer"),
        ("no-model", {}, ("model",), "spec.model", "Required"),
        ("bad-dtype", {"engine": {"dtype": "float64"}}, (), "spec.engine.dtype", "Unsupported"),
        ("bad-port", {"coordinator": {"zmqPort": 70000}}, (), "spec.coordinator.zmqPort", "less"),
    ],
)
def test_api_server_rejects_invalid_resources(
    inference: Inference,
    kubectl: Kubectl,
    name: str,
    changes: dict[str, Any],
    drop: tuple[str, ...],
    field_path: str,
    complaint: str,
) -> None:
    document = yaml.safe_dump(bad_resource(name, changes, drop))
    # --validate=false: no client-side check; the API server itself must refuse it.
    result = kubectl(
        "apply", "--validate=false", "-f", "-", "-n", inference.namespace,
        input=document, check=False,
    )  # fmt: skip
    assert result.returncode != 0, result.stdout
    assert "is invalid" in result.stderr, result.stderr
    assert field_path in result.stderr, result.stderr
    assert complaint in result.stderr, result.stderr
    missing = kubectl("get", "infd", name, "-n", inference.namespace, check=False)
    assert missing.returncode != 0 and "NotFound" in missing.stderr


def test_operator_reports_what_the_schema_cannot_check(
    inference: Inference, kubectl: Kubectl
) -> None:
    name = "clash"
    kubectl.apply(
        bad_resource(name, {"coordinator": {"zmqPort": 7000, "httpPort": 7000}}),
        namespace=inference.namespace,
    )
    try:

        def degraded() -> JSON | None:
            status = inference.read(name).get("status") or {}
            return status if status.get("phase") == "Degraded" else None

        status = wait_for(
            degraded, STARTUP_TIMEOUT, f"{name} to turn Degraded", diagnostics=inference.diagnostics
        )
        reason = condition(status, "Degraded")
        assert reason["reason"] == "InvalidSpec"
        assert "spec.coordinator.httpPort" in reason["message"], reason
        # Nothing was created for it.
        result = kubectl(
            "get", "deployment,statefulset,service", "-n", inference.namespace,
            "-l", f"app.kubernetes.io/instance={name}", "-o", "name",
        )  # fmt: skip
        assert result.stdout.strip() == ""
        events = kubectl(
            "get", "events", "-n", inference.namespace,
            "--field-selector", f"involvedObject.name={name},reason=InvalidSpec", "-o", "name",
        )  # fmt: skip
        assert events.stdout.strip(), "no InvalidSpec event"
    finally:
        kubectl("delete", "infd", name, "-n", inference.namespace, "--timeout=60s", check=False)


# -- 6. deletion --------------------------------------------------------------------------


def test_deleting_the_resource_garbage_collects_every_child(
    inference: Inference, kubectl: Kubectl
) -> None:
    ns = inference.namespace
    pids = {
        pod["metadata"]["name"]: inference.agent.pids(ns, pod["metadata"]["name"])
        for pod in inference.pods(INSTANCE_SELECTOR)
    }
    assert len(pids) == 3 and all(all(p.values()) for p in pids.values()), pids

    # The operator (kopf) removes its finalizer, then the garbage collector takes over.
    kubectl("delete", "infd", NAME, "-n", ns, "--timeout=60s", timeout=90)

    def leftovers() -> list[str]:
        kinds = (
            "deployment,replicaset,statefulset,service,poddisruptionbudget,networkpolicy,pod,secret"
        )
        result = kubectl("get", kinds, "-n", ns, "-l", INSTANCE_SELECTOR, "-o", "name")
        return result.stdout.split()

    wait_for(
        lambda: not leftovers(),
        DELETE_TIMEOUT,
        "every child of demo to be garbage-collected",
        diagnostics=lambda: f"left: {leftovers()}\n{inference.diagnostics()}",
    )
    for pod in pids:
        assert not inference.agent.pids(ns, pod), f"{pod} still has processes"
