"""The operator's pure spec → manifests layer: validity, important fields, spec validation."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from dpserve_operator import manifests
from dpserve_operator.spec import CACHE_DIR, DeploymentSpec, InvalidSpec, parse_spec

NAME, NAMESPACE = "demo", "inference"
IMAGE = "ghcr.io/dpserve/runtime-cpu:0.1.0"
K8S_VERSIONS = ["1.25", kubernetes_validate.latest_version()]

MINIMAL_SPEC: dict[str, Any] = {"model": "smollm2-135m-instruct", "image": IMAGE}

FULL_SPEC: dict[str, Any] = {
    "model": "/models/llama",
    "image": "registry.example.com:5000/team/dpserve-cuda:0.1.0",
    "imagePullPolicy": "IfNotPresent",
    "dataParallelSize": 4,
    "modelVolume": {"claimName": "llama-weights", "mountPath": "/models", "readOnly": True},
    "engine": {
        "resources": {
            "requests": {"cpu": "2", "memory": "16Gi", "nvidia.com/gpu": 1},
            "limits": {"cpu": 4, "memory": "16Gi", "nvidia.com/gpu": "1"},
        },
        "maxBatchSize": 32,
        "dtype": "bfloat16",
        "device": "cuda",
        "terminationGracePeriodSeconds": 120,
        "env": [
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        ],
    },
    "coordinator": {
        "zmqPort": 6000,
        "httpPort": 9000,
        "routing": "round-robin",
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
    },
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                ]
            }
        }
    },
    "imagePullSecrets": [{"name": "registry-credentials"}],
    "serviceAccountName": "inference",
    "allowedClients": [
        {"podSelector": {"matchLabels": {"app": "frontend"}}},
        {"namespaceSelector": {"matchLabels": {"team": "ml"}}},
    ],
    "podTemplate": {
        "metadata": {
            "labels": {"team": "ml"},
            "annotations": {"prometheus.io/scrape": "true"},
        }
    },
}


def parse(raw: dict[str, Any], name: str = NAME) -> DeploymentSpec:
    return parse_spec(raw, name=name)


def children(raw: dict[str, Any], **kwargs: Any) -> dict[tuple[str, str], dict[str, Any]]:
    objects = manifests.all_children(NAME, NAMESPACE, parse(raw), **kwargs)
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in objects}


def pod_templates(objects: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        objects[("Deployment", "demo-coordinator")]["spec"]["template"],
        objects[("StatefulSet", "demo-engine")]["spec"]["template"],
    ]


def container(obj: dict[str, Any]) -> dict[str, Any]:
    (only,) = obj["spec"]["template"]["spec"]["containers"]
    return only


# --------------------------------------------------------------------------- validity


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("raw", [MINIMAL_SPEC, FULL_SPEC], ids=["minimal", "full"])
def test_every_child_validates_strictly(raw: dict[str, Any], version: str) -> None:
    objects = children(raw)
    assert len(objects) == 7
    for obj in objects.values():
        kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_would_catch_a_misspelt_field() -> None:
    # Guards the test above against validating nothing.
    deployment = copy.deepcopy(children(MINIMAL_SPEC)[("Deployment", "demo-coordinator")])
    deployment["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


def test_policy_v1beta1_budget_for_kubernetes_1_20() -> None:
    budget = children(MINIMAL_SPEC, pdb_api_version="policy/v1beta1")[
        ("PodDisruptionBudget", "demo-engine")
    ]
    assert budget["apiVersion"] == "policy/v1beta1"
    # kubernetes-validate ships no schema older than 1.25, where v1beta1 is gone.
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(budget, K8S_VERSIONS[0], strict=True)
    # The fields used (maxUnavailable, selector) have the same shape in v1beta1 and v1, so the
    # v1 schema checks them; v1-only fields (unhealthyPodEvictionPolicy) must stay out.
    assert set(budget["spec"]) == {"maxUnavailable", "selector"}
    as_v1 = {**budget, "apiVersion": "policy/v1"}
    kubernetes_validate.validate(as_v1, K8S_VERSIONS[0], strict=True)


def test_unknown_pdb_api_version_is_refused() -> None:
    with pytest.raises(ValueError, match="policy/v2"):
        manifests.all_children(NAME, NAMESPACE, parse(MINIMAL_SPEC), pdb_api_version="policy/v2")


def test_children_names_and_kinds() -> None:
    assert set(children(MINIMAL_SPEC)) == {
        ("Service", "demo-coordinator"),
        ("Service", "demo-engine"),
        ("NetworkPolicy", "demo-coordinator"),
        ("NetworkPolicy", "demo-engine"),
        ("PodDisruptionBudget", "demo-engine"),
        ("Deployment", "demo-coordinator"),
        ("StatefulSet", "demo-engine"),
    }


# --------------------------------------------------------------------------- coordinator


def test_coordinator_deployment() -> None:
    deployment = children(MINIMAL_SPEC)[("Deployment", "demo-coordinator")]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    coordinator = container(deployment)
    assert coordinator["image"] == IMAGE
    assert coordinator["command"] == [
        "dpserve", "coordinator", "--host", "0.0.0.0",
        "--credentials", "/etc/dpserve/credentials",
        "--api-key-file", "/etc/dpserve/credentials/http-api-token",
        "--admin-api-key-file", "/etc/dpserve/credentials/http-admin-token", "--port", "5555",
        "--http-port", "8000", "--data-parallel-size", "0",
        "--tokenizer", "smollm2-135m-instruct", "--routing", "prefix-aware",
    ]  # fmt: skip
    assert coordinator["ports"] == [
        {"name": "zmq", "containerPort": 5555, "protocol": "TCP"},
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
    ]
    assert coordinator["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert coordinator["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert coordinator["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "imagePullPolicy" not in coordinator


def test_the_reply_parsers_and_chat_template_reach_the_coordinators_front() -> None:
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    coordinator = {"toolCallParser": "hermes", "reasoningParser": "qwen3", "chatTemplate": template}
    spec = {**MINIMAL_SPEC, "coordinator": coordinator}
    command = container(children(spec)[("Deployment", "demo-coordinator")])["command"]
    assert command[command.index("--tool-call-parser") + 1] == "hermes"
    assert command[command.index("--reasoning-parser") + 1] == "qwen3"
    assert command[command.index("--chat-template") + 1] == template
    assert (
        "--tool-call-parser"
        not in container(children(MINIMAL_SPEC)[("Deployment", "demo-coordinator")])["command"]
    )


def test_coordinator_service_reaches_not_ready_coordinators() -> None:
    objects = children(MINIMAL_SPEC)
    service = objects[("Service", "demo-coordinator")]
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["type"] == "ClusterIP"
    assert [(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [
        ("zmq", 5555, "zmq"),
        ("http", 8000, "http"),
    ]
    template_labels = objects[("Deployment", "demo-coordinator")]["spec"]["template"]["metadata"][
        "labels"
    ]
    assert service["spec"]["selector"].items() <= template_labels.items()


# --------------------------------------------------------------------------- engines


def test_engine_statefulset() -> None:
    statefulset = children(FULL_SPEC)[("StatefulSet", "demo-engine")]
    spec = statefulset["spec"]
    assert spec["replicas"] == 4
    assert spec["serviceName"] == "demo-engine"
    assert spec["podManagementPolicy"] == "Parallel"
    engine = container(statefulset)
    assert engine["command"] == [
        "dpserve", "engine",
        "--coordinator", "tcp://demo-coordinator.inference.svc:6000",
        "--rank", "auto",
        "--credentials", "/etc/dpserve/credentials",
        "--model", "/models/llama",
        "--max-batch-size", "32", "--dtype", "bfloat16", "--device", "cuda",
        "--ready-file", "/tmp/dpserve-engine-ready",
    ]  # fmt: skip
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in (
        engine["env"]
    )
    # torch's threads follow the CPU limit (issue 9, item 11), through the downward API.
    (threads,) = [v for v in engine["env"] if v["name"] == "OMP_NUM_THREADS"]
    assert threads["valueFrom"]["resourceFieldRef"] == {
        "containerName": "engine",
        "resource": "limits.cpu",
        "divisor": "1",
    }
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] == 120
    # Ready while registered: the file `--ready-file` keeps, on the /tmp emptyDir.
    assert engine["readinessProbe"]["exec"] == {
        "command": ["test", "-f", "/tmp/dpserve-engine-ready"]
    }
    assert {"mountPath": "/tmp", "name": "tmp"} in engine["volumeMounts"] or any(
        mount["mountPath"] == "/tmp" for mount in engine["volumeMounts"]
    )
    # No liveness probe and no preStop hook (see manifests.engine_statefulset).
    assert not {"livenessProbe", "startupProbe", "lifecycle", "ports"} & set(engine)
    assert engine["imagePullPolicy"] == "IfNotPresent"


def test_gpu_quantities_in_requests_and_limits() -> None:
    engine = container(children(FULL_SPEC)[("StatefulSet", "demo-engine")])
    assert engine["resources"] == {
        "requests": {"cpu": "2", "memory": "16Gi", "nvidia.com/gpu": "1"},
        "limits": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"},
    }


def test_a_gpu_limit_alone_is_mirrored_into_requests() -> None:
    raw = {**MINIMAL_SPEC, "engine": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}
    resources = container(children(raw)[("StatefulSet", "demo-engine")])["resources"]
    assert resources == {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}


def test_device_cuda_alone_asks_for_one_gpu_per_engine() -> None:
    raw = {**MINIMAL_SPEC, "engine": {"device": "cuda", "resources": {"limits": {"cpu": 2}}}}
    resources = container(children(raw)[("StatefulSet", "demo-engine")])["resources"]
    assert resources == {
        "requests": {"nvidia.com/gpu": "1"},
        "limits": {"cpu": "2", "nvidia.com/gpu": "1"},
    }


# --------------------------------------------------------------------------- the vLLM backend

VLLM_IMAGE = "ghcr.io/dpserve/runtime-vllm-cuda:0.1.0"
VLLM_TP4: dict[str, Any] = {
    **MINIMAL_SPEC,
    "model": "meta-llama/Llama-3.3-70B-Instruct",
    "engine": {
        "backend": "vllm",
        "image": VLLM_IMAGE,
        "tensorParallelSize": 4,
        "device": "cuda",
        "dtype": "bfloat16",
        "resources": {"limits": {"cpu": 16, "memory": "200Gi"}},
        "vllm": {"args": ["--max-model-len=16384", "--gpu-memory-utilization", "0.9"]},
    },
}


def test_vllm_engines_run_the_vllm_backend_at_its_tensor_parallel_size() -> None:
    objects = children(VLLM_TP4)
    engine = container(objects[("StatefulSet", "demo-engine")])
    assert engine["image"] == VLLM_IMAGE
    # The coordinator stays on spec.image: it tokenizes, it runs no model.
    assert container(objects[("Deployment", "demo-coordinator")])["image"] == IMAGE
    command = engine["command"]
    assert command[:2] == ["dpserve", "engine"]
    assert command[-8:-4] == ["--backend", "vllm", "--tensor-parallel-size", "4"]
    assert command[command.index("--model") + 1] == "meta-llama/Llama-3.3-70B-Instruct"
    # vLLM's flags in one form, in the order given, a token per --vllm-arg.
    assert command[-4:] == [
        "--vllm-arg=--max-model-len", "--vllm-arg=16384",
        "--vllm-arg=--gpu-memory-utilization", "--vllm-arg=0.9",
    ]  # fmt: skip
    # One GPU per tensor-parallel rank, filled in on both sides.
    assert engine["resources"] == {
        "requests": {"nvidia.com/gpu": "4"},
        "limits": {"cpu": "16", "memory": "200Gi", "nvidia.com/gpu": "4"},
    }


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_vllm_children_validate_strictly(version: str) -> None:
    for obj in children(VLLM_TP4).values():
        kubernetes_validate.validate(obj, version, strict=True)


def test_vllm_on_cpu_runs_at_tensor_parallel_size_1_without_gpus() -> None:
    raw = {**MINIMAL_SPEC, "engine": {"backend": "vllm", "device": "cpu"}}
    engine = container(children(raw)[("StatefulSet", "demo-engine")])
    assert engine["image"] == IMAGE  # spec.image when spec.engine.image is left out
    assert engine["command"][-4:] == ["--backend", "vllm", "--tensor-parallel-size", "1"]
    assert not [part for part in engine["command"] if part.startswith("--vllm-arg")]
    assert "nvidia.com/gpu" not in str(engine["resources"])
    # vLLM's worker processes share memory: 160 MiB of /dev/shm where a pod gets 64 MiB.
    pod = children(raw)[("StatefulSet", "demo-engine")]["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    # Engines sharing a node must not pin their threads to the cores vLLM picks for each.
    assert {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"} in engine["env"]
    pinned = {**raw, "engine": {**raw["engine"], "env": [
        {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0-3"}]}}  # fmt: skip
    env = container(children(pinned)[("StatefulSet", "demo-engine")])["env"]
    assert [v for v in env if v["name"] == "VLLM_CPU_OMP_THREADS_BIND"] == [
        {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0-3"}
    ]


def test_the_dpserve_backend_command_names_no_backend() -> None:
    # The default backend keeps the command line it always had (no --backend flag).
    engine = container(children(MINIMAL_SPEC)[("StatefulSet", "demo-engine")])
    assert "--backend" not in engine["command"]
    assert "--tensor-parallel-size" not in engine["command"]
    assert "VLLM_CPU_OMP_THREADS_BIND" not in str(engine["env"])
    assert "/dev/shm" not in str(engine["volumeMounts"])


def test_engine_headless_service_and_budget() -> None:
    objects = children(MINIMAL_SPEC)
    service = objects[("Service", "demo-engine")]
    assert service["spec"]["clusterIP"] == "None"
    budget = objects[("PodDisruptionBudget", "demo-engine")]
    assert budget["apiVersion"] == "policy/v1"
    assert budget["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": manifests.selector_labels(NAME, "engine")},
    }


def test_user_env_overrides_the_operator_defaults() -> None:
    raw = {**MINIMAL_SPEC, "engine": {"env": [{"name": "HF_HOME", "value": "/data/hf"}]}}
    env = container(children(raw)[("StatefulSet", "demo-engine")])["env"]
    assert [v for v in env if v["name"] == "HF_HOME"] == [{"name": "HF_HOME", "value": "/data/hf"}]


def test_the_cpu_engine_s_settings_pass_through_when_the_engine_takes_them() -> None:
    """Their values are checked (the invalid cases above); one the engine takes reaches it."""
    settings = [
        {"name": "DPSERVE_CPU_ISA", "value": "avx2"},
        {"name": "DPSERVE_CPU_SMALL_BATCH_ROWS", "value": "8"},
        {"name": "DPSERVE_CPU_BF16_DOTS", "value": "1"},
    ]
    raw = {**MINIMAL_SPEC, "engine": {"env": settings}}
    env = container(children(raw)[("StatefulSet", "demo-engine")])["env"]
    assert [v for v in env if v["name"].startswith("DPSERVE_CPU_")] == settings


# --------------------------------------------------------------------------- pods in general


@pytest.mark.parametrize("raw", [MINIMAL_SPEC, FULL_SPEC], ids=["minimal", "full"])
def test_security_context_on_every_pod_and_container(raw: dict[str, Any]) -> None:
    for template in pod_templates(children(raw)):
        pod = template["spec"]["securityContext"]
        assert pod["runAsNonRoot"] is True
        assert pod["runAsUser"] == 10001
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        for each in template["spec"]["containers"]:
            context = each["securityContext"]
            assert context["runAsNonRoot"] is True
            assert context["runAsUser"] == 10001
            assert context["allowPrivilegeEscalation"] is False
            assert context["readOnlyRootFilesystem"] is True
            assert context["capabilities"] == {"drop": ["ALL"]}
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}
            # A read-only root needs writable scratch and cache directories.
            mounts = {m["mountPath"]: m["name"] for m in each["volumeMounts"]}
            assert mounts["/tmp"] == "tmp" and mounts[CACHE_DIR] == "cache"
            env = {v["name"]: v.get("value") for v in each["env"]}
            assert env["HF_HOME"].startswith(CACHE_DIR)
            assert env["DPSERVE_CACHE"].startswith(CACHE_DIR)
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["tmp"] == {"name": "tmp", "emptyDir": {}}
        assert volumes["cache"] == {"name": "cache", "emptyDir": {}}


def test_labels_are_set_and_owner_independent() -> None:
    for (kind, _), obj in children(FULL_SPEC).items():
        labels = obj["metadata"]["labels"]
        component = "coordinator" if obj["metadata"]["name"].endswith("coordinator") else "engine"
        assert labels == {
            "app.kubernetes.io/name": "dpserve",
            "app.kubernetes.io/instance": NAME,
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/managed-by": "dpserve-operator",
        }, kind
        assert obj["metadata"]["namespace"] == NAMESPACE
        assert "ownerReferences" not in obj["metadata"]  # the handlers adopt the children


def test_status_selector_selects_the_engine_pods() -> None:
    selector = manifests.engine_selector(NAME)
    assert selector == (
        "app.kubernetes.io/component=engine,app.kubernetes.io/instance=demo,"
        "app.kubernetes.io/name=dpserve"
    )
    engine_labels = children(MINIMAL_SPEC)[("StatefulSet", "demo-engine")]["spec"]["template"][
        "metadata"
    ]["labels"]
    assert dict(pair.split("=") for pair in selector.split(",")).items() <= engine_labels.items()


def test_scheduling_and_identity_apply_to_both_pod_templates() -> None:
    for template in pod_templates(children(FULL_SPEC)):
        pod = template["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert pod["tolerations"] == FULL_SPEC["tolerations"]
        assert pod["affinity"] == FULL_SPEC["affinity"]
        assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
        assert pod["serviceAccountName"] == "inference"
        assert "automountServiceAccountToken" not in pod
        assert template["metadata"]["labels"]["team"] == "ml"
        assert template["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}
        model_mount = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}["model"]
        assert model_mount == {"name": "model", "mountPath": "/models", "readOnly": True}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {
            "claimName": "llama-weights",
            "readOnly": True,
        }
    for template in pod_templates(children(MINIMAL_SPEC)):
        assert template["spec"]["automountServiceAccountToken"] is False
        assert not {"nodeSelector", "tolerations", "affinity", "imagePullSecrets"} & set(
            template["spec"]
        )


def test_manifests_do_not_alias_the_spec() -> None:
    spec = parse(FULL_SPEC)
    first = manifests.all_children(NAME, NAMESPACE, spec)
    first[-1]["spec"]["template"]["spec"]["tolerations"].append({"key": "mutated"})
    second = manifests.all_children(NAME, NAMESPACE, spec)
    assert second[-1]["spec"]["template"]["spec"]["tolerations"] == FULL_SPEC["tolerations"]


# --------------------------------------------------------------------------- network policies


def test_network_policy_lets_only_engines_and_allowed_clients_in() -> None:
    policy = children(FULL_SPEC)[("NetworkPolicy", "demo-coordinator")]["spec"]
    assert policy["podSelector"] == {"matchLabels": manifests.selector_labels(NAME, "coordinator")}
    assert policy["policyTypes"] == ["Ingress"]
    engines_rule, clients_rule = policy["ingress"]
    assert engines_rule == {
        "from": [{"podSelector": {"matchLabels": manifests.selector_labels(NAME, "engine")}}],
        "ports": [{"protocol": "TCP", "port": 6000}],
    }
    assert clients_rule == {
        "from": FULL_SPEC["allowedClients"],
        "ports": [{"protocol": "TCP", "port": 6000}, {"protocol": "TCP", "port": 9000}],
    }


def test_without_allowed_clients_only_engines_reach_the_coordinator() -> None:
    objects = children(MINIMAL_SPEC)
    (only_rule,) = objects[("NetworkPolicy", "demo-coordinator")]["spec"]["ingress"]
    assert only_rule["ports"] == [{"protocol": "TCP", "port": 5555}]
    engine_policy = objects[("NetworkPolicy", "demo-engine")]["spec"]
    assert engine_policy["ingress"] == []  # engines listen on nothing
    assert engine_policy["policyTypes"] == ["Ingress"]


# --------------------------------------------------------------------------- spec changes

ENGINES = ("StatefulSet", "demo-engine")
COORDINATOR = ("Deployment", "demo-coordinator")
COORDINATOR_SERVICE = ("Service", "demo-coordinator")
COORDINATOR_POLICY = ("NetworkPolicy", "demo-coordinator")
CONTAINER = ("spec", "template", "spec", "containers", 0)


@pytest.mark.parametrize(
    ("change", "key", "path", "expected"),
    [
        ({"dataParallelSize": 7}, ENGINES, ("spec", "replicas"), 7),
        ({"dataParallelSize": 0}, ENGINES, ("spec", "replicas"), 0),
        ({"image": "ghcr.io/dpserve/runtime-cpu:0.2.0"}, COORDINATOR, (*CONTAINER, "image"),
         "ghcr.io/dpserve/runtime-cpu:0.2.0"),
        ({"image": "ghcr.io/dpserve/runtime-cpu:0.2.0"}, ENGINES, (*CONTAINER, "image"),
         "ghcr.io/dpserve/runtime-cpu:0.2.0"),
        ({"model": "other/model"}, ENGINES, (*CONTAINER, "command", 9), "other/model"),
        ({"model": "other/model"}, COORDINATOR, (*CONTAINER, "command", 17), "other/model"),
        ({"coordinator": {"zmqPort": 7000}}, ENGINES, (*CONTAINER, "command", 3),
         "tcp://demo-coordinator.inference.svc:7000"),
        ({"coordinator": {"zmqPort": 7000}}, COORDINATOR_POLICY,
         ("spec", "ingress", 0, "ports", 0, "port"), 7000),
        ({"coordinator": {"httpPort": 8080}}, COORDINATOR_SERVICE, ("spec", "ports", 1, "port"),
         8080),
        ({"engine": {"terminationGracePeriodSeconds": 5}}, ENGINES,
         ("spec", "template", "spec", "terminationGracePeriodSeconds"), 5),
    ],
)  # fmt: skip
def test_spec_changes_propagate(
    change: dict[str, Any], key: tuple[str, str], path: tuple[Any, ...], expected: Any
) -> None:
    def at(raw: dict[str, Any]) -> Any:
        value: Any = children(raw)[key]
        for step in path:
            value = value[step]
        return value

    assert at(MINIMAL_SPEC) != expected
    assert at({**MINIMAL_SPEC, **change}) == expected


# --------------------------------------------------------------------------- the real CLI


def test_pod_commands_parse_with_the_dpserve_cli() -> None:
    from dpserve.cli import build_parser

    objects = children(FULL_SPEC)
    coordinator = build_parser().parse_args(
        container(objects[("Deployment", "demo-coordinator")])["command"][1:]
    )
    assert (coordinator.command, coordinator.host, coordinator.port) == (
        "coordinator", "0.0.0.0", 6000,
    )  # fmt: skip
    assert (coordinator.http_port, coordinator.data_parallel_size) == (9000, 0)
    assert (coordinator.tokenizer, coordinator.routing) == ("/models/llama", "round-robin")
    assert (coordinator.credentials, coordinator.insecure) == ("/etc/dpserve/credentials", False)

    engine = build_parser().parse_args(
        container(objects[("StatefulSet", "demo-engine")])["command"][1:]
    )
    assert (engine.command, engine.rank, engine.model) == ("engine", "auto", "/models/llama")
    assert engine.coordinator == "tcp://demo-coordinator.inference.svc:6000"
    assert (engine.max_num_seqs, engine.dtype, engine.device) == (32, "bfloat16", "cuda")
    assert engine.credentials == "/etc/dpserve/credentials"


def test_the_vllm_engine_command_parses_with_the_dpserve_cli() -> None:
    from dpserve.cli import build_parser
    from dpserve.flags import backend_flags_error

    command = container(children(VLLM_TP4)[("StatefulSet", "demo-engine")])["command"]
    engine = build_parser().parse_args(command[1:])
    assert (engine.backend, engine.tensor_parallel_size) == ("vllm", 4)
    assert engine.vllm_args == ["--max-model-len", "16384", "--gpu-memory-utilization", "0.9"]
    assert (engine.max_num_seqs, engine.dtype, engine.device) == (8, "bfloat16", "cuda")
    assert backend_flags_error(engine) is None


def test_cpu_weights_reach_the_engine_and_the_default_adds_no_flag() -> None:
    """``spec.engine.cpuWeights`` becomes the engine's ``--cpu-weights`` (checked by the real
    CLI); the default fp32 adds nothing, so existing pods are not rolled by the field."""
    from dpserve.cli import build_parser
    from dpserve.engine.layers.weight_format import flag_error

    def engine_command(spec: dict[str, Any]) -> list[str]:
        command: list[str] = container(children(spec)[("StatefulSet", "demo-engine")])["command"]
        return command

    assert "--cpu-weights" not in engine_command(MINIMAL_SPEC)
    command = engine_command(with_(engine={"cpuWeights": "int8"}))
    engine = build_parser().parse_args(command[1:])
    assert engine.cpu_weights == "int8" and flag_error(engine) is None


# --------------------------------------------------------------------------- invalid specs


def with_(**changes: Any) -> dict[str, Any]:
    return {**MINIMAL_SPEC, **changes}


def case(case_id: str, raw: dict[str, Any], message: str) -> Any:
    return pytest.param(raw, message, id=case_id)


ENGINE_GPU_MISMATCH = {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 2}}
INVALID_SPECS = [
    case("missing-model", {"image": IMAGE}, "spec.model: is required"),
    case("blank-model", {"model": "  ", "image": IMAGE}, "spec.model: must not be empty"),
    case("image-with-space", with_(image="ghcr.io/dpserve/runtime cpu:0.1.0"),
         "spec.image: 'ghcr.io/dpserve/runtime cpu"),
    case("image-uppercase-path", with_(image="ghcr.io/dpserve/Runtime:0.1"),
         "not a valid image reference"),
    case("string-size", with_(dataParallelSize="2"),
         "spec.dataParallelSize: must be an integer, got string"),
    case("bool-size", with_(dataParallelSize=True), "spec.dataParallelSize: must be an integer"),
    case("negative-size", with_(dataParallelSize=-1),
         "spec.dataParallelSize: must be >= 0, got -1"),
    case("bad-dtype", with_(engine={"dtype": "fp8"}),
         "spec.engine.dtype: must be one of auto, float32"),
    case("zero-batch", with_(engine={"maxBatchSize": 0}), "spec.engine.maxBatchSize: must be >= 1"),
    case("port-70000", with_(coordinator={"zmqPort": 70000}),
         "spec.coordinator.zmqPort: must be <= 65535"),
    case("port-clash", with_(coordinator={"zmqPort": 8000}),
         "spec.coordinator.httpPort: must differ from zmqPort (both are 8000)"),
    case("bad-routing", with_(coordinator={"routing": "random"}), "spec.coordinator.routing"),
    case("bad-tool-call-parser", with_(coordinator={"toolCallParser": "json"}),
         "spec.coordinator.toolCallParser: must be one of hermes, llama3_json"),
    case("empty-chat-template", with_(coordinator={"chatTemplate": ""}),
         "spec.coordinator.chatTemplate: must not be empty"),
    case("huge-chat-template", with_(coordinator={"chatTemplate": "x" * 65537}),
         "spec.coordinator.chatTemplate: must have at most 65536 characters"),
    case("bad-pull-policy", with_(imagePullPolicy="always"), "spec.imagePullPolicy"),
    case("bad-quantity", with_(engine={"resources": {"limits": {"cpu": "2 cores"}}}),
         "spec.engine.resources.limits.cpu: must be a quantity"),
    case("negative-quantity", with_(engine={"resources": {"requests": {"memory": "-1Gi"}}}),
         "spec.engine.resources.requests.memory: must not be negative"),
    case("request-over-limit",
         with_(engine={"resources": {"requests": {"cpu": "4"}, "limits": {"cpu": "2"}}}),
         "spec.engine.resources.requests.cpu: 4 exceeds limits.cpu"),
    case("gpu-request-not-limit", with_(engine={"resources": ENGINE_GPU_MISMATCH}),
         "GPUs cannot be overcommitted"),
    case("tp-on-dpserve",
         with_(engine={"tensorParallelSize": 2, "device": "cuda"}),
         "spec.engine.tensorParallelSize: 2 needs backend vllm (spec.engine.backend is dpserve"),
    case("tp-on-cpu", with_(engine={"backend": "vllm", "tensorParallelSize": 2, "device": "cpu"}),
         "spec.engine.tensorParallelSize: 2 needs GPUs (spec.engine.device cuda or an "
         "nvidia.com/gpu resource); tensor parallelism on CPU is not offered"),
    case("tp-on-auto-without-gpus",
         with_(engine={"backend": "vllm", "tensorParallelSize": 4}),
         "spec.engine.tensorParallelSize: 4 needs GPUs"),
    case("tp-above-bound", with_(engine={"backend": "vllm", "tensorParallelSize": 17}),
         "spec.engine.tensorParallelSize: must be <= 16, got 17"),
    case("tp-zero", with_(engine={"backend": "vllm", "tensorParallelSize": 0}),
         "spec.engine.tensorParallelSize: must be >= 1, got 0"),
    case("gpus-not-tp",
         with_(engine={"backend": "vllm", "tensorParallelSize": 4,
                       "resources": {"limits": {"nvidia.com/gpu": 2}}}),
         "spec.engine.resources.limits.nvidia.com/gpu: 2 differs from "
         "spec.engine.tensorParallelSize (4)"),
    case("two-gpus-for-a-dpserve-engine",
         with_(engine={"resources": {"requests": {"nvidia.com/gpu": 2}}}),
         "nvidia.com/gpu: 2 differs from spec.engine.tensorParallelSize (1)"),
    case("cpu-weights-unknown", with_(engine={"cpuWeights": "q4"}),
         "spec.engine.cpuWeights: must be one of fp32, bf16, int8; got 'q4'"),
    case("cpu-weights-on-vllm", with_(engine={"backend": "vllm", "cpuWeights": "int8"}),
         "spec.engine.cpuWeights: int8 is for backend dpserve (vLLM runs its own)"),
    case("cpu-weights-on-gpus", with_(engine={"cpuWeights": "bf16", "device": "cuda"}),
         "spec.engine.cpuWeights: bf16 is for CPU engines; these run on GPUs"),
    case("cpu-weights-on-a-gpu-resource",
         with_(engine={"cpuWeights": "int8", "resources": {"limits": {"nvidia.com/gpu": 1}}}),
         "spec.engine.cpuWeights: int8 is for CPU engines"),
    case("cpu-weights-bf16-model",
         with_(engine={"cpuWeights": "int8", "dtype": "bfloat16"}),
         "spec.engine.cpuWeights: int8 needs spec.engine.dtype auto or float32"),
    case("bad-backend", with_(engine={"backend": "sglang"}),
         "spec.engine.backend: must be one of dpserve, vllm; got 'sglang'"),
    case("vllm-args-on-dpserve", with_(engine={"vllm": {"args": ["--enforce-eager"]}}),
         "spec.engine.vllm: is for backend vllm; spec.engine.backend is dpserve"),
    case("vllm-args-port", with_(engine={"backend": "vllm", "vllm": {"args": ["--port", "80"]}}),
         "spec.engine.vllm.args[0]: --port is set by dpserve"),
    case("vllm-args-tp",
         with_(engine={"backend": "vllm", "vllm": {"args": ["--tensor-parallel-size=2"]}}),
         "spec.engine.vllm.args[0]: --tensor-parallel-size is set by dpserve: set "
         "spec.engine.tensorParallelSize"),
    case("vllm-args-not-a-list", with_(engine={"backend": "vllm", "vllm": {"args": "--seed 1"}}),
         "spec.engine.vllm.args: must be a list of strings, got string"),
    case("vllm-args-too-many",
         with_(engine={"backend": "vllm", "vllm": {"args": ["--enforce-eager"] * 65}}),
         "spec.engine.vllm.args: must have at most 64 items, got 65"),
    case("vllm-arg-too-long",
         with_(engine={"backend": "vllm", "vllm": {"args": ["--revision=" + "a" * 4090]}}),
         "spec.engine.vllm.args[0]: is longer than 4096 characters"),
    case("engine-image-bad", with_(engine={"image": "Runtime VLLM"}),
         "spec.engine.image: 'Runtime VLLM' is not a valid image reference"),
    case("reserved-env", with_(engine={"env": [{"name": "POD_NAME", "value": "x"}]}),
         "is set by the operator"),
    case("duplicate-env",
         with_(engine={"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}),
         "A is defined twice"),
    case("bad-env-name", with_(engine={"env": [{"name": "1 bad"}]}),
         "not a valid environment variable name"),
    case("bad-cpu-isa", with_(engine={"env": [{"name": "A", "value": "1"},
                                               {"name": "DPSERVE_CPU_ISA", "value": "avx3"}]}),
         "spec.engine.env[1].value: DPSERVE_CPU_ISA must be one of auto, portable, avx2, avx512 "
         "(got 'avx3')"),
    case("bad-small-batch-rows",
         with_(engine={"env": [{"name": "DPSERVE_CPU_SMALL_BATCH_ROWS", "value": "33"}]}),
         "spec.engine.env[0].value: DPSERVE_CPU_SMALL_BATCH_ROWS must be a whole number from 0 "
         "to 32 (got '33')"),
    case("bad-bf16-dots", with_(engine={"env": [{"name": "DPSERVE_CPU_BF16_DOTS", "value": "on"}]}),
         "spec.engine.env[0].value: DPSERVE_CPU_BF16_DOTS must be 0 or 1 (got 'on')"),
    case("reserved-label",
         with_(podTemplate={"metadata": {"labels": {"app.kubernetes.io/name": "x"}}}),
         "are set by the operator"),
    case("bad-label-value", with_(podTemplate={"metadata": {"labels": {"team": "has space"}}}),
         "not a valid label value"),
    case("empty-peer", with_(allowedClients=[{}]), "spec.allowedClients[0]: needs a podSelector"),
    case("relative-mount", with_(modelVolume={"claimName": "w", "mountPath": "models"}),
         "spec.modelVolume.mountPath: 'models' must be an absolute path"),
    case("mount-over-tmp", with_(modelVolume={"claimName": "w", "mountPath": "/tmp"}),
         "used by the operator's scratch volumes"),
    case("missing-claim", with_(modelVolume={"mountPath": "/m"}),
         "spec.modelVolume.claimName: is required"),
    case("tolerations-map", with_(tolerations={"key": "x"}), "spec.tolerations: must be a list"),
    case("non-string-selector", with_(nodeSelector={"gpu": True}),
         "spec.nodeSelector.gpu: must be a string"),
    case("engine-not-object", with_(engine="big"), "spec.engine: must be an object"),
]  # fmt: skip


@pytest.mark.parametrize(("raw", "message"), INVALID_SPECS)
def test_invalid_specs_raise_with_the_field_named(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpec) as raised:
        parse(raw)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("Demo", "DNS-1035"),
        ("9lives", "DNS-1035"),
        ("demo.v2", "DNS-1035"),
        ("a" * 46, "at most 45 fit"),
    ],
)
def test_names_that_cannot_prefix_the_children_are_refused(name: str, message: str) -> None:
    with pytest.raises(InvalidSpec, match=message):
        parse(MINIMAL_SPEC, name=name)
    parse(MINIMAL_SPEC, name="a" * 45)  # the longest that fits


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(InvalidSpec) as raised:
        parse({"image": "a b", "dataParallelSize": -3, "engine": {"dtype": "fp4"}})
    fields = [problem.split(":")[0] for problem in raised.value.problems]
    assert fields == ["spec.model", "spec.image", "spec.engine.dtype", "spec.dataParallelSize"]


def test_a_missing_spec_is_invalid_not_a_crash() -> None:
    with pytest.raises(InvalidSpec, match=r"spec\.model: is required"):
        parse_spec(None, name=NAME)
    with pytest.raises(InvalidSpec, match=r"spec: must be an object"):
        parse_spec(["model"], name=NAME)  # type: ignore[arg-type]


def test_defaults() -> None:
    spec = parse(MINIMAL_SPEC)
    assert spec.data_parallel_size == 1
    engine = spec.engine
    assert (engine.max_batch_size, engine.dtype, engine.device) == (8, "auto", "auto")
    assert spec.engine.termination_grace_period_seconds == 60
    assert (spec.coordinator.zmq_port, spec.coordinator.http_port) == (5555, 8000)
    assert spec.coordinator.routing == "prefix-aware"
    assert spec.engine.prefix_caching is True
    assert (spec.engine.backend, spec.engine.tensor_parallel_size) == ("dpserve", 1)
    assert (spec.engine.image, spec.engine.vllm_args) == (None, ())
    assert spec.model_volume is None and spec.image_pull_policy is None


def test_spec_is_frozen() -> None:
    spec = parse(FULL_SPEC)
    with pytest.raises(AttributeError):
        spec.model = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.node_selector["x"] = "y"  # type: ignore[index]
