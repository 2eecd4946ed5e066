"""Operator latency on the local Kubernetes control plane (not a test).

    python bench/operator_latency.py [--rounds 2]

Starts the e2e control plane (`tests.e2e.cluster.ControlPlane`) and node agent, applies the
CRD, runs ``dpserve operator --all-namespaces`` as a subprocess (the operator's own latency
is measured, not its pod's start) and serves the tiny test model. Measures:

- create: from ``kubectl apply`` of an InferenceDeployment to all 7 children existing
  (goal < 2 s); one deployment with engines plus a few with ``dataParallelSize: 0``;
- scale → StatefulSet: from ``kubectl patch`` of ``spec.dataParallelSize`` to the engine
  StatefulSet's ``spec.replicas`` showing the new count (goal < 1 s);
- scale → status: from the same patch to ``status.registeredEngines`` showing the new count
  (goal < 10 s), split into "engines registered" (the coordinator's own ``/health``, read
  directly) and "status lag" (how long the status took to follow ``/health``), which is where
  the operator's 2-second status timer shows.

Everything is polled every 20 ms with plain GETs, so each figure is accurate to ~20 ms plus
one GET. Prints per-sample figures, then min / median / max against the goals.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Appended, not prepended: the repository's `operator/` directory would shadow the stdlib's
# `operator` module for everything imported after it.
sys.path.append(str(ROOT))

from kubernetes import client as k8s  # noqa: E402

from tests.e2e.cluster import (  # noqa: E402
    LOOPBACK,
    ControlPlane,
    Kubectl,
    find_kubectl,
    free_ports,
    kill_process_group,
    parent_death_prefix,
    wait_for,
)
from tests.e2e.node_agent import NodeAgent  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402

DPSERVE = str(Path(sys.executable).with_name("dpserve"))
CRD_FILE = ROOT / "crds" / "inferencedeployment.yaml"
GROUP, VERSION, PLURAL = "dpserve.io", "v1alpha1", "inferencedeployments"
NAMESPACE = "bench"
POLL = 0.02
GOALS = {"create": 2.0, "scale → StatefulSet": 1.0, "scale → status": 10.0}
# (kind, name suffix) of every child; each is fetched with a plain GET.
CHILD_PATHS = [
    ("apis/apps/v1", "deployments", "coordinator"),
    ("api/v1", "services", "coordinator"),
    ("api/v1", "services", "engine"),
    ("apis/apps/v1", "statefulsets", "engine"),
    ("apis/policy/v1beta1", "poddisruptionbudgets", "engine"),
    ("apis/networking.k8s.io/v1", "networkpolicies", "coordinator"),
    ("apis/networking.k8s.io/v1", "networkpolicies", "engine"),
]


class Bench:
    def __init__(self, plane: ControlPlane, agent: NodeAgent, model: Path) -> None:
        self.plane = plane
        self.agent = agent
        self.model = model
        kubectl = find_kubectl()
        if kubectl is None:
            raise SystemExit("kubectl not found next to the interpreter")
        self.kubectl = Kubectl(kubectl, plane.kubeconfig)
        self.api = plane.api_client()
        self.custom = k8s.CustomObjectsApi(self.api)
        self.samples: dict[str, list[float]] = {key: [] for key in GOALS}
        self.extra: dict[str, list[float]] = {"engines registered": [], "status lag": []}

    # -- helpers ---------------------------------------------------------------------------

    def get(self, path: str) -> tuple[int, Any]:
        """GET a path with the cluster's credentials: (HTTP status, decoded JSON)."""
        serialized = self.api.param_serialize(
            method="GET",
            resource_path=path,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*serialized)
        return response.status, json.loads(response.read() or b"null")

    def exists(self, path: str) -> bool:
        status, body = self.get(path)
        if status not in (200, 404):
            raise RuntimeError(f"GET {path}: {status} {body}")
        return status == 200

    def get_json(self, path: str) -> Any:
        status, body = self.get(path)
        if status != 200:
            raise RuntimeError(f"GET {path}: {status} {body}")
        return body

    def children_exist(self, name: str) -> bool:
        return all(
            self.exists(f"/{prefix}/namespaces/{NAMESPACE}/{plural}/{name}-{suffix}")
            for prefix, plural, suffix in CHILD_PATHS
        )

    def statefulset_replicas(self, name: str) -> int:
        path = f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/{name}-engine"
        return int(self.get_json(path)["spec"]["replicas"])

    def status(self, name: str) -> dict[str, Any]:
        obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
        return dict(obj.get("status") or {})

    @staticmethod
    def health_engines(http_port: int) -> int | None:
        try:
            with urllib.request.urlopen(f"http://{LOOPBACK}:{http_port}/health", timeout=1) as r:
                return int(json.load(r)["engines"])
        except urllib.error.HTTPError as error:
            return int(json.loads(error.read())["engines"])
        except (OSError, ValueError, KeyError):
            return None

    @staticmethod
    def until(condition: Callable[[], bool], timeout: float, what: str) -> float:
        """Poll every POLL s; the monotonic time the condition first held."""
        deadline = time.monotonic() + timeout
        while True:
            if condition():
                return time.monotonic()
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(POLL)

    def manifest(self, name: str, size: int, zmq_port: int, http_port: int) -> dict[str, Any]:
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {
                "model": str(self.model),
                "image": "ghcr.io/dpserve/runtime-cpu:0.1.0",
                "dataParallelSize": size,
                "engine": {"dtype": "float32", "device": "cpu"},
                "coordinator": {"zmqPort": zmq_port, "httpPort": http_port},
            },
        }

    # -- measurements ----------------------------------------------------------------------

    def create(self, name: str, size: int, zmq_port: int, http_port: int) -> float:
        manifest = self.manifest(name, size, zmq_port, http_port)
        start = time.monotonic()
        self.kubectl.apply(manifest)
        done = self.until(lambda: self.children_exist(name), 30, f"the children of {name}")
        elapsed = done - start
        self.samples["create"].append(elapsed)
        print(f"  create {name} (dataParallelSize {size}): all children after {elapsed:.2f} s")
        return elapsed

    def scale(self, name: str, size: int, http_port: int) -> None:
        start = time.monotonic()
        self.kubectl(
            "patch", "infd", name, "-n", NAMESPACE, "--type=merge",
            "-p", json.dumps({"spec": {"dataParallelSize": size}}),
        )  # fmt: skip
        sts = self.until(
            lambda: self.statefulset_replicas(name) == size, 10, f"StatefulSet replicas {size}"
        )
        # /health, the StatefulSet's status and the CR's status are watched together so
        # that no poll delays another. The operator can only report what both of the first
        # two show, so its own lag is measured from the later of them.
        seen: dict[str, float] = {}
        sts_path = f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/{name}-engine"

        def all_three() -> bool:
            now = time.monotonic()
            if "health" not in seen and self.health_engines(http_port) == size:
                seen["health"] = now
            if "pods" not in seen:
                sts_status = self.get_json(sts_path).get("status") or {}
                if sts_status.get("replicas", 0) == size and (
                    sts_status.get("readyReplicas", 0) == size
                ):
                    seen["pods"] = now
            if "status" not in seen:
                status = self.status(name)
                if status.get("registeredEngines") == size and status.get("replicas") == size:
                    seen["status"] = now
            return len(seen) == 3

        self.until(all_three, 120, f"{size} engines registered and in the status")
        to_sts, to_status = sts - start, seen["status"] - start
        observable = max(seen["health"], seen["pods"])
        lag = seen["status"] - observable
        self.samples["scale → StatefulSet"].append(to_sts)
        self.samples["scale → status"].append(to_status)
        self.extra["engines registered"].append(seen["health"] - start)
        self.extra["status lag"].append(lag)
        print(
            f"  scale {name} → {size}: StatefulSet spec {to_sts:.2f} s, "
            f"/health {seen['health'] - start:.2f} s, StatefulSet status "
            f"{seen['pods'] - start:.2f} s, CR status {to_status:.2f} s "
            f"(operator lag {lag:.2f} s)"
        )

    def run(self, rounds: int, extra_creates: int) -> None:
        main_zmq, main_http, *spare = free_ports(2 + 2 * extra_creates)
        print("creating:")
        for index in range(extra_creates):
            name = f"bench-empty-{index}"
            self.create(name, 0, spare[2 * index], spare[2 * index + 1])
            self.kubectl("delete", "infd", name, "-n", NAMESPACE, "--timeout=60s")
        # Their coordinators' processes must be gone before engines are timed.
        pods = f"/api/v1/namespaces/{NAMESPACE}/pods"
        self.until(lambda: not self.get_json(pods)["items"], 60, "the 0-engine pods to go")
        self.create("bench", 1, main_zmq, main_http)
        self.until(lambda: self.status("bench").get("phase") == "Ready", 120, "bench to turn Ready")
        print("scaling (tiny model):")
        for _ in range(rounds):
            for size in (2, 3, 1):
                self.scale("bench", size, main_http)
        self.kubectl("delete", "infd", "--all", "-n", NAMESPACE, "--timeout=60s")

    def report(self) -> None:
        print("\nsummary (seconds)          min    median   max    goal")
        for key, values in self.samples.items():
            goal = GOALS[key]
            verdict = "ok" if max(values) < goal else "MISSED"
            print(
                f"  {key:<24} {min(values):5.2f}  {statistics.median(values):6.2f}  "
                f"{max(values):5.2f}  < {goal:g} s  {verdict}"
            )
        for key, values in self.extra.items():
            print(
                f"  {key:<24} {min(values):5.2f}  {statistics.median(values):6.2f}  "
                f"{max(values):5.2f}"
            )


