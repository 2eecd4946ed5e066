"""The README's Kubernetes flow, command for command, on the one-node cluster.

Pods are containers from the images built from images/ (tests/e2e/test_cluster.py checks the
node itself). In file order, sharing one operator and one InferenceDeployment:

1. ``scripts/helm install`` (the README's helm arguments, run by Helm's own install action
   through its Go SDK: the local path has no helm binary) runs the operator as a pod from its
   image, with the chart's ServiceAccount and RBAC (the API server enforces RBAC);
2. ``kubectl apply -f examples/inference.yaml`` exactly as published: the real runtime image
   with SmolLM2 converted at image build (no pod converts anything), the coordinator loading
   only the tokenizer; the engines register through the coordinator Service's DNS name;
   ``kubectl get infd`` shows READY/REGISTERED; the pods run hardened;
3. ``kubectl port-forward`` to the coordinator Service, the credentials fetched as the docs say,
   then ``dpserve generate`` and ``curl`` get answers, and the chart NOTES' commands work as
   typed (token included);
4. ``kubectl patch`` (2 → 3) and ``kubectl scale`` (3 → 2): the coordinator sees the engines;
5. an engine pod deleted during a burst of requests: it hands its requests to the other engine
   and exits at once, none is lost, the replacement registers; the pods' peak memory is read
   and checked against the example's limits;
6. a child that cannot run (an impossible memory limit, a missing image, a request no node
   can meet) turns the status Degraded with the pod's reason and message, and an event says so;
7. ``kubectl delete infd`` garbage-collects everything; ``scripts/helm uninstall`` removes the
   operator.

The durations asked for (apply → all engines registered, scale → new engine registered, pod
delete → replacement registered) and the measured peaks are printed in the terminal summary.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from dpserve_operator.crd import GROUP, PLURAL, VERSION
from tests.e2e.cluster import Kubectl, wait_for
from tests.e2e.local_node import TIMELINES, TIMINGS, LocalNode, PortForward, cluster_opt_in
from tests.e2e.test_operator import (
    CHILDREN,
    CRD_NAME,
    EXAMPLE,
    NAME,
    OPERATOR_NS,
    RELEASE,
    credentials_directory,
    dpserve_generate,
    fetch_client_credentials,
)

# The first test brings the node up (a cold build is minutes); each wait has its own bound.
pytestmark = [pytest.mark.e2e, cluster_opt_in, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "dpserve-operator"
NAMESPACE = "readme"
HELM = ROOT / "scripts" / "helm"
NOTES = CHART / "templates" / "NOTES.txt"
ZMQ_PORT, HTTP_PORT = 5555, 8000  # examples/inference.yaml
REGISTER_TIMEOUT = 240.0
# Seconds from `kubectl delete pod` to the engine's "handed N request(s)" line (~0.3 s seen).
HAND_OFF_BOUND = 10.0
FAULTS_NAMESPACE = "faults"
JSON = dict[str, Any]


def example() -> JSON:
    published: JSON = yaml.safe_load(EXAMPLE.read_text())
    return published


@dataclass
class Flow:
    kubectl: Kubectl
    node: LocalNode
    workdir: Path

    def get(self, *args: str) -> Any:
        return self.kubectl.json(*args, "-n", NAMESPACE)

    @functools.cached_property
    def custom_objects(self) -> Any:
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(str(self.kubectl.kubeconfig), client_configuration=configuration)
        return client.CustomObjectsApi(client.ApiClient(configuration))

    def status(self) -> JSON:
        # Through the API client, not a kubectl process per poll: the waits below time an
        # engine's start on the same two cores, and a kubectl run costs ~0.1 s of CPU.
        found = self.custom_objects.get_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, PLURAL, NAME
        )
        return dict(found.get("status") or {})

    def wait_registered(self, engines: int, what: str) -> float:
        """Seconds until the operator reports `engines` registered and Ready."""
        started = time.monotonic()

        def ready() -> bool:
            status = self.status()
            return status.get("phase") == "Ready" and status.get("registeredEngines") == engines

        wait_for(ready, REGISTER_TIMEOUT, what, interval=0.25, diagnostics=self.diagnostics)
        return time.monotonic() - started

    def helm(self, *args: str) -> str:
        """``scripts/helm ARGS`` (the README's helm line), with this cluster's kubeconfig."""
        result = subprocess.run(
            [str(HELM), *args],
            env={**os.environ, "KUBECONFIG": str(self.kubectl.kubeconfig),
                 "PYTHON": sys.executable},
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result
        return result.stdout

    def shim(self, namespace: str) -> Path:
        """A directory with a ``kubectl`` that talks to this cluster in ``namespace`` (the
        current context's namespace, for commands typed as the docs show them)."""
        directory = self.workdir / f"bin-{namespace}"
        directory.mkdir(exist_ok=True)
        (directory / "kubectl").write_text(
            f'#!/bin/sh\nexec "{self.kubectl.binary}" --kubeconfig="{self.kubectl.kubeconfig}" '
            f'-n "{namespace}" "$@"\n'
        )
        (directory / "kubectl").chmod(0o755)
        return directory

    def diagnostics(self) -> str:
        pods = self.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
        described = self.kubectl("describe", "infd", NAME, "-n", NAMESPACE, check=False).stdout
        events = self.kubectl("get", "events", "-n", NAMESPACE, check=False).stdout
        return f"{pods}\n{described}\n{events[-3000:]}\n{self.node.log_tail('kubelet', 20)}"


@pytest.fixture(scope="module")
def flow(
    local_node: LocalNode, node_kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Flow]:
    flow = Flow(node_kubectl, local_node, tmp_path_factory.mktemp("readme"))
    yield flow
    if "custom_objects" in vars(flow):
        flow.custom_objects.api_client.close()


def test_helm_install_runs_the_operator_as_a_pod(flow: Flow) -> None:
    # The README's line, with scripts/helm for helm (no helm binary on the local path).
    readme = (ROOT / "README.md").read_text()
    line = (
        f"helm install {RELEASE} charts/dpserve-operator "
        f"--namespace {OPERATOR_NS} --create-namespace"
    )
    assert line in readme, "the README's helm install line changed"
    output = flow.helm(*line.split()[1:])
    assert "NOTES:" in output and "kubectl apply -f examples/inference.yaml" in output, output
    (flow.workdir / "notes.txt").write_text(output.split("NOTES:", 1)[1])
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
    # A fresh node shows no SystemOOM events the kubelet replayed from the kernel log of
    # earlier runs (scripts/local-cluster.sh drops them).
    replayed = flow.kubectl.json(
        "get", "events", "-n", "default", "--field-selector", "reason=SystemOOM"
    )["items"]
    assert not replayed, [e.get("message") for e in replayed]


def test_apply_the_example_and_the_engines_register(flow: Flow) -> None:
    flow.kubectl.create_namespace(NAMESPACE)
    # As published: the real runtime image and SmolLM2, the example's own resources.
    started = time.monotonic()
    flow.kubectl("apply", "-f", str(EXAMPLE), "-n", NAMESPACE)
    flow.wait_registered(2, "both engines registered after kubectl apply")
    TIMINGS["kubectl apply -f examples/inference.yaml -> 2 engines registered"] = (
        time.monotonic() - started
    )

    # READY is the engine pods' readiness (status.readyReplicas), which the kubelet's probe
    # may report a moment after both engines registered (CI once read "demo 2 1 2 Ready").
    def columns() -> list[str]:
        return flow.kubectl("get", "infd", "-n", NAMESPACE).stdout.splitlines()[1].split()[:5]

    wait_for(
        lambda: columns() == [NAME, "2", "2", "2", "Ready"],
        30,
        "kubectl get infd shows both engines ready",
        interval=0.5,
        diagnostics=flow.diagnostics,
    )
    header = flow.kubectl("get", "infd", "-n", NAMESPACE).stdout.splitlines()[0]
    assert header.split()[:5] == ["NAME", "DESIRED", "READY", "REGISTERED", "PHASE"]
    # Engines dial the coordinator Service by its cluster DNS name.
    statefulset = flow.get("get", "statefulset", f"{NAME}-engine")
    command = statefulset["spec"]["template"]["spec"]["containers"][0]["command"]
    assert f"tcp://{NAME}-coordinator.{NAMESPACE}.svc:{ZMQ_PORT}" in command
    logs = flow.kubectl("logs", f"{NAME}-engine-0", "-n", NAMESPACE).stdout
    assert logs.count("registered with coordinator") == 1, logs[-2000:]
    # No pod converts the model: it is in the image, and the coordinator reads only its
    # tokenizer (the engine log names the image's directory).
    assert "converting" not in logs and "/opt/models/smollm2-135m-instruct" in logs, logs[-2000:]
    # The image's prebuilt CPU kernels (built by scripts/build-images.sh where it found a
    # compiler) run the engine's layers: the image itself has no compiler.
    if shutil.which("g++"):
        assert "layer_kernels cpu" in logs, logs[-2000:]
    coordinator_pod = next(
        p for p in pod_names(flow.kubectl, NAMESPACE) if p.startswith(f"{NAME}-coordinator")
    )
    coordinator_logs = flow.kubectl("logs", coordinator_pod, "-n", NAMESPACE).stdout
    assert "converting" not in coordinator_logs, coordinator_logs[-2000:]
    # The operator starts it with --data-parallel-size 0: it says what that means.
    assert "serving now; engines join as they register" in coordinator_logs, coordinator_logs[:2000]
    assert "waiting for 0 engine(s)" not in coordinator_logs


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
    limit = str(example()["spec"]["engine"]["resources"]["limits"]["cpu"])
    assert (os.cpu_count() or 1) > int(limit), "needs a node with more CPUs than the limit"
    threads = flow.kubectl(
        "exec", f"{NAME}-engine-0", "-n", NAMESPACE, "--",
        "python", "-c", "import torch; print(torch.get_num_threads())",
    ).stdout.strip()  # fmt: skip
    assert threads == limit, threads


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
        notes_output = run_notes_commands(flow, http)
    reply = json.loads(notes_output)
    assert reply["choices"][0]["message"]["content"].strip(), reply


def run_notes_commands(flow: Flow, local_http_port: int) -> str:
    """The chart NOTES' "Talk to it" commands (printed by the install), typed as shown, in
    a shell whose kubectl defaults to the example's namespace; only the local port differs
    (the test's port-forward picked a free one)."""
    notes = (flow.workdir / "notes.txt").read_text()
    block = notes.split("Talk to it", 1)[1].split("\n\n")[1]
    commands = "\n".join(line for line in block.splitlines() if "port-forward" not in line)
    commands = commands.replace("127.0.0.1:8000", f"127.0.0.1:{local_http_port}")
    assert "Authorization: Bearer" in commands, commands
    result = subprocess.run(
        ["bash", "-ec", commands],
        cwd=flow.workdir,
        env={"PATH": f"{flow.shim(NAMESPACE)}:/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, (commands, result)
    return result.stdout


def test_patch_and_scale_change_the_registered_engines(flow: Flow) -> None:
    # Each step: the status phases and the events seen are printed; a scale asked for is
    # never Degraded nor a Warning, and Ready follows the last registration within a second.
    with ScaleStep(flow, "kubectl patch 2 -> 3") as step:
        patch = '{"spec": {"dataParallelSize": 3}}'
        flow.kubectl("patch", "infd", NAME, "-n", NAMESPACE, "--type=merge", "-p", patch)
        TIMINGS["kubectl patch 2 -> 3: new engine registered"] = flow.wait_registered(
            3, "the third engine registered after kubectl patch"
        )
        step.registered_at = record_start_timeline(
            flow, f"{NAME}-engine-2", "kubectl patch 2 -> 3", step.commanded_at
        )
    with ScaleStep(flow, "kubectl scale 3 -> 2"):
        flow.kubectl("scale", f"infd/{NAME}", "--replicas=2", "-n", NAMESPACE)
        flow.wait_registered(2, "two engines registered after kubectl scale")
    # From a steady two: the StatefulSet recreates engine-2 only once the old pod is gone.
    wait_for(
        lambda: flow.kubectl("get", "pod", f"{NAME}-engine-2", "-n", NAMESPACE,
                             check=False).returncode != 0,
        REGISTER_TIMEOUT,
        "the third engine's pod gone after scaling down",
        diagnostics=flow.diagnostics,
    )  # fmt: skip
    with ScaleStep(flow, "kubectl scale 2 -> 3") as step:
        flow.kubectl("scale", f"infd/{NAME}", "--replicas=3", "-n", NAMESPACE)
        TIMINGS["kubectl scale 2 -> 3: new engine registered"] = flow.wait_registered(
            3, "the third engine registered again after kubectl scale"
        )
        step.registered_at = record_start_timeline(
            flow, f"{NAME}-engine-2", "kubectl scale 2 -> 3", step.commanded_at
        )
    with ScaleStep(flow, "kubectl scale 3 -> 2 (again)"):
        flow.kubectl("scale", f"infd/{NAME}", "--replicas=2", "-n", NAMESPACE)
        flow.wait_registered(2, "two engines after scaling back")


# Seconds from an engine's "registered" log line to the operator's status saying Ready.
READY_AFTER_REGISTERED = 1.0


class ScaleStep:
    """Records, through a watch, every status the operator writes while a scale runs (with
    the moment it arrived) and the events posted on the deployment meanwhile; on exit,
    prints them (TIMELINES) and asserts the step was reported truthfully: never Degraded,
    no Warning event, and, where ``registered_at`` (the new engine's own "registered" log
    line) is set, Ready within READY_AFTER_REGISTERED of it."""

    def __init__(self, flow: Flow, name: str) -> None:
        self.flow = flow
        self.name = name
        self.records: list[tuple[float, tuple[Any, ...]]] = []
        self.registered_at: float | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.commanded_at = 0.0
        # The deployment's generation when the command was given: a Ready written for it (or
        # one written before and delivered late by the watch) is not the command's Ready.
        self.generation_before: Any = None
        self._events_before: set[tuple[str, int]] = set()

    def __enter__(self) -> ScaleStep:
        from kubernetes import watch

        self._events_before = {key for key, _ in self._events()}
        listing = self.flow.custom_objects.list_namespaced_custom_object
        ready = threading.Event()

        def run() -> None:
            # Short server-side watches, resumed from the last version seen: the thread
            # notices the stop within a couple of seconds, and no connection stays blocked.
            version: str | None = None
            try:
                while not self._stopped.is_set():
                    resume = {"resource_version": version} if version else {}
                    for event in watch.Watch().stream(
                        listing, GROUP, VERSION, NAMESPACE, PLURAL,
                        field_selector=f"metadata.name={NAME}", timeout_seconds=2, **resume,
                    ):  # fmt: skip
                        version = event["object"]["metadata"]["resourceVersion"]
                        self._record(time.time(), event["object"])
                        ready.set()
            except Exception as error:
                self.records.append((time.time(), ("watch failed", repr(error))))
            finally:
                ready.set()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)  # the watch's initial ADDED: the status before the command
        self.generation_before = self.records[-1][1][0] if self.records else None
        self.commanded_at = time.time()
        return self

    def _record(self, at: float, infd: JSON) -> None:
        status = infd.get("status") or {}
        conditions = {c["type"]: c for c in status.get("conditions") or []}
        state = (
            infd["metadata"].get("generation"),
            infd.get("spec", {}).get("dataParallelSize"),
            status.get("phase"),
            status.get("registeredEngines"),
            status.get("readyReplicas"),
            status.get("replicas"),
            next((c["reason"] for c in conditions.values() if c.get("status") == "True"), ""),
            status.get("observedGeneration"),
        )
        if not self.records or self.records[-1][1] != state:
            self.records.append((at, state))

    def _events(self) -> list[tuple[tuple[str, int], JSON]]:
        involved = f"involvedObject.kind=InferenceDeployment,involvedObject.name={NAME}"
        items = self.flow.kubectl.json(
            "get", "events", "-n", NAMESPACE, "--field-selector", involved
        )["items"]
        # In the order they were written (a resourceVersion is etcd's revision).
        items.sort(key=lambda e: int(e["metadata"].get("resourceVersion") or 0))
        return [((e["metadata"]["uid"], int(e.get("count") or 1)), e) for e in items]

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        time.sleep(1.0)  # the last status write's events are posted just after it
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        events = [e for key, e in self._events() if key not in self._events_before]
        lines = [self._line(at, state) for at, state in self.records]
        lines += [f"event {e.get('type')} {e.get('reason')}: {e.get('message')}" for e in events]
        # The command's Ready: written for the generation it made (observed == generation), with
        # every engine it asks for registered.
        ready_at = next(
            (at for at, state in self.records
             if at >= self.commanded_at and state[0] != self.generation_before
             and state[7] == state[0] and state[2] == "Ready" and state[3] == state[1]),
            None,
        )  # fmt: skip
        if self.registered_at is not None and ready_at is not None:
            lines.append(
                f"the new engine's 'registered' log line -> status Ready: "
                f"{ready_at - self.registered_at:+.2f} s"
            )
            TIMINGS[f"{self.name}: engine registered -> status Ready"] = (
                ready_at - self.registered_at
            )
        if ready_at is not None:
            TIMINGS[f"{self.name}: command -> status Ready"] = ready_at - self.commanded_at
        lines += [f"operator: {line}" for line in self._operator_log()]
        TIMELINES[self.name] = lines
        if exc_type is not None:
            return  # the step's own failure says more
        phases = [state[2] for at, state in self.records if at >= self.commanded_at]
        if ready_at is not None:
            after = [state[2] for at, state in self.records if at > ready_at]
            assert all(phase == "Ready" for phase in after), (
                f"{self.name}: Ready, then {after}:\n" + "\n".join(lines)
            )
        warnings = [e for e in events if e.get("type") == "Warning"]
        report = "\n".join(lines)
        assert "Degraded" not in phases, f"{self.name} reported Degraded:\n{report}"
        assert not warnings, f"{self.name} posted a Warning:\n{report}"
        assert ready_at is not None, f"{self.name}: no Ready status seen:\n{report}"
        if self.registered_at is not None:
            late = ready_at - self.registered_at
            assert late <= READY_AFTER_REGISTERED, (
                f"{self.name}: Ready {late:.2f} s after the engine registered:\n{report}"
            )

    def _operator_log(self) -> list[str]:
        """The operator's own lines during the step (kopf's handler and retry messages)."""
        since = max(1, int(time.time() - self.commanded_at) + 2)
        found = self.flow.kubectl(
            "logs", f"deployment/{RELEASE}", "-n", OPERATOR_NS, f"--since={since}s", check=False
        ).stdout.splitlines()
        return [line[:300] for line in found][-30:]

    def _line(self, at: float, state: tuple[Any, ...]) -> str:
        if len(state) != 8:
            return f"{at - self.commanded_at:+7.2f} s  {state}"
        generation, desired, phase, registered, ready, replicas, reason, observed = state
        return (
            f"{at - self.commanded_at:+7.2f} s  generation {generation} (observed {observed})  "
            f"{phase} ({reason})  desired {desired} registered {registered} ready {ready} "
            f"replicas {replicas}"
        )


# The engine's own start-up lines, in the order it writes them (``kubectl logs --timestamps``
# times each): (the stage that ends with the line, words of the line). The optional ones may
# change with the engine's code: a missing line leaves its stage out of the split.
ENGINE_STAGES = (
    # dpserve.cli.engine: torch (and dpserve's engine modules) imported, threads set.
    ("torch imported", "torch thread(s)", True),
    # dpserve.engine.layers.linear, when the first layer is converted: transformers has read
    # the weights (with the dense/oneDNN probe where no memory limit is set).
    ("weights loaded", "decode steps", False),
    # dpserve.engine.model_runner: every layer converted and prepacked, CPU kernels, KV pool.
    ("model loaded", "): backend ", True),
    ("registered", "registered with coordinator", True),
)


def record_start_timeline(flow: Flow, pod: str, step: str, commanded_at: float) -> float:
    """Where a new engine's start went, so that a slow step says which stage was slow: the
    command -> the pod's creation (the operator, the StatefulSet controller) -> its container
    running (scheduling, sandbox, container start) -> the engine's "registered" log line,
    split by the engine's own lines (ENGINE_STAGES: imports, reading the weights, converting
    the layers, the handshake) -> the operator's status reporting it (what
    ``wait_registered`` waits for) and the pod's readiness probe seeing it. Kubernetes
    timestamps have one-second resolution, the engine's log lines do not.
    Returns when the engine logged "registered" (seconds since the epoch)."""
    seen_at = time.time()

    def pod_ready() -> JSON | None:
        found: JSON = flow.get("get", "pod", pod)
        conditions = {c["type"]: c for c in found["status"].get("conditions") or []}
        return found if conditions.get("Ready", {}).get("status") == "True" else None

    # The status says Ready once the engine registered, the pod a readiness probe later.
    status = wait_for(pod_ready, 60, f"{pod} Ready", interval=0.5, diagnostics=flow.diagnostics)
    created = parse_time(status["metadata"]["creationTimestamp"])
    running = parse_time(status["status"]["containerStatuses"][0]["state"]["running"]["startedAt"])
    ready_condition = next(c for c in status["status"]["conditions"] if c["type"] == "Ready")
    pod_ready_at = parse_time(ready_condition["lastTransitionTime"])
    logs = flow.kubectl("logs", pod, "-n", NAMESPACE, "--timestamps").stdout.splitlines()

    def logged(words: str) -> float | None:
        line = next((line for line in logs if words in line), None)
        return None if line is None else parse_time(line.split(" ", 1)[0])

    stages = {name: logged(words) for name, words, _ in ENGINE_STAGES}
    missing = [name for name, _, required in ENGINE_STAGES if required and stages[name] is None]
    assert not missing, (missing, logs[-40:])
    threads, loaded, registered = (
        stages[name] or 0.0 for name in ("torch imported", "model loaded", "registered")
    )
    TIMINGS[f"{step}: command -> pod created"] = created - commanded_at
    TIMINGS[f"{step}: pod created -> container running"] = running - created
    TIMINGS[f"{step}: container running -> engine registered"] = registered - running
    TIMINGS[f"{step}: ... running -> torch imported"] = threads - running
    TIMINGS[f"{step}: ... torch imported -> model loaded"] = loaded - threads
    weights = stages["weights loaded"]
    if weights is not None:
        TIMINGS[f"{step}: ... ... torch imported -> weights read (first layer converted)"] = (
            weights - threads
        )
        TIMINGS[f"{step}: ... ... weights read -> every layer converted, kernels, KV pool"] = (
            loaded - weights
        )
    TIMINGS[f"{step}: ... model loaded -> registered"] = registered - loaded
    TIMINGS[f"{step}: engine registered -> status shows it"] = seen_at - registered
    TIMINGS[f"{step}: engine registered -> pod Ready (readiness probe; 1 s resolution)"] = (
        pod_ready_at - registered
    )
    return registered


def parse_time(stamp: str) -> float:
    """Seconds since the epoch of an RFC 3339 time as the API server and `kubectl logs
    --timestamps` write it (the latter with nanoseconds, which `fromisoformat` cannot read)."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    moment = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.UTC)
    return moment.timestamp() + (float(f"0.{fraction}") if fraction else 0.0)


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
    token = (credentials_directory(flow.workdir) / "http-api-token").read_text().strip()
    victim = f"{NAME}-engine-1"
    old_uid = flow.get("get", "pod", victim)["metadata"]["uid"]
    target = f"svc/{NAME}-coordinator"
    with PortForward(flow.kubectl, NAMESPACE, target, [HTTP_PORT]) as forward:
        send = completion(forward.local_ports[HTTP_PORT], token)
        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = [pool.submit(send, i) for i in range(64)]
            time.sleep(1.0)
            with follow_logs(flow, victim) as victim_lines:
                deleted_at = time.time()
                flow.kubectl("delete", "pod", victim, "-n", NAMESPACE, "--wait=false")

                def old_pod_gone() -> bool:
                    found = flow.kubectl(
                        "get",
                        "pod",
                        victim,
                        "-n",
                        NAMESPACE,
                        "-o",
                        "jsonpath={.metadata.uid}",
                        check=False,
                    )
                    return found.returncode != 0 or found.stdout.strip() != old_uid

                # The engine hands its requests over and exits at once, instead of draining
                # them and waiting its grace period out: its own log says so within seconds.
                wait_for(
                    lambda: any("handed" in line for line in victim_lines),
                    HAND_OFF_BOUND,
                    f"{victim} handing its requests over after kubectl delete",
                    diagnostics=lambda: "".join(victim_lines) + flow.diagnostics(),
                )
                # Then the kubelet removes the pod (its part: ~8 s on this node). Bounded by
                # the grace period plus a margin, so a slow kubelet shows in the timings
                # instead of failing the run.
                wait_for(
                    old_pod_gone,
                    example()["spec"]["engine"]["terminationGracePeriodSeconds"] + 30,
                    f"{victim} gone after kubectl delete",
                    interval=0.2,
                    diagnostics=lambda: "".join(victim_lines) + flow.diagnostics(),
                )
                gone_at = time.time()
            results = [future.result(timeout=300) for future in futures]
    # Where the leave went, from the victim's own log lines (SIGTERM: "leaving with N").
    for stage, words in (("SIGTERM seen", "leaving with"), ("handed off", "handed")):
        line = next(line for line in victim_lines if words in line)
        TIMINGS[f"engine pod deleted -> {stage}"] = parse_time(line.split(" ")[0]) - deleted_at
    failures = [result for result in results if result[0] != 200]
    assert not failures, failures[:5]

    def replaced() -> bool:
        pod = flow.get("get", "pod", victim)
        conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}
        return pod["metadata"]["uid"] != old_uid and conditions.get("Ready") == "True"

    # The engine pod is Ready exactly when its engine registered (the ready-file probe).
    wait_for(replaced, REGISTER_TIMEOUT, f"a new {victim} registered", diagnostics=flow.diagnostics)
    TIMINGS["engine pod deleted -> replacement registered"] = time.time() - deleted_at
    TIMINGS["engine pod deleted -> old pod gone (hand-off, exit)"] = gone_at - deleted_at
    flow.wait_registered(2, "both engines registered after the replacement")
    record_peak_memory(flow)


@contextlib.contextmanager
def follow_logs(flow: Flow, pod: str) -> Iterator[list[str]]:
    """``kubectl logs -f --timestamps`` of ``pod`` while the block runs: its lines (including
    the last ones of a pod that is deleted meanwhile)."""
    lines: list[str] = []
    process = subprocess.Popen(
        [str(flow.kubectl.binary), f"--kubeconfig={flow.kubectl.kubeconfig}", "logs", "-f",
         pod, "-n", NAMESPACE, "--timestamps", "--tail=5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(process.stdout or ()), daemon=True)
    reader.start()
    try:
        yield lines
    finally:
        time.sleep(0.5)  # its last lines
        process.terminate()
        process.wait(timeout=10)
        reader.join(timeout=10)


def record_peak_memory(flow: Flow) -> None:
    """The pods' peak memory after the burst, as the example's resources were measured: the
    sum of every process's peak RSS (VmHWM) in the container, and the container cgroup's
    peak usage (page cache included). Each must fit the example's limit."""
    spec = example()["spec"]
    probe = (
        "cat /proc/[0-9]*/status 2>/dev/null | awk '/^VmHWM/ {kb += $2} END {print kb}'; "
        "cat /sys/fs/cgroup/memory/memory.max_usage_in_bytes"
    )
    for pod in pod_names(flow.kubectl, NAMESPACE):
        component = "coordinator" if "coordinator" in pod else "engine"
        output = flow.kubectl("exec", pod, "-n", NAMESPACE, "--", "sh", "-c", probe).stdout
        rss_kib, cgroup_bytes = (int(value) for value in output.split())
        limit = parse_bytes(spec[component]["resources"]["limits"]["memory"])
        TIMINGS[f"peak memory {pod}: RSS MiB"] = rss_kib / 1024
        TIMINGS[f"peak memory {pod}: cgroup MiB"] = cgroup_bytes / 2**20
        assert rss_kib * 1024 < limit, (pod, rss_kib, limit)


def parse_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * factor)
    return int(quantity)


def engine_memory(quantity: str) -> JSON:
    return {"engine": {"resources": {"requests": {"memory": quantity},
                                     "limits": {"memory": quantity}}}}  # fmt: skip


# The fault cases share the node with the running example (two engines at 500m each, on a
# 2-core CI node): they ask for almost no CPU, so the scheduler judges only the fault under
# test (one CI run's OOM case was Unschedulable for want of CPU instead).
FAULT_CASE_CPU = {
    "engine": {"resources": {"requests": {"cpu": "10m"}}},
    "coordinator": {"resources": {"requests": {"cpu": "10m"}}},
}

FAULTS = {
    # name: (what to change in the published example, the Degraded reason it must give)
    "oom": (engine_memory("48Mi"), "OOMKilled"),  # the engine cannot even import torch
    "pull": ({"image": "localhost/dpserve/missing:0.1.0"}, "ImagePullBackOff"),
    "unschedulable": (engine_memory("4000Gi"), "Unschedulable"),
}


def merged(base: JSON, override: JSON) -> JSON:
    result = dict(base)
    for key, value in override.items():
        result[key] = merged(base[key], value) if isinstance(value, dict) else value
    return result


def test_a_child_that_cannot_run_turns_the_status_degraded_and_says_why(flow: Flow) -> None:
    flow.kubectl.create_namespace(FAULTS_NAMESPACE)
    manifests = []
    for name, (change, _reason) in FAULTS.items():
        faulty = example()
        faulty["metadata"]["name"] = name
        small = merged(faulty["spec"], FAULT_CASE_CPU)
        faulty["spec"] = merged(small, {**change, "dataParallelSize": 1})
        manifests.append(faulty)
    manifest = flow.workdir / "faults.yaml"
    manifest.write_text(yaml.safe_dump_all(manifests))
    flow.kubectl("apply", "-f", str(manifest), "-n", FAULTS_NAMESPACE)

    try:
        for name, (_change, reason) in FAULTS.items():
            expect_degraded(flow, name, reason)
    finally:
        # Wait for it, pass or fail: the operator must still be there to remove the faulty
        # deployments' finalizers, or deleting the CRD after `helm uninstall` would wait forever.
        flow.kubectl(
            "delete", "namespace", FAULTS_NAMESPACE, "--timeout=180s", timeout=200
        )  # fmt: skip


def expect_degraded(flow: Flow, name: str, reason: str) -> None:
    """The deployment `name` says Degraded with `reason`, in its condition, its Warning
    event and its `kubectl get` row."""

    def degraded() -> JSON | None:
        status = flow.kubectl.json("get", "infd", name, "-n", FAULTS_NAMESPACE).get("status")
        conditions = {c["type"]: c for c in (status or {}).get("conditions") or []}
        condition = conditions.get("Degraded") or {}
        if status and status.get("phase") == "Degraded" and condition.get("reason") == reason:
            return condition
        return None

    def diagnostics() -> str:
        described = flow.kubectl("describe", "infd", "-n", FAULTS_NAMESPACE, check=False).stdout
        pods = flow.kubectl("get", "pods", "-n", FAULTS_NAMESPACE, check=False).stdout
        return f"{pods}\n{described}"

    condition = wait_for(degraded, 180, f"{name}: Degraded {reason}", diagnostics=diagnostics)
    assert condition["status"] == "True"
    assert f"pod {name}-" in condition["message"], condition
    involved = f"involvedObject.kind=InferenceDeployment,involvedObject.name={name}"
    events = flow.kubectl.json(
        "get", "events", "-n", FAULTS_NAMESPACE, "--field-selector", involved
    )["items"]
    said = [e for e in events if e.get("reason") == reason and e.get("type") == "Warning"]
    assert said and f"pod {name}-" in said[0]["message"], events
    row = flow.kubectl("get", "infd", name, "-n", FAULTS_NAMESPACE).stdout.splitlines()[1]
    assert "Degraded" in row.split(), row


def test_delete_infd_garbage_collects_then_helm_uninstall(flow: Flow) -> None:
    flow.kubectl("delete", "infd", NAME, "-n", NAMESPACE, "--timeout=120s", timeout=140)

    def children_gone() -> bool:
        for kind, name, _ in CHILDREN:
            if flow.kubectl("get", kind, name, "-n", NAMESPACE, check=False).returncode == 0:
                return False
        return not pod_names(flow.kubectl, NAMESPACE)

    wait_for(children_gone, 120, "every child of demo deleted", diagnostics=flow.diagnostics)
    # The operator's log holds what it did, not the kubelet's liveness probes (one every few
    # seconds for the whole run).
    operator_pod = next(iter(pod_names(flow.kubectl, OPERATOR_NS)))
    operator_log = flow.kubectl("logs", operator_pod, "-n", OPERATOR_NS).stdout
    assert "/healthz" not in operator_log, operator_log[-2000:]
    # helm uninstall dpserve-operator --namespace dpserve-system
    flow.helm("uninstall", RELEASE, "--namespace", OPERATOR_NS)
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
    # Helm leaves the namespace --create-namespace made (the docs say so): delete it too.
    assert flow.kubectl("get", "namespace", OPERATOR_NS, check=False).returncode == 0
    flow.kubectl("delete", "namespace", OPERATOR_NS, "--timeout=120s", timeout=140)
