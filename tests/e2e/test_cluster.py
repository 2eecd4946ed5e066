"""Kubernetes for real: docs/kubernetes.md's flow on a one-node cluster whose pods are containers.

scripts/local-cluster.sh brings up kubelet + containerd/runc + CNI bridge + kube-proxy
(iptables) + dnsmasq cluster DNS next to the control plane, with the images built from
images/ by scripts/build-images.sh. The tests run in file order on one node:

1. the node is a real kubelet on containerd, Ready and untainted;
2. a pause-only pod runs, and a shell pod resolves ``<svc>.<ns>.svc.cluster.local`` and
   ``kubernetes.default`` through the cluster DNS;
3. the README flow, command for command: ``helm install`` (Helm's own install action, via
   its Go SDK) runs the operator as a pod with the chart's RBAC; ``kubectl apply -f`` the
   example (the runtime image with the tiny test model; the engines register through the
   coordinator Service's DNS name); ``kubectl get infd``; ``kubectl patch`` and ``kubectl
   scale``; ``kubectl port-forward`` to the coordinator Service, then ``dpserve generate``
   and ``curl`` with the generated credentials; an engine pod deleted during a burst of
   requests (none lost, the replacement registers); every pod non-root, read-only root
   filesystem, no privilege escalation (read from the running processes); ``kubectl delete
   infd`` garbage-collects everything; ``helm uninstall`` removes the operator.

Opt-in with DPSERVE_E2E_CLUSTER=1 (root; see tests/e2e/local_node.py).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import Kubectl, wait_for
from tests.e2e.local_node import NODE_NAME, POD_CIDR_PREFIX, cluster_opt_in

# The first test brings the node up (a cold build is minutes); each wait has its own bound.
pytestmark = [pytest.mark.e2e, cluster_opt_in, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = "localhost/dpserve/base:bookworm"
PAUSE_IMAGE = "localhost/dpserve/pause:3.4"
JSON = dict[str, Any]


def wait_pod(kubectl: Kubectl, namespace: str, name: str, ok: Callable[[JSON], bool]) -> JSON:
    def check() -> JSON | None:
        result = kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
        pod = json.loads(result.stdout) if result.returncode == 0 else None
        return pod if pod and ok(pod) else None

    def diagnostics() -> str:
        return kubectl("describe", "pod", name, "-n", namespace, check=False).stdout

    pod: JSON = wait_for(check, 120, f"pod {namespace}/{name}", diagnostics=diagnostics)
    return pod


def running(pod: JSON) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running"


def test_the_node_is_a_kubelet_on_containerd(node_kubectl: Kubectl) -> None:
    kubectl = node_kubectl
    node = kubectl.json("get", "node", NODE_NAME)
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.20.2"
    assert info["kubeProxyVersion"] == "v1.20.2"
    assert info["containerRuntimeVersion"].startswith("containerd://")
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True", node["status"]["conditions"]
    assert not node["spec"].get("taints"), node["spec"]
    # kube-proxy in iptables mode answers on its metrics port with its mode.
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert addresses["InternalIP"] == POD_CIDR_PREFIX + "1"


SHELL_POD = """
apiVersion: v1
kind: Pod
metadata: {name: shell, labels: {app: shell}}
spec:
  restartPolicy: Never
  containers:
  - name: shell
    image: %(image)s
    imagePullPolicy: IfNotPresent
    command:
    - sh
    - -c
    - >-
      for name in kubernetes.default.svc.cluster.local echo.%(ns)s.svc.cluster.local echo;
      do getent hosts $name || echo unresolved $name; done; sleep 3600
---
apiVersion: v1
kind: Pod
metadata: {name: pause}
spec:
  containers:
  - {name: pause, image: %(pause)s, imagePullPolicy: IfNotPresent}
---
apiVersion: v1
kind: Service
metadata: {name: echo}
spec:
  selector: {app: shell}
  ports: [{port: 80}]
"""


def test_pods_run_and_resolve_cluster_dns(node_kubectl: Kubectl) -> None:
    kubectl = node_kubectl
    namespace = "dns-check"
    kubectl.create_namespace(namespace)
    # The Service first, so that its record exists when the shell pod looks it up.
    manifests = SHELL_POD % {"image": BASE_IMAGE, "pause": PAUSE_IMAGE, "ns": namespace}
    service, *pods = manifests.split("---")[::-1]
    kubectl("apply", "-n", namespace, "-f", "-", input=service)
    cluster_ip = kubectl.json("get", "service", "echo", "-n", namespace)["spec"]["clusterIP"]
    time.sleep(2)  # cluster_dns.py polls twice a second
    kubectl("apply", "-n", namespace, "-f", "-", input="---".join(pods))

    pause = wait_pod(kubectl, namespace, "pause", running)
    assert pause["status"]["podIP"].startswith(POD_CIDR_PREFIX)
    shell = wait_pod(kubectl, namespace, "shell", running)
    assert shell["status"]["podIP"].startswith(POD_CIDR_PREFIX)

    def resolved() -> str | None:
        log = kubectl("logs", "shell", "-n", namespace, check=False).stdout
        return log if log.count("\n") >= 3 else None

    log = wait_for(resolved, 30, "the shell pod's lookups")
    assert "unresolved" not in log, log
    assert re.search(r"^10\.96\.0\.1 +kubernetes\.default\.svc\.cluster\.local$", log, re.M), log
    # Both the full name and the short one (through the pod's search domains).
    service_name = re.escape(f"echo.{namespace}.svc.cluster.local")
    assert len(re.findall(rf"^{re.escape(cluster_ip)} +{service_name}$", log, re.M)) == 2, log
    kubectl("delete", "namespace", namespace, "--wait=false")
