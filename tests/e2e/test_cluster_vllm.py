"""The vLLM backend on the one-node cluster: ``examples/inference-vllm.yaml`` as typed.

In file order, with an operator of its own (installed by Helm's own install action, watching
this module's namespace only, so that no other module's operator reconciles it):

1. ``kubectl apply -f examples/inference-vllm.yaml``: the vLLM CPU runtime image
   (images/Dockerfile.runtime-vllm-cpu, built by scripts/build-images.sh) runs the coordinator
   and one engine, ``dpserve engine --backend vllm``, which registers and turns Ready;
2. ``kubectl port-forward`` to the coordinator Service: a chat completion answers with the
   deployment's bearer token, greedily;
3. ``kubectl patch`` of ``dataParallelSize`` 1 → 2: a second vLLM engine registers, and both
   engines serve requests;
4. the pods' peak memory fits the example's limits; ``kubectl delete`` and ``helm uninstall``
   leave nothing.

The durations (apply → registered, patch → second engine registered) and the peaks are printed
in the terminal summary; vLLM's start is most of them (the example runs it eager: compiling its
graphs took minutes on 2 cores).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.cluster import Kubectl, wait_for
from tests.e2e.local_node import TIMINGS, LocalNode, PortForward, cluster_opt_in
from tests.e2e.test_cluster_flow import parse_bytes

# Opt-in (DPSERVE_E2E_VLLM=1, which also makes scripts/build-images.sh build the 4.5 GB vLLM
# CPU image; .ci/run sets it): a user's `make test` or `make cluster` is spared that image.
# Earlier runs found and fixed /dev/shm, libnuma1 and a read-only inductor cache; one (7c4765a)
# had the engine never reach the coordinator's Service while it listened, not seen since.
vllm_opt_in = pytest.mark.skipif(
    os.environ.get("DPSERVE_E2E_VLLM") != "1",
    reason="the vLLM backend's cluster e2e is opt-in (DPSERVE_E2E_VLLM=1, set in CI): it "
    "builds and imports the 4.5 GB vLLM CPU image",
)
pytestmark = [pytest.mark.e2e, cluster_opt_in, vllm_opt_in, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "inference-vllm.yaml"
HELM = ROOT / "scripts" / "helm"
CHART = ROOT / "charts" / "dpserve-operator"
CRD_NAME = "inferencedeployments.dpserve.io"
NAME = "demo-vllm"  # as in the example
NAMESPACE = "vllm"
RELEASE = "vllm-dpserve-operator"  # contains the chart name: the objects are named so
OPERATOR_NS = "dpserve-vllm-system"
HTTP_PORT = 8000  # the CRD's default, which the example keeps
# vLLM's CPU start in eager mode, beside the other pods of a shared 2-core node.
REGISTER_TIMEOUT = 600.0
JSON = dict[str, Any]


@dataclass
class Cluster:
    kubectl: Kubectl
    node: LocalNode
    crd_was_there: bool

    def status(self) -> JSON:
        found = self.kubectl.json("get", "infd", NAME, "-n", NAMESPACE)
        return dict(found.get("status") or {})

    def wait_registered(self, engines: int, what: str) -> float:
        started = time.monotonic()

        def ready() -> bool:
            status = self.status()
            return status.get("phase") == "Ready" and status.get("registeredEngines") == engines

        wait_for(ready, REGISTER_TIMEOUT, what, interval=1.0, diagnostics=self.diagnostics)
        return time.monotonic() - started

    def helm(self, *args: str) -> str:
        result = subprocess.run(
            [str(HELM), *args],
            env={**os.environ, "KUBECONFIG": str(self.kubectl.kubeconfig),
                 "PYTHON": sys.executable},
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result
        return result.stdout

    def pods(self, namespace: str) -> list[str]:
        found = self.kubectl.json("get", "pods", "-n", namespace)["items"]
        return sorted(pod["metadata"]["name"] for pod in found)

    def logs(self, pod: str) -> str:
        return self.kubectl("logs", pod, "-n", NAMESPACE, check=False).stdout

    def diagnostics(self) -> str:
        pods = self.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
        described = self.kubectl("describe", "infd", NAME, "-n", NAMESPACE, check=False).stdout
        events = self.kubectl("get", "events", "-n", NAMESPACE, check=False).stdout
        engine_logs = "\n".join(
            f"---- {pod}\n{self.logs(pod)[-3000:]}"
            for pod in self.pods(NAMESPACE)
            if "engine" in pod
        )
        return f"{pods}\n{described}\n{events[-3000:]}\n{engine_logs}"


@pytest.fixture(scope="module")
def cluster(local_node: LocalNode, node_kubectl: Kubectl) -> Iterator[Cluster]:
    kubectl = node_kubectl
    crd_was_there = kubectl("get", "crd", CRD_NAME, check=False).returncode == 0
    cluster = Cluster(kubectl, local_node, crd_was_there)
    cluster.helm(
        "install", RELEASE, str(CHART), "--namespace", OPERATOR_NS, "--create-namespace",
        "--set", "watch.allNamespaces=false", "--set", f"watch.namespace={NAMESPACE}",
    )  # fmt: skip
    wait_for(
        lambda: (
            kubectl.json("get", "deployment", RELEASE, "-n", OPERATOR_NS)
            .get("status", {})
            .get("availableReplicas")
        ),
        180,
        "the operator Deployment available",
        diagnostics=cluster.diagnostics,
    )
    kubectl.create_namespace(NAMESPACE)
    try:
        yield cluster
    finally:
        kubectl("delete", "infd", NAME, "-n", NAMESPACE, "--ignore-not-found",
                "--timeout=180s", timeout=200, check=False)  # fmt: skip
        kubectl("delete", "namespace", NAMESPACE, "--timeout=180s", timeout=200, check=False)
        cluster.helm("uninstall", RELEASE, "--namespace", OPERATOR_NS)
        kubectl("delete", "namespace", OPERATOR_NS, "--timeout=120s", timeout=140, check=False)
        if not crd_was_there:
            kubectl("delete", "crd", CRD_NAME, "--timeout=60s", check=False)


def example() -> JSON:
    published: JSON = yaml.safe_load(EXAMPLE.read_text())
    return published


def test_the_vllm_example_comes_up_as_typed(cluster: Cluster) -> None:
    started = time.monotonic()
    cluster.kubectl("apply", "-f", str(EXAMPLE), "-n", NAMESPACE)
    cluster.wait_registered(1, "the vLLM engine registered after kubectl apply")
    TIMINGS["kubectl apply -f examples/inference-vllm.yaml -> 1 vLLM engine registered"] = (
        time.monotonic() - started
    )
    statefulset = cluster.kubectl.json("get", "statefulset", f"{NAME}-engine", "-n", NAMESPACE)
    (engine,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert engine["image"] == "ghcr.io/dpserve/runtime-vllm-cpu:0.1.0"
    command = engine["command"]
    assert command[command.index("--backend") + 1] == "vllm", command
    assert command[command.index("--tensor-parallel-size") + 1] == "1", command
    assert "--vllm-arg=--enforce-eager" in command, command
    logs = cluster.logs(f"{NAME}-engine-0")
    assert logs.count("registered with coordinator") == 1, logs[-3000:]
    # vLLM computes, eager as the example asks: no torch.compile, no graph capture.
    assert "Enforce eager set, disabling torch.compile" in logs, logs[-3000:]

    # Desired, Ready (pods), Registered, Phase: the pod turns Ready at its readiness probe's
    # next period after the registration (the first run read "1 0 1 Ready" at that moment).
    def row() -> str:
        return str(cluster.kubectl("get", "infd", "-n", NAMESPACE).stdout.splitlines()[1])

    wait_for(
        lambda: row().split()[:5] == [NAME, "1", "1", "1", "Ready"],
        30,
        "kubectl get infd: 1 desired, 1 pod ready, 1 registered, Ready",
        diagnostics=lambda: row() + "\n" + cluster.diagnostics(),
    )


def api_token(cluster: Cluster) -> str:
    secret = cluster.kubectl.json("get", "secret", f"{NAME}-client-credentials", "-n", NAMESPACE)
    return base64.b64decode(secret["data"]["http-api-token"]).decode().strip()


def chat(port: int, token: str, content: str) -> JSON:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 16,
            "temperature": 0}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        reply: JSON = json.loads(response.read())
    return reply


def test_it_answers_through_port_forward(cluster: Cluster) -> None:
    token = api_token(cluster)
    with PortForward(cluster.kubectl, NAMESPACE, f"svc/{NAME}-coordinator", [HTTP_PORT]) as pf:
        port = pf.local_ports[HTTP_PORT]
        first = chat(port, token, "What is the capital of France?")
        again = chat(port, token, "What is the capital of France?")
    text = first["choices"][0]["message"]["content"]
    assert text.strip() and first["usage"]["completion_tokens"] >= 1, first
    # Greedy: the same answer twice.
    assert again["choices"][0]["message"]["content"] == text


def test_editing_the_cr_scales_it_from_1_to_2_engines(cluster: Cluster) -> None:
    started = time.monotonic()
    patch = '{"spec": {"dataParallelSize": 2}}'
    cluster.kubectl("patch", "infd", NAME, "-n", NAMESPACE, "--type=merge", "-p", patch)
    cluster.wait_registered(2, "the second vLLM engine registered after kubectl patch")
    TIMINGS["kubectl patch 1 -> 2: second vLLM engine registered"] = time.monotonic() - started
    logs = cluster.logs(f"{NAME}-engine-1")
    assert logs.count("registered with coordinator") == 1, logs[-3000:]
    # Both engines serve: a burst spreads over them (the coordinator routes to the less
    # loaded one when no prefix is cached), and every request is answered.
    token = api_token(cluster)
    with PortForward(cluster.kubectl, NAMESPACE, f"svc/{NAME}-coordinator", [HTTP_PORT]) as pf:
        port = pf.local_ports[HTTP_PORT]
        prompts = [f"Count to {n}." for n in range(8)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(lambda prompt: chat(port, token, prompt), prompts))
        assert all(reply["choices"][0]["message"]["content"].strip() for reply in replies)

        # Each engine computed some of them: the prompt tokens its vLLM scheduler looked up in
        # its prefix cache, per rank, as /metrics reports them from the engines' heartbeats
        # (the next heartbeat after the burst, hence the wait).
        def both_engines_counted() -> bool:
            found = prompt_tokens_by_rank(port, token)
            return set(found) == {"0", "1"} and all(found.values())

        wait_for(
            both_engines_counted,
            30,
            "both engines' prompt tokens in /metrics after the burst",
            diagnostics=lambda: str(prompt_tokens_by_rank(port, token)),
        )
    record_peak_memory(cluster)


def prompt_tokens_by_rank(port: int, token: str) -> dict[str, float]:
    """``dpserve_engine_prefix_cache_queries`` by engine rank, from the front's /metrics."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        page = response.read().decode()
    found: dict[str, float] = {}
    for line in page.splitlines():
        name = line.split("{", 1)[0]
        if name in (
            "dpserve_engine_prefix_cache_queries",
            "dpserve_engine_prefix_cache_queries_total",
        ):
            rank = line.split('rank="', 1)[1].split('"', 1)[0]
            found[rank] = float(line.rsplit(" ", 1)[1])
    return found


