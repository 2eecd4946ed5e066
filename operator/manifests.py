"""Pure functions from a validated ``DeploymentSpec`` to the Kubernetes objects it needs.

No I/O and no owner references here (the handlers adopt the objects), so every manifest can
be unit-tested and schema-validated without a server.

Objects for an InferenceDeployment ``<name>`` in ``<namespace>``:

- Deployment ``<name>-coordinator`` (1 replica, Recreate: two coordinators would split the
  engines between them) running ``dpserve coordinator``;
- Service ``<name>-coordinator`` (ports ``zmq`` and ``http``, publishNotReadyAddresses: the
  coordinator only turns ready once an engine registered, and engines register through it);
- StatefulSet ``<name>-engine`` (Parallel) running ``dpserve engine --rank auto``, the rank
  being the pod ordinal, plus its headless Service ``<name>-engine``;
- PodDisruptionBudget ``<name>-engine`` (at most one engine evicted at a time);
- NetworkPolicies ``<name>-coordinator`` (engines → ZMQ; ``allowedClients`` → ZMQ and HTTP)
  and ``<name>-engine`` (engines listen on nothing: deny all ingress).
"""

from __future__ import annotations

from typing import Any

from .spec import CACHE_DIR, SCRATCH_DIR, DeploymentSpec, thaw

NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
APP_NAME = "dpserve"
MANAGER = "dpserve-operator"
COORDINATOR = "coordinator"
ENGINE = "engine"

# The runtime images run as this user (images/Dockerfile.runtime-*).
RUNTIME_UID = 10001
HOME_DIR = "/home/dpserve"

ZMQ_PORT_NAME = "zmq"
HTTP_PORT_NAME = "http"

PDB_API_VERSIONS = ("policy/v1", "policy/v1beta1")


# --------------------------------------------------------------------------- names & labels


def coordinator_name(name: str) -> str:
    """Name of the coordinator Deployment and of its Service."""
    return f"{name}-{COORDINATOR}"


def engine_name(name: str) -> str:
    """Name of the engine StatefulSet, its headless Service, PDB and NetworkPolicy."""
    return f"{name}-{ENGINE}"


def coordinator_address(name: str, namespace: str, zmq_port: int) -> str:
    """The ZMQ address engines dial: the coordinator Service's cluster DNS name."""
    return f"tcp://{coordinator_name(name)}.{namespace}.svc:{zmq_port}"


def selector_labels(name: str, component: str) -> dict[str, str]:
    """Labels that select one component's pods (immutable once a workload exists)."""
    return {NAME_LABEL: APP_NAME, INSTANCE_LABEL: name, COMPONENT_LABEL: component}


def object_labels(name: str, component: str) -> dict[str, str]:
    return {**selector_labels(name, component), MANAGED_BY_LABEL: MANAGER}


def engine_selector(name: str) -> str:
    """The engine pods' label selector as a string (status.selector, for the scale subresource)."""
    labels = sorted(selector_labels(name, ENGINE).items())
    return ",".join(f"{key}={value}" for key, value in labels)


def _metadata(name: str, namespace: str, object_name: str, component: str) -> dict[str, Any]:
    return {"name": object_name, "namespace": namespace, "labels": object_labels(name, component)}


# --------------------------------------------------------------------------- commands


def coordinator_command(spec: DeploymentSpec) -> list[str]:
    # --data-parallel-size 0: do not wait for engines at start; they come and go with scaling.
    # --insecure: plain ZMQ on the pod network, fenced by the NetworkPolicy; CURVE keys from a
    # per-deployment Secret are the planned replacement (docs/security.md).
    return [
        "dpserve", "coordinator",
        "--host", "0.0.0.0", "--insecure",
        "--port", str(spec.coordinator.zmq_port),
        "--http-port", str(spec.coordinator.http_port),
        "--data-parallel-size", "0",
        "--tokenizer", spec.model,
        "--routing", spec.coordinator.routing,
    ]  # fmt: skip


def engine_command(name: str, namespace: str, spec: DeploymentSpec) -> list[str]:
    return [
        "dpserve", "engine",
        "--coordinator", coordinator_address(name, namespace, spec.coordinator.zmq_port),
        "--rank", "auto",
        "--model", spec.model,
        "--max-batch-size", str(spec.engine.max_batch_size),
        "--dtype", spec.engine.dtype,
        "--device", spec.engine.device,
    ]  # fmt: skip