def start_operator(plane: ControlPlane, log_path: Path) -> subprocess.Popen[bytes]:
    (liveness_port,) = free_ports(1)
    env = {**os.environ, "KUBECONFIG": str(plane.kubeconfig)}
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [*parent_death_prefix(), DPSERVE, "operator", "--all-namespaces",
             "--liveness-port", str(liveness_port)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def live() -> bool:
        if process.poll() is not None:
            raise SystemExit(f"the operator exited with {process.returncode}; see {log_path}")
        try:
            url = f"http://{LOOPBACK}:{liveness_port}/healthz"
            with urllib.request.urlopen(url, timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    wait_for(live, 60, "the operator's liveness endpoint")
    return process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="scale 1→2→3→1 this many times")
    parser.add_argument("--creates", type=int, default=3, help="extra 0-engine creations")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="dpserve-bench-operator-") as scratch:
        model = build_tiny_model(Path(scratch) / "tiny-model")
        with ControlPlane() as plane:
            assert plane.workdir is not None
            with NodeAgent(
                plane.kubeconfig,
                node_name=plane.node_name,
                log_dir=plane.workdir / "node",
                pod_env={"KUBECONFIG": str(plane.kubeconfig)},
            ) as agent:
                bench = Bench(plane, agent, model)
                bench.kubectl("apply", "-f", str(CRD_FILE))
                bench.kubectl(
                    "wait", "--for=condition=Established", f"crd/{PLURAL}.{GROUP}", "--timeout=30s"
                )
                bench.kubectl("create", "namespace", NAMESPACE)
                account = f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/default"
                wait_for(
                    lambda: bench.exists(account) and bench.get_json(account).get("secrets"),
                    30,
                    "the namespace's default ServiceAccount token",
                )
                operator = start_operator(plane, Path(scratch) / "operator.log")
                try:
                    bench.run(args.rounds, args.creates)
                    bench.report()
                finally:
                    kill_process_group(operator, grace_seconds=10)
                    bench.api.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
