"""The README's Kubernetes flow, command for command, on the one-node cluster.

Pods are containers from the images built from images/ (tests/e2e/test_cluster.py checks the
node itself). In file order, sharing one operator and one InferenceDeployment:

1. ``helm install`` (Helm's own install action, through its Go SDK) runs the operator as a
   pod from its image, with the chart's ServiceAccount and RBAC (the API server enforces RBAC);
2. ``kubectl apply -f`` the example (the runtime image with the tiny test model: the same
   transformers path as SmolLM2); the engines register through the coordinator Service's DNS
   name; ``kubectl get infd`` shows READY/REGISTERED; the pods run hardened;
3. ``kubectl port-forward`` to the coordinator Service, the credentials fetched as the docs say,
   then ``dpserve generate`` and ``curl`` get answers;
4. ``kubectl patch`` (2 → 3) and ``kubectl scale`` (3 → 2): the coordinator sees the engines;
5. an engine pod deleted during a burst of requests: none lost, the replacement registers;
6. ``kubectl delete infd`` garbage-collects everything; ``helm uninstall`` removes the operator.

The durations asked for (apply → all engines registered, scale → new engine registered, pod
delete → replacement registered) are printed in the terminal summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from tests.e2e.cluster import Kubectl, wait_for
from tests.e2e.local_node import TIMINGS, LocalNode, PortForward, cluster_opt_in
from tests.e2e.test_operator import (
    CHILDREN,
    CRD_NAME,
    EXAMPLE,
    NAME,
    OPERATOR_NS,
    RELEASE,
    dpserve_generate,
    fetch_client_credentials,
)

# The first test brings the node up (a cold build is minutes); each wait has its own bound.
pytestmark = [pytest.mark.e2e, cluster_opt_in, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "dpserve-operator"
NAMESPACE = "readme"
TINY_IMAGE = "localhost/dpserve/runtime-tiny:0.1.0"
TINY_MODEL = "/opt/models/tiny"
ZMQ_PORT, HTTP_PORT = 5555, 8000  # examples/inference.yaml
REGISTER_TIMEOUT = 240.0
ENGINE_CPU_LIMIT = "1"
JSON = dict[str, Any]


@dataclass
class Flow:
    kubectl: Kubectl
    node: LocalNode
    workdir: Path

    def get(self, *args: str) -> Any:
        return self.kubectl.json(*args, "-n", NAMESPACE)

    def status(self) -> JSON:
        return dict(self.get("get", "infd", NAME).get("status") or {})

    def wait_registered(self, engines: int, what: str) -> float:
        """Seconds until the operator reports `engines` registered and Ready."""
        started = time.monotonic()

        def ready() -> bool:
            status = self.status()
            return status.get("phase") == "Ready" and status.get("registeredEngines") == engines

        wait_for(ready, REGISTER_TIMEOUT, what, interval=0.5, diagnostics=self.diagnostics)
        return time.monotonic() - started

    def helm(self) -> helm_python.Config:
        # helm --namespace dpserve-system: where the release and its history live.
        return helm_python.Config(
            kubeconfig_path=str(self.kubectl.kubeconfig), namespace=OPERATOR_NS
        )

    def diagnostics(self) -> str:
        pods = self.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
        described = self.kubectl("describe", "infd", NAME, "-n", NAMESPACE, check=False).stdout
        events = self.kubectl("get", "events", "-n", NAMESPACE, check=False).stdout
        return f"{pods}\n{described}\n{events[-3000:]}\n{self.node.log_tail('kubelet', 20)}"


@pytest.fixture(scope="module")
def flow(
    local_node: LocalNode, node_kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Flow]:
    yield Flow(node_kubectl, local_node, tmp_path_factory.mktemp("readme"))


def test_helm_install_runs_the_operator_as_a_pod(flow: Flow) -> None:
    # helm install dpserve-operator charts/dpserve-operator --namespace dpserve-system
    #   --create-namespace
    with flow.helm() as config:
        config.install(
            str(CHART), RELEASE, namespace=OPERATOR_NS, create_namespace=True, timeout=300
        )
    deployment = wait_for(
        lambda: (
            (d := flow.kubectl.json("get", "deployment", RELEASE, "-n", OPERATOR_NS))
            .get("status", {})
            .get("availableReplicas")
            and d
        ),
        180,
        "the operator Deployment available",
        diagnostics=flow.diagnostics,
    )
    pod_spec = deployment["spec"]["template"]["spec"]
    assert pod_spec["containers"][0]["image"] == "ghcr.io/dpserve/operator:0.1.0"
    assert pod_spec["serviceAccountName"] == RELEASE
    # The operator acts as its ServiceAccount, under the chart's ClusterRole (RBAC enforced).
    role = flow.kubectl.json("get", "clusterrole", RELEASE)
    assert role["rules"], role
    assert flow.kubectl("get", "crd", CRD_NAME).returncode == 0


def test_apply_the_example_and_the_engines_register(flow: Flow) -> None:
    flow.kubectl("create", "namespace", NAMESPACE)
    wait_for(
        lambda: flow.kubectl("get", "sa", "default", "-n", NAMESPACE, check=False).returncode == 0,
        30,
        "the default ServiceAccount",
    )
    example = yaml.safe_load(EXAMPLE.read_text())
    example["spec"].update(image=TINY_IMAGE, model=TINY_MODEL, imagePullPolicy="IfNotPresent")
    # One CPU each: fewer than the node has, so torch's thread count shows the limit applies.
    example["spec"]["engine"]["resources"]["limits"]["cpu"] = ENGINE_CPU_LIMIT
    manifest = flow.workdir / "inference.yaml"
    manifest.write_text(yaml.safe_dump(example))
    started = time.monotonic()
    flow.kubectl("apply", "-f", str(manifest), "-n", NAMESPACE)
    flow.wait_registered(2, "both engines registered after kubectl apply")
    TIMINGS["kubectl apply -> 2 engines registered"] = time.monotonic() - started

    header, row = flow.kubectl("get", "infd", "-n", NAMESPACE).stdout.splitlines()[:2]
    assert header.split()[:5] == ["NAME", "DESIRED", "READY", "REGISTERED", "PHASE"]
    assert row.split()[:5] == [NAME, "2", "2", "2", "Ready"], row
    # Engines dial the coordinator Service by its cluster DNS name.
    statefulset = flow.get("get", "statefulset", f"{NAME}-engine")
    command = statefulset["spec"]["template"]["spec"]["containers"][0]["command"]
    assert f"tcp://{NAME}-coordinator.{NAMESPACE}.svc:{ZMQ_PORT}" in command
    logs = flow.kubectl("logs", f"{NAME}-engine-0", "-n", NAMESPACE).stdout
    assert "registered with coordinator" in logs, logs[-2000:]


def test_pods_run_non_root_with_a_read_only_root_and_no_privilege_escalation(
    flow: Flow,
) -> None:
    pods = [(NAMESPACE, p) for p in pod_names(flow.kubectl, NAMESPACE)]
    pods += [(OPERATOR_NS, p) for p in pod_names(flow.kubectl, OPERATOR_NS)]
    assert len(pods) == 4, pods  # coordinator, 2 engines, operator
    probe = (
        "grep -E '^(Uid|NoNewPrivs):' /proc/1/status; awk '$2 == \"/\" {print $4}' /proc/1/mounts"
    )
    for namespace, pod in pods:
        # What the container's main process (pid 1 of its pid namespace) runs with.
        output = flow.kubectl("exec", pod, "-n", namespace, "--", "sh", "-c", probe).stdout
        fields = dict(line.split(":", 1) for line in output.splitlines() if ":" in line)
        uids = fields["Uid"].split()
        assert uids and all(uid == "10001" for uid in uids), (pod, output)
        assert fields["NoNewPrivs"].strip() == "1", (pod, output)
        root_options = output.splitlines()[-1].split(",")
        assert "ro" in root_options, (pod, output)
        write = flow.kubectl("exec", pod, "-n", namespace, "--", "touch", "/probe", check=False)
        assert write.returncode != 0 and "Read-only file system" in write.stderr, (pod, write)


def test_engines_use_as_many_torch_threads_as_their_cpu_limit(flow: Flow) -> None:
    assert (os.cpu_count() or 1) > int(ENGINE_CPU_LIMIT), "needs a node with more CPUs"
    threads = flow.kubectl(
        "exec", f"{NAME}-engine-0", "-n", NAMESPACE, "--",
        "python", "-c", "import torch; print(torch.get_num_threads())",
    ).stdout.strip()  # fmt: skip
    assert threads == ENGINE_CPU_LIMIT, threads


def pod_names(kubectl: Kubectl, namespace: str) -> list[str]:
    pods = kubectl.json("get", "pods", "-n", namespace)["items"]
    return [p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")]


def test_port_forward_then_generate_and_curl(flow: Flow) -> None:
    credentials = fetch_client_credentials(flow.kubectl, NAMESPACE, flow.workdir)
    token = (credentials / "http-api-token").read_text().strip()
    target = f"svc/{NAME}-coordinator"
    with PortForward(flow.kubectl, NAMESPACE, target, [ZMQ_PORT, HTTP_PORT]) as forward:
        zmq, http = forward.local_ports[ZMQ_PORT], forward.local_ports[HTTP_PORT]
        generated = dpserve_generate(f"tcp://127.0.0.1:{zmq}", credentials)
        assert generated.returncode == 0 and generated.stdout.strip(), generated
        curl = subprocess.run(
            [
                "curl", "-sS", "--fail-with-body", f"http://127.0.0.1:{http}/v1/completions",
                "-H", "Content-Type: application/json",
                "-H", f"Authorization: Bearer {token}",
                "-d", '{"prompt": "Hello", "max_tokens": 16}',
            ],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert curl.returncode == 0, curl
        reply = json.loads(curl.stdout)
        assert reply["choices"][0]["text"] and reply["usage"]["completion_tokens"] >= 1, reply
        refused = subprocess.run(
            ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
             f"http://127.0.0.1:{http}/v1/completions", "-d", "{}"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert refused.stdout == "401", refused


def test_patch_and_scale_change_the_registered_engines(flow: Flow) -> None:
    patch = '{"spec": {"dataParallelSize": 3}}'
    flow.kubectl("patch", "infd", NAME, "-n", NAMESPACE, "--type=merge", "-p", patch)
    TIMINGS["kubectl patch 2 -> 3: new engine registered"] = flow.wait_registered(
        3, "the third engine registered after kubectl patch"
    )
    flow.kubectl("scale", f"infd/{NAME}", "--replicas=2", "-n", NAMESPACE)
    flow.wait_registered(2, "two engines registered after kubectl scale")
    flow.kubectl("scale", f"infd/{NAME}", "--replicas=3", "-n", NAMESPACE)
    TIMINGS["kubectl scale 2 -> 3: new engine registered"] = flow.wait_registered(
        3, "the third engine registered again after kubectl scale"
    )
    flow.kubectl("scale", f"infd/{NAME}", "--replicas=2", "-n", NAMESPACE)
    flow.wait_registered(2, "two engines after scaling back")


def completion(port: int, token: str) -> Callable[[int], tuple[int, str]]:
    def send(index: int) -> tuple[int, str]:
        body = json.dumps({"prompt": f"Hello {index}", "max_tokens": 24, "temperature": 0})
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as reply:
                return reply.status, json.loads(reply.read())["choices"][0]["text"]
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    return send


def test_engine_pod_deleted_during_a_burst_loses_no_request(flow: Flow) -> None:
    token = (flow.workdir / "demo-credentials" / "http-api-token").read_text().strip()
    victim = f"{NAME}-engine-1"
    old_uid = flow.get("get", "pod", victim)["metadata"]["uid"]
    target = f"svc/{NAME}-coordinator"
    with PortForward(flow.kubectl, NAMESPACE, target, [HTTP_PORT]) as forward:
        send = completion(forward.local_ports[HTTP_PORT], token)
        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = [pool.submit(send, i) for i in range(64)]
            time.sleep(1.0)
            deleted_at = time.monotonic()
            flow.kubectl("delete", "pod", victim, "-n", NAMESPACE, "--wait=false")
            results = [future.result(timeout=300) for future in futures]
    failures = [result for result in results if result[0] != 200]
    assert not failures, failures[:5]

    def replaced() -> bool:
        pod = flow.get("get", "pod", victim)
        conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}
        return pod["metadata"]["uid"] != old_uid and conditions.get("Ready") == "True"

    # The engine pod is Ready exactly when its engine registered (the ready-file probe).
    wait_for(replaced, REGISTER_TIMEOUT, f"a new {victim} registered", diagnostics=flow.diagnostics)
    TIMINGS["engine pod deleted -> replacement registered"] = time.monotonic() - deleted_at
    flow.wait_registered(2, "both engines registered after the replacement")


def test_delete_infd_garbage_collects_then_helm_uninstall(flow: Flow) -> None:
    flow.kubectl("delete", "infd", NAME, "-n", NAMESPACE, "--timeout=120s")

    def children_gone() -> bool:
        for kind, name, _ in CHILDREN:
            if flow.kubectl("get", kind, name, "-n", NAMESPACE, check=False).returncode == 0:
                return False
        return not pod_names(flow.kubectl, NAMESPACE)

    wait_for(children_gone, 120, "every child of demo deleted", diagnostics=flow.diagnostics)
    # helm uninstall dpserve-operator --namespace dpserve-system
    with flow.helm() as config:
        config.uninstall(RELEASE, timeout=120)
    wait_for(
        lambda: (
            not pod_names(flow.kubectl, OPERATOR_NS)
            and flow.kubectl(
                "get", "deployment", RELEASE, "-n", OPERATOR_NS, check=False
            ).returncode
        ),
        120,
        "the operator removed",
        diagnostics=flow.diagnostics,
    )
    flow.kubectl("delete", "crd", CRD_NAME, "--timeout=60s")
