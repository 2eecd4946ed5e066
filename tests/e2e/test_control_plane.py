"""The e2e infrastructure itself: control plane, node agent, kubectl.

These tests pin down the behaviour operator tests rely on: scheduling onto the
local Node, Pod status and readiness, env and fieldRef handling, Service name
rewriting, graceful termination, garbage collection, CRD pruning and the API
server's service proxy.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from tests.e2e import manifests
from tests.e2e.cluster import (
    DEFAULT_NODE_NAME,
    LOOPBACK,
    NODE_CAPACITY,
    ControlPlane,
    Kubectl,
    free_ports,
    wait_for,
)
from tests.e2e.node_agent import NodeAgent, ServiceNameRewriter, expand_vars

pytestmark = pytest.mark.e2e

JSON = dict[str, Any]
POD_TIMEOUT = 60.0


# -- helpers ---------------------------------------------------------------------------


def read_pod(core: k8s.CoreV1Api, namespace: str, name: str) -> JSON | None:
    try:
        return json.loads(core.read_namespaced_pod(name, namespace, _preload_content=False).data)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def list_pods(core: k8s.CoreV1Api, namespace: str, selector: str) -> list[JSON]:
    response = core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False)
    return list(json.loads(response.data).get("items") or [])


def condition(pod: JSON, kind: str) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == kind and c["status"] == "True" for c in conditions)


def running_and_ready(pod: JSON | None) -> bool:
    return bool(
        pod
        and pod["status"].get("phase") == "Running"
        and condition(pod, "Ready")
        and condition(pod, "ContainersReady")
        and not pod["metadata"].get("deletionTimestamp")
    )


def wait_pod(
    core: k8s.CoreV1Api,
    namespace: str,
    name: str,
    predicate: Callable[[JSON | None], bool],
    what: str,
    agent: NodeAgent,
    timeout: float = POD_TIMEOUT,
) -> JSON | None:
    def check() -> tuple[JSON | None] | None:
        pod = read_pod(core, namespace, name)
        # Wrapped in a tuple so that "the Pod is gone" (None) can count as success.
        return (pod,) if predicate(pod) else None

    def diagnostics() -> str:
        pod = read_pod(core, namespace, name)
        status = json.dumps(pod.get("status") if pod else None, indent=1)[:3000]
        return f"pod status: {status}\nlog:\n{agent.read_log(namespace, name)[-2000:]}"

    return wait_for(check, timeout, f"pod {namespace}/{name} {what}", diagnostics=diagnostics)[0]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ", 1)[1][0] != "Z"


def python_script(source: str) -> list[str]:
    return ["python", "-c", textwrap.dedent(source)]


# -- pure helpers of the node agent -----------------------------------------------------


def test_expand_vars_follows_kubernetes_rules() -> None:
    env = {"A": "1", "B": "two"}
    assert expand_vars("x=$(A),y=$(B)", env) == "x=1,y=two"
    assert expand_vars("$$(A)", env) == "$(A)"
    assert expand_vars("$(MISSING)", env) == "$(MISSING)"
    assert expand_vars("cost $5 and $(A", env) == "cost $5 and $(A"
    assert expand_vars("$", env) == "$"


def test_service_names_are_rewritten_to_loopback() -> None:
    rewrite = ServiceNameRewriter([("coord", "team"), ("engine", "team"), ("db", "other")], "team")
    assert rewrite("tcp://coord:5555") == "tcp://127.0.0.1:5555"
    assert rewrite("coord.team.svc.cluster.local:5555") == "127.0.0.1:5555"
    assert rewrite("http://engine.team.svc/v1") == "http://127.0.0.1/v1"
    assert rewrite("engine-0.engine.team.svc.cluster.local") == "127.0.0.1"
    assert rewrite("--db=db.other:5432") == "--db=127.0.0.1:5432"
    assert rewrite("coord") == "127.0.0.1"
    # Not host names of known Services: left alone.
    assert rewrite("coordinator:1") == "coordinator:1"
    assert rewrite("run coord now") == "run coord now"
    assert rewrite("coord.example.com") == "coord.example.com"
    assert rewrite("db:5432") == "db:5432"  # "db" lives in another namespace


# -- the cluster -------------------------------------------------------------------------


def test_node_is_ready_and_schedulable(k8s_client: Any) -> None:
    core = k8s.CoreV1Api(k8s_client)
    node = json.loads(core.read_node(DEFAULT_NODE_NAME, _preload_content=False).data)
    assert condition(node, "Ready")
    assert not node["spec"].get("taints"), node["spec"]
    assert not node["spec"].get("unschedulable")
    for resource in ("cpu", "memory", "pods", "nvidia.com/gpu"):
        assert node["status"]["allocatable"][resource] == NODE_CAPACITY[resource]


def test_deployment_service_and_service_proxy(
    kube_namespace: str, kubectl: Kubectl, node_agent: NodeAgent, k8s_client: Any
) -> None:
    core = k8s.CoreV1Api(k8s_client)
    (port,) = free_ports(1)
    labels = {"app": "web"}
    http = manifests.container(
        "http",
        ["python", "-m", "http.server", str(port)],
        args=["--bind", LOOPBACK],
        ports=[{"name": "http", "containerPort": port}],
        readinessProbe={"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
    )
    kubectl.apply(
        [
            manifests.deployment("web", labels, http),
            manifests.service("web", labels, [{"name": "http", "port": 80, "targetPort": "http"}]),
        ],
        namespace=kube_namespace,
    )

    pods = wait_for(
        lambda: list_pods(core, kube_namespace, "app=web"),
        POD_TIMEOUT,
        "the Deployment's Pod to be created",
    )
    name = pods[0]["metadata"]["name"]
    pod = wait_pod(core, kube_namespace, name, running_and_ready, "Running and Ready", node_agent)
    assert pod is not None
    assert pod["spec"]["nodeName"] == DEFAULT_NODE_NAME
    assert pod["status"]["podIP"] == LOOPBACK
    assert pod["status"]["hostIP"] == LOOPBACK
    (container,) = pod["status"]["containerStatuses"]
    assert container["ready"] is True
    assert container["started"] is True
    assert container["restartCount"] == 0
    assert "running" in container["state"]
    assert node_agent.pids(kube_namespace, name)["http"] is not None

    def endpoint_addresses() -> list[str]:
        endpoints = kubectl.json("get", "endpoints", "web", "-n", kube_namespace)
        return [
            f"{address['ip']}:{subset['ports'][0]['port']}"
            for subset in endpoints.get("subsets") or []
            for address in subset.get("addresses") or []
        ]

    addresses = wait_for(endpoint_addresses, 30, "the Service's Endpoints to list the Pod")
    assert addresses == [f"{LOOPBACK}:{port}"]

    proxied = kubectl(
        "get", "--raw", f"/api/v1/namespaces/{kube_namespace}/services/web:80/proxy/"
    ).stdout
    assert "Directory listing for /" in proxied
    # http.server logs each request: the proxied GET really reached this Pod.
    node_agent.wait_for_log(kube_namespace, name, r'"GET / HTTP/1\.1" 200', timeout=10)
    # The pod proxy works too (the build allows loopback there as well).
    pod_proxied = kubectl(
        "get", "--raw", f"/api/v1/namespaces/{kube_namespace}/pods/{name}:{port}/proxy/"
    ).stdout
    assert "Directory listing for /" in pod_proxied


def test_readiness_gates_ready_condition(
    kube_namespace: str,
    kubectl: Kubectl,
    node_agent: NodeAgent,
    k8s_client: Any,
    tmp_path: Path,
) -> None:
    """A tcpSocket readinessProbe keeps the Pod unready until the port listens."""
    core = k8s.CoreV1Api(k8s_client)
    (port,) = free_ports(1)
    flag = tmp_path / "listen-now"
    script = f"""
        import os, socket, time
        while not os.path.exists({str(flag)!r}):
            time.sleep(0.1)
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", {port}))
        server.listen()
        print("listening", flush=True)
        time.sleep(3600)
    """
    probe = {"tcpSocket": {"port": port}, "periodSeconds": 1}
    kubectl.apply(
        manifests.pod(
            "late", manifests.container("main", python_script(script), readinessProbe=probe)
        ),
        namespace=kube_namespace,
    )
    pod = wait_pod(
        core,
        kube_namespace,
        "late",
        lambda p: bool(p and p["status"].get("phase") == "Running"),
        "Running",
        node_agent,
    )
    # Several probe periods pass without the port open: still not Ready.
    time.sleep(3)
    pod = read_pod(core, kube_namespace, "late")
    assert pod is not None
    assert pod["status"]["phase"] == "Running"
    assert not condition(pod, "Ready"), pod["status"]
    assert pod["status"]["containerStatuses"][0]["ready"] is False

    flag.touch()
    wait_pod(core, kube_namespace, "late", running_and_ready, "Ready once listening", node_agent)
    assert "listening" in node_agent.read_log(kube_namespace, "late")


def test_statefulset_env_field_refs_and_graceful_scale_down(
    control_plane: ControlPlane,
    kube_namespace: str,
    kubectl: Kubectl,
    node_agent: NodeAgent,
    k8s_client: Any,
    tmp_path: Path,
) -> None:
    core = k8s.CoreV1Api(k8s_client)
    ns = kube_namespace
    core.create_namespaced_secret(
        ns, {"metadata": {"name": "creds"}, "stringData": {"token": "s3cr3t"}}
    )
    core.create_namespaced_config_map(
        ns, {"metadata": {"name": "settings"}, "data": {"mode": "fast"}}
    )
    script = """
        import json, os, signal, sys, time
        name = os.environ["POD_NAME"]
        keys = ["POD_NAME", "POD_NAMESPACE", "POD_IP", "NODE_NAME", "GREETING",
                "TOKEN", "MODE", "HOSTNAME", "PEER_URL", "KUBECONFIG", "PYTEST_CURRENT_TEST"]
        env = {k: os.environ.get(k) for k in keys}
        print("CONFIG " + json.dumps({"argv": sys.argv[1:], "env": env}), flush=True)

        def on_term(signum, frame):
            print(f"SIGTERM received by {name}", flush=True)
            sys.exit(0)

        signal.signal(signal.SIGTERM, on_term)
        while True:
            print(f"alive {name}", flush=True)
            time.sleep(1)
    """
    pre_stop = python_script(
        f"""
        import os
        with open(os.path.join({str(tmp_path)!r}, os.environ["POD_NAME"] + ".prestop"), "w") as f:
            f.write("ran")
        """
    )
    labels = {"app": "sleeper"}
    sleeper = manifests.container(
        "main",
        python_script(script),
        args=[
            "--who=$(POD_NAME)",
            "--escaped=$$(POD_NAME)",
            f"--peer=sleeper-0.peers.{ns}.svc.cluster.local:7000",
        ],
        env=[
            field_env("POD_NAME", "metadata.name"),
            field_env("POD_NAMESPACE", "metadata.namespace"),
            field_env("POD_IP", "status.podIP"),
            field_env("NODE_NAME", "spec.nodeName"),
            {"name": "GREETING", "value": "hello-$(POD_NAME)"},
            {"name": "PEER_URL", "value": "http://peers:7000/x"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
            {
                "name": "MODE",
                "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}},
            },
        ],
        readinessProbe={"exec": {"command": ["python", "-c", "pass"]}, "periodSeconds": 1},
        lifecycle={"preStop": {"exec": {"command": pre_stop}}},
    )
    kubectl.apply(
        [
            manifests.service("peers", labels, [{"port": 7000}], clusterIP="None"),
            manifests.stateful_set(
                "sleeper",
                labels,
                sleeper,
                service_name="peers",
                replicas=2,
                parallel=True,
                terminationGracePeriodSeconds=20,
            ),
        ],
        namespace=ns,
    )

    for name in ("sleeper-0", "sleeper-1"):
        pod = wait_pod(core, ns, name, running_and_ready, "Running and Ready", node_agent)
        assert pod is not None and pod["spec"]["nodeName"] == DEFAULT_NODE_NAME
        match = node_agent.wait_for_log(ns, name, r"CONFIG (\{.*\})")
        config = json.loads(match.group(1))
        assert config["argv"] == [f"--who={name}", "--escaped=$(POD_NAME)", "--peer=127.0.0.1:7000"]
        assert config["env"] == {
            "POD_NAME": name,
            "POD_NAMESPACE": ns,
            "POD_IP": LOOPBACK,
            "NODE_NAME": DEFAULT_NODE_NAME,
            "GREETING": f"hello-{name}",
            "TOKEN": "s3cr3t",
            "MODE": "fast",
            "HOSTNAME": name,
            "PEER_URL": "http://127.0.0.1:7000/x",
            "KUBECONFIG": str(control_plane.kubeconfig),
            "PYTEST_CURRENT_TEST": None,
        }

    pids = {name: node_agent.pids(ns, name)["main"] for name in ("sleeper-0", "sleeper-1")}
    assert all(pid is not None and pid_alive(pid) for pid in pids.values()), pids

    kubectl("scale", "statefulset", "sleeper", "--replicas=1", "-n", ns)
    wait_pod(core, ns, "sleeper-1", lambda p: p is None, "to be deleted", node_agent, timeout=40)

    assert (tmp_path / "sleeper-1.prestop").read_text() == "ran"
    node_agent.wait_for_log(ns, "sleeper-1", "SIGTERM received by sleeper-1", timeout=5)
    gone_pid = pids["sleeper-1"]
    assert gone_pid is not None
    wait_for(lambda: not pid_alive(gone_pid), 10, "sleeper-1's process to exit")

    # The surviving replica was left alone.
    assert not (tmp_path / "sleeper-0.prestop").exists()
    assert running_and_ready(read_pod(core, ns, "sleeper-0"))
    kept_pid = pids["sleeper-0"]
    assert kept_pid is not None and pid_alive(kept_pid)
    assert "SIGTERM received" not in node_agent.read_log(ns, "sleeper-0")


def field_env(name: str, path: str) -> JSON:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def test_sigkill_after_grace_period(
    kube_namespace: str, kubectl: Kubectl, node_agent: NodeAgent, k8s_client: Any
) -> None:
    core = k8s.CoreV1Api(k8s_client)
    script = """
        import signal, time
        signal.signal(signal.SIGTERM, lambda *_: print("ignoring SIGTERM", flush=True))
        print("started", flush=True)
        while True:
            time.sleep(0.1)
    """
    kubectl.apply(
        manifests.pod(
            "stubborn",
            manifests.container("main", python_script(script)),
            terminationGracePeriodSeconds=2,
        ),
        namespace=kube_namespace,
    )
    wait_pod(core, kube_namespace, "stubborn", running_and_ready, "Running", node_agent)
    node_agent.wait_for_log(kube_namespace, "stubborn", "started")
    pid = node_agent.pids(kube_namespace, "stubborn")["main"]
    assert pid is not None

    started = time.monotonic()
    kubectl("delete", "pod", "stubborn", "-n", kube_namespace, "--wait=false")
    wait_pod(core, kube_namespace, "stubborn", lambda p: p is None, "to be deleted", node_agent)
    elapsed = time.monotonic() - started
    assert "ignoring SIGTERM" in node_agent.read_log(kube_namespace, "stubborn")
    assert 1.5 <= elapsed < 15, f"deletion took {elapsed:.1f} s for a 2 s grace period"
    assert not pid_alive(pid)


def test_restart_policies(
    kube_namespace: str, kubectl: Kubectl, node_agent: NodeAgent, k8s_client: Any
) -> None:
    core = k8s.CoreV1Api(k8s_client)

    def exiting(name: str, policy: str, code: int) -> JSON:
        script = f"import sys; print('run {name}', flush=True); sys.exit({code})"
        return manifests.pod(
            name, manifests.container("main", ["python", "-c", script]), restartPolicy=policy
        )

    kubectl.apply(
        [
            exiting("crasher", "Always", 3),
            exiting("oneshot", "Never", 0),
            exiting("failer", "Never", 2),
        ],
        namespace=kube_namespace,
    )

    def restarted_twice(p: JSON | None) -> bool:
        statuses = (p or {}).get("status", {}).get("containerStatuses") or []
        return bool(statuses) and statuses[0]["restartCount"] >= 2

    crasher = wait_pod(core, kube_namespace, "crasher", restarted_twice, "restarted", node_agent)
    assert crasher is not None
    status = crasher["status"]["containerStatuses"][0]
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert crasher["status"]["phase"] == "Running"
    assert node_agent.read_log(kube_namespace, "crasher").count("run crasher") >= 2

    def phase_is(phase: str) -> Callable[[JSON | None], bool]:
        return lambda p: bool(p and p["status"].get("phase") == phase)

    oneshot = wait_pod(
        core, kube_namespace, "oneshot", phase_is("Succeeded"), "Succeeded", node_agent
    )
    failer = wait_pod(core, kube_namespace, "failer", phase_is("Failed"), "Failed", node_agent)
    assert oneshot is not None and failer is not None
    assert oneshot["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    assert failer["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 2
    assert failer["status"]["containerStatuses"][0]["restartCount"] == 0


def test_deleting_owner_garbage_collects_children(
    kube_namespace: str, kubectl: Kubectl, node_agent: NodeAgent, k8s_client: Any
) -> None:
    core = k8s.CoreV1Api(k8s_client)
    apps = k8s.AppsV1Api(k8s_client)
    ns = kube_namespace

    # An explicit ownerReference between two ConfigMaps.
    owner = json.loads(
        core.create_namespaced_config_map(
            ns, {"metadata": {"name": "owner"}}, _preload_content=False
        ).data
    )
    reference = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
    }
    core.create_namespaced_config_map(
        ns, {"metadata": {"name": "child", "ownerReferences": [reference]}}
    )

    # Deployment -> ReplicaSet -> Pod -> local process.
    labels = {"app": "gc"}
    sleeper = manifests.container("main", ["python", "-c", "import time; time.sleep(3600)"])
    kubectl.apply(
        manifests.deployment("gc", labels, sleeper, terminationGracePeriodSeconds=5), namespace=ns
    )
    pods = wait_for(lambda: list_pods(core, ns, "app=gc"), POD_TIMEOUT, "the gc Deployment's Pod")
    pod_name = pods[0]["metadata"]["name"]
    wait_pod(core, ns, pod_name, running_and_ready, "Running", node_agent)
    pid = node_agent.pids(ns, pod_name)["main"]
    assert pid is not None and pid_alive(pid)
    replica_sets = json.loads(apps.list_namespaced_replica_set(ns, _preload_content=False).data)[
        "items"
    ]
    assert [rs["metadata"]["ownerReferences"][0]["name"] for rs in replica_sets] == ["gc"]

    core.delete_namespaced_config_map("owner", ns)
    kubectl("delete", "deployment", "gc", "-n", ns, "--wait=false")

    def config_map_gone() -> bool:
        try:
            core.read_namespaced_config_map("child", ns, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    wait_for(config_map_gone, 30, "the child ConfigMap to be garbage-collected")

    def replica_sets_and_pods_gone() -> bool:
        left = json.loads(apps.list_namespaced_replica_set(ns, _preload_content=False).data)
        return not left["items"] and not list_pods(core, ns, "app=gc")

    wait_for(replica_sets_and_pods_gone, 60, "the ReplicaSet and Pod of the deleted Deployment")
    wait_for(lambda: not pid_alive(pid), 10, "the garbage-collected Pod's process to exit")


def test_crd_schema_prunes_unknown_fields(
    kube_namespace: str, kubectl: Kubectl, k8s_client: Any
) -> None:
    group = f"{kube_namespace}.e2e.dpserve.test"
    crd_name = f"widgets.{group}"
    kubectl.apply(
        {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": crd_name},
            "spec": {
                "group": group,
                "scope": "Namespaced",
                "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                "versions": [
                    {
                        "name": "v1",
                        "served": True,
                        "storage": True,
                        "schema": {
                            "openAPIV3Schema": {
                                "type": "object",
                                "properties": {
                                    "spec": {
                                        "type": "object",
                                        "properties": {"size": {"type": "integer"}},
                                    }
                                },
                            }
                        },
                    }
                ],
            },
        }
    )
    custom = k8s.CustomObjectsApi(k8s_client)
    try:

        def established() -> bool:
            crd = kubectl.json("get", "crd", crd_name)
            return any(
                c["type"] == "Established" and c["status"] == "True"
                for c in crd.get("status", {}).get("conditions") or []
            )

        wait_for(established, 30, f"CRD {crd_name} to be Established")
        body = {
            "apiVersion": f"{group}/v1",
            "kind": "Widget",
            "metadata": {"name": "w"},
            "spec": {"size": 3, "colour": "red"},
            "extra": {"top": "level"},
        }
        # The CRD's REST endpoint can lag Established by a moment.
        created = wait_for(
            lambda: custom.create_namespaced_custom_object(
                group, "v1", kube_namespace, "widgets", body
            ),
            15,
            "the Widget to be created",
        )
        stored = custom.get_namespaced_custom_object(group, "v1", kube_namespace, "widgets", "w")
        for obj in (created, stored):
            assert obj["spec"] == {"size": 3}
            assert "extra" not in obj
    finally:
        kubectl("delete", "crd", crd_name, "--wait=false", check=False)


def test_init_containers_run_first_and_liveness_failures_restart(
    kube_namespace: str,
    kubectl: Kubectl,
    node_agent: NodeAgent,
    k8s_client: Any,
    tmp_path: Path,
) -> None:
    core = k8s.CoreV1Api(k8s_client)
    (closed_port,) = free_ports(1)
    marker = tmp_path / "init-done"
    init_script = f"open({str(marker)!r}, 'w').write('init'); print('init ran', flush=True)"
    main_script = f"""
        import time
        print("main sees " + open({str(marker)!r}).read(), flush=True)
        time.sleep(3600)
    """
    # Nothing listens there: the container is killed and restarted.
    liveness = {"tcpSocket": {"port": closed_port}, "periodSeconds": 1, "failureThreshold": 2}
    init = manifests.container("init", ["python", "-c", init_script], image="busybox")
    kubectl.apply(
        manifests.pod(
            "probed",
            manifests.container("main", python_script(main_script), livenessProbe=liveness),
            terminationGracePeriodSeconds=2,
            initContainers=[init],
        ),
        namespace=kube_namespace,
    )

    def restarted(p: JSON | None) -> bool:
        statuses = (p or {}).get("status", {}).get("containerStatuses") or []
        return bool(statuses) and statuses[0]["restartCount"] >= 1

    pod = wait_pod(core, kube_namespace, "probed", restarted, "restarted by liveness", node_agent)
    assert pod is not None
    (init_status,) = pod["status"]["initContainerStatuses"]
    assert init_status["state"]["terminated"]["exitCode"] == 0
    assert condition(pod, "Initialized")
    # SIGTERM from the liveness kill: 128 + 15.
    assert pod["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 143
    assert node_agent.read_log(kube_namespace, "probed", "init").count("init ran") == 1
    assert node_agent.read_log(kube_namespace, "probed", "main").count("main sees init") >= 1