# --------------------------------------------------------------------------- pod pieces


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUNTIME_UID,
        "runAsGroup": RUNTIME_UID,
        # Makes a mounted model PVC readable by the non-root user.
        "fsGroup": RUNTIME_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUNTIME_UID,
        "runAsGroup": RUNTIME_UID,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _cache_env() -> list[dict[str, str]]:
    # The root filesystem is read-only: point every cache at the writable emptyDir.
    return [
        {"name": "HOME", "value": HOME_DIR},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "DPSERVE_CACHE", "value": f"{CACHE_DIR}/dpserve"},
        {"name": "TMPDIR", "value": SCRATCH_DIR},
    ]


def _volumes(spec: DeploymentSpec) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
    ]
    if spec.model_volume is not None:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {
                    "claimName": spec.model_volume.claim_name,
                    "readOnly": spec.model_volume.read_only,
                },
            }
        )
    return volumes


def _volume_mounts(spec: DeploymentSpec) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": SCRATCH_DIR},
        {"name": "cache", "mountPath": CACHE_DIR},
    ]
    if spec.model_volume is not None:
        mounts.append(
            {
                "name": "model",
                "mountPath": spec.model_volume.mount_path,
                "readOnly": spec.model_volume.read_only,
            }
        )
    return mounts


def _merge_env(operator_env: list[dict[str, Any]], user_env: list[dict[str, Any]]) -> list[dict]:
    """The operator's variables, minus those the user redefines, then the user's."""
    user_names = {variable["name"] for variable in user_env}
    return [v for v in operator_env if v["name"] not in user_names] + user_env


def _pod_template(
    name: str,
    component: str,
    spec: DeploymentSpec,
    container: dict[str, Any],
    termination_grace_period_seconds: int,
) -> dict[str, Any]:
    labels = {**spec.pod_template.labels, **selector_labels(name, component)}
    metadata: dict[str, Any] = {"labels": labels}
    if spec.pod_template.annotations:
        metadata["annotations"] = dict(spec.pod_template.annotations)
    if spec.image_pull_policy is not None:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": _volumes(spec),
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": termination_grace_period_seconds,
        # The Service env vars (<NAME>_COORDINATOR_PORT=tcp://...) are noise to dpserve.
        "enableServiceLinks": False,
    }
    if spec.service_account_name is not None:
        pod_spec["serviceAccountName"] = spec.service_account_name
    else:
        # dpserve pods never call the Kubernetes API: do not hand them the default token.
        pod_spec["automountServiceAccountToken"] = False
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = thaw(spec.tolerations)
    if spec.affinity is not None:
        pod_spec["affinity"] = thaw(spec.affinity)
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": secret} for secret in spec.image_pull_secrets]
    return {"metadata": metadata, "spec": pod_spec}


# --------------------------------------------------------------------------- coordinator


def coordinator_deployment(name: str, namespace: str, spec: DeploymentSpec) -> dict[str, Any]:
    zmq_port, http_port = spec.coordinator.zmq_port, spec.coordinator.http_port
    container: dict[str, Any] = {
        "name": COORDINATOR,
        "image": spec.image,
        "command": coordinator_command(spec),
        "ports": [
            {"name": ZMQ_PORT_NAME, "containerPort": zmq_port, "protocol": "TCP"},
            {"name": HTTP_PORT_NAME, "containerPort": http_port, "protocol": "TCP"},
        ],
        "env": _cache_env(),
        "resources": spec.coordinator.resources.to_manifest(),
        # Loading the tokenizer (maybe from a hub) precedes serving: give it up to 5 minutes
        # before the liveness probe may restart the container.
        "startupProbe": {
            "httpGet": {"path": "/livez", "port": HTTP_PORT_NAME},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 60,
        },
        "livenessProbe": {
            "httpGet": {"path": "/livez", "port": HTTP_PORT_NAME},
            "periodSeconds": 10,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
        # /health answers 503 until an engine registered: the Service keeps the pod's address
        # anyway (publishNotReadyAddresses), readiness only tells clients it can serve.
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": HTTP_PORT_NAME},
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 2,
        },
        "volumeMounts": _volume_mounts(spec),
        "securityContext": container_security_context(),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(name, namespace, coordinator_name(name), COORDINATOR),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector_labels(name, COORDINATOR)},
            "template": _pod_template(
                name, COORDINATOR, spec, container, termination_grace_period_seconds=30
            ),
        },
    }


