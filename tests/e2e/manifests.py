"""Builders of the Kubernetes objects the e2e tests apply.

What every such object repeats (apiVersion and kind, a workload's selector equal to its pod
template's labels, the image the node agent runs as a local Python) is written here once; what
a test is about (commands, probes, grace periods, restart policies) stays in the test, as
arguments.
"""

from __future__ import annotations

from typing import Any

from dpserve_operator import crd

JSON = dict[str, Any]

# The node agent runs a container of this image as a local Python process.
PYTHON_IMAGE = "python:3.11"


def container(name: str, command: list[str], *, image: str = PYTHON_IMAGE, **fields: Any) -> JSON:
    """A container; ``fields`` are its other fields as the API spells them (``readinessProbe``)."""
    return {"name": name, "image": image, "command": command, **fields}


def pod(name: str, *containers: JSON, **spec: Any) -> JSON:
    """A bare Pod; ``spec`` holds its other pod-spec fields (``restartPolicy``, ...)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {**spec, "containers": list(containers)},
    }


def _workload(kind: str, name: str, labels: dict[str, str], pod_spec: JSON, **spec: Any) -> JSON:
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": name},
        "spec": {
            **spec,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def deployment(
    name: str, labels: dict[str, str], *containers: JSON, replicas: int = 1, **pod_spec: Any
) -> JSON:
    """A Deployment whose pods carry (and are selected by) ``labels``."""
    return _workload(
        "Deployment",
        name,
        labels,
        {**pod_spec, "containers": list(containers)},
        replicas=replicas,
    )


def stateful_set(
    name: str,
    labels: dict[str, str],
    *containers: JSON,
    service_name: str,
    replicas: int,
    parallel: bool = False,
    **pod_spec: Any,
) -> JSON:
    """A StatefulSet whose pods carry (and are selected by) ``labels``; ``parallel`` starts
    and stops its pods all at once (podManagementPolicy Parallel) instead of one by one."""
    policy = {"podManagementPolicy": "Parallel"} if parallel else {}
    return _workload(
        "StatefulSet",
        name,
        labels,
        {**pod_spec, "containers": list(containers)},
        serviceName=service_name,
        replicas=replicas,
        **policy,
    )


def service(name: str, selector: dict[str, str], ports: list[JSON], **spec: Any) -> JSON:
    """A Service in front of the pods ``selector`` picks (``clusterIP="None"``: headless)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {**spec, "selector": selector, "ports": ports},
    }


def inference_deployment(name: str, spec: JSON) -> JSON:
    """An InferenceDeployment, its apiVersion and kind from the operator's CRD."""
    return {
        "apiVersion": crd.API_VERSION,
        "kind": crd.KIND,
        "metadata": {"name": name},
        "spec": spec,
    }