def record_peak_memory(cluster: Cluster) -> None:
    """Each pod's peak: every process's peak RSS (VmHWM) summed, and the cgroup's peak usage
    (page cache included); the RSS must fit the example's limit."""
    spec = example()["spec"]
    probe = (
        "cat /proc/[0-9]*/status 2>/dev/null | awk '/^VmHWM/ {kb += $2} END {print kb}'; "
        "cat /sys/fs/cgroup/memory/memory.max_usage_in_bytes"
    )
    for pod in cluster.pods(NAMESPACE):
        component = "coordinator" if "coordinator" in pod else "engine"
        output = cluster.kubectl("exec", pod, "-n", NAMESPACE, "--", "sh", "-c", probe).stdout
        rss_kib, cgroup_bytes = (int(value) for value in output.split())
        limit = parse_bytes(spec[component]["resources"]["limits"]["memory"])
        TIMINGS[f"peak memory {pod}: RSS MiB"] = rss_kib / 1024
        TIMINGS[f"peak memory {pod}: cgroup MiB"] = cgroup_bytes / 2**20
        assert rss_kib * 1024 < limit, (pod, rss_kib, limit)


def test_delete_leaves_nothing(cluster: Cluster) -> None:
    cluster.kubectl("delete", "infd", NAME, "-n", NAMESPACE, "--timeout=180s", timeout=200)
    wait_for(
        lambda: not cluster.pods(NAMESPACE),
        180,
        "every pod of demo-vllm deleted",
        diagnostics=cluster.diagnostics,
    )