def coordinator_service(name: str, namespace: str, spec: DeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, namespace, coordinator_name(name), COORDINATOR),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name, COORDINATOR),
            # Engines must reach the coordinator before it is ready: it turns ready only once
            # the first engine has registered through this very Service.
            "publishNotReadyAddresses": True,
            "ports": [
                {
                    "name": ZMQ_PORT_NAME,
                    "port": spec.coordinator.zmq_port,
                    "targetPort": ZMQ_PORT_NAME,
                    "protocol": "TCP",
                },
                {
                    "name": HTTP_PORT_NAME,
                    "port": spec.coordinator.http_port,
                    "targetPort": HTTP_PORT_NAME,
                    "protocol": "TCP",
                },
            ],
        },
    }


# --------------------------------------------------------------------------- engines


def engine_statefulset(name: str, namespace: str, spec: DeploymentSpec) -> dict[str, Any]:
    # `--rank auto` reads the pod ordinal from POD_NAME (`<name>-engine-<ordinal>`).
    pod_name = {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    env = _merge_env([pod_name, *_cache_env()], thaw(spec.engine.env))
    container: dict[str, Any] = {
        "name": ENGINE,
        "image": spec.image,
        "command": engine_command(name, namespace, spec),
        "env": env,
        "resources": spec.engine.resources.to_manifest(),
        "volumeMounts": _volume_mounts(spec),
        "securityContext": container_security_context(),
        # No probes and no preStop hook, deliberately. Engines listen on no port, so there is
        # nothing to probe but the process, which the kubelet watches anyway; whether an
        # engine serves shows in the coordinator's registered-engine count (status).
        # SIGTERM itself starts the drain (stop taking work, finish, deregister, exit 0), and
        # a preStop hook would only postpone SIGTERM while still eating the grace period.
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(name, namespace, engine_name(name), ENGINE),
        "spec": {
            "replicas": spec.data_parallel_size,
            "serviceName": engine_name(name),
            # Engines are independent peers: start and stop them all at once, not one by one.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector_labels(name, ENGINE)},
            "template": _pod_template(
                name,
                ENGINE,
                spec,
                container,
                # The drain must finish in-flight generations before the kubelet's SIGKILL.
                termination_grace_period_seconds=spec.engine.termination_grace_period_seconds,
            ),
        },
    }


def engine_headless_service(name: str, namespace: str, spec: DeploymentSpec) -> dict[str, Any]:
    # Required by the StatefulSet (stable pod DNS names); engines expose no port.
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(name, namespace, engine_name(name), ENGINE),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(name, ENGINE),
            "publishNotReadyAddresses": True,
        },
    }


def engine_pod_disruption_budget(
    name: str, namespace: str, spec: DeploymentSpec, *, api_version: str = "policy/v1"
) -> dict[str, Any]:
    """At most one engine evicted at a time (node drains), so capacity degrades gradually.

    ``api_version`` is ``policy/v1`` (Kubernetes >= 1.21) or ``policy/v1beta1`` (1.20, the
    oldest supported server): the fields used here mean the same in both.
    """
    if api_version not in PDB_API_VERSIONS:
        raise ValueError(f"unsupported PodDisruptionBudget apiVersion {api_version!r}")
    # No budget for the single coordinator: minAvailable 1 would block every node drain.
    return {
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(name, namespace, engine_name(name), ENGINE),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(name, ENGINE)},
        },
    }


# --------------------------------------------------------------------------- network policies


def coordinator_network_policy(name: str, namespace: str, spec: DeploymentSpec) -> dict[str, Any]:
    zmq = {"protocol": "TCP", "port": spec.coordinator.zmq_port}
    http = {"protocol": "TCP", "port": spec.coordinator.http_port}
    ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": {"matchLabels": selector_labels(name, ENGINE)}}], "ports": [zmq]}
    ]
    if spec.allowed_clients:
        ingress.append({"from": thaw(spec.allowed_clients), "ports": [zmq, http]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(name, namespace, coordinator_name(name), COORDINATOR),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(name, COORDINATOR)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def engine_network_policy(name: str, namespace: str, spec: DeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(name, namespace, engine_name(name), ENGINE),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(name, ENGINE)},
            "policyTypes": ["Ingress"],
            "ingress": [],
        },
    }


# --------------------------------------------------------------------------- all of them


def all_children(
    name: str, namespace: str, spec: DeploymentSpec, *, pdb_api_version: str = "policy/v1"
) -> list[dict[str, Any]]:
    """Every object the InferenceDeployment owns, Services before the workloads using them."""
    return [
        coordinator_service(name, namespace, spec),
        engine_headless_service(name, namespace, spec),
        coordinator_network_policy(name, namespace, spec),
        engine_network_policy(name, namespace, spec),
        engine_pod_disruption_budget(name, namespace, spec, api_version=pdb_api_version),
        coordinator_deployment(name, namespace, spec),
        engine_statefulset(name, namespace, spec),
    ]
