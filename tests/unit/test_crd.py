"""The InferenceDeployment CRD: well-formed, structural, and strict enough on its own.

The CRD is package data of the operator (operator/inferencedeployment.yaml, which the parser
reads its defaults, enums and bounds from); crds/ links to it, the Helm chart carries a
byte-identical copy (charts/dpserve-operator/crds/), and this module fails when they drift
apart.
"""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from dpserve_operator import crd as crd_module
from dpserve_operator import handlers
from dpserve_operator import spec as spec_module
from dpserve_operator.spec import InvalidSpec, parse_spec

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_CRD_PATH = ROOT / "operator" / crd_module.CRD_FILE
CRD_PATH = ROOT / "crds" / "inferencedeployment.yaml"
CHART_CRD_PATH = ROOT / "charts" / "dpserve-operator" / "crds" / "inferencedeployment.yaml"
EXAMPLE_PATH = ROOT / "examples" / "inference.yaml"
VLLM_EXAMPLE_PATH = ROOT / "examples" / "inference-vllm.yaml"


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="module")
def version(crd: dict[str, Any]) -> dict[str, Any]:
    (only,) = crd["spec"]["versions"]
    return only


@pytest.fixture(scope="module")
def schema(version: dict[str, Any]) -> dict[str, Any]:
    return version["schema"]["openAPIV3Schema"]


def resource(spec: dict[str, Any], name: str = "demo") -> dict[str, Any]:
    return {
        "apiVersion": "dpserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": spec,
    }


def schema_errors(schema: dict[str, Any], obj: dict[str, Any]) -> list[jsonschema.ValidationError]:
    return list(jsonschema.Draft202012Validator(schema).iter_errors(obj))


def test_one_crd_file() -> None:
    # crds/ links to the package's file; the chart cannot follow a link out of its directory.
    assert CRD_PATH.resolve() == PACKAGE_CRD_PATH.resolve()
    assert PACKAGE_CRD_PATH.read_text() == crd_module.CRD_TEXT
    assert CHART_CRD_PATH.read_bytes() == PACKAGE_CRD_PATH.read_bytes(), (
        "refresh the chart's copy: cp operator/inferencedeployment.yaml "
        "charts/dpserve-operator/crds/"
    )


def test_the_wheel_ships_the_crd() -> None:
    # A plain pip install (the operator image) copies only the package data pyproject names.
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert crd_module.CRD_FILE in setuptools["package-data"]["dpserve_operator"]
    assert setuptools["package-dir"]["dpserve_operator"] == PACKAGE_CRD_PATH.parent.name


def test_the_operator_watches_the_crds_resource(crd: dict[str, Any]) -> None:
    names = crd["spec"]["names"]
    assert (crd["spec"]["group"], "v1alpha1", names["plural"]) == handlers.RESOURCE
    assert crd_module.KIND == names["kind"] == "InferenceDeployment"


@pytest.mark.parametrize("k8s", ["1.25", kubernetes_validate.latest_version()])
def test_crd_is_a_valid_apiextensions_v1_object(crd: dict[str, Any], k8s: str) -> None:
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    kubernetes_validate.validate(crd, k8s, strict=True)


def test_names_scope_and_version(crd: dict[str, Any], version: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "inferencedeployments.dpserve.io"
    assert spec["group"] == "dpserve.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "InferenceDeployment"
    assert spec["names"]["plural"] == "inferencedeployments"
    assert spec["names"]["shortNames"] == ["infd"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)


def test_status_and_scale_subresources(version: dict[str, Any]) -> None:
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.dataParallelSize",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }


def test_printer_columns(version: dict[str, Any]) -> None:
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Desired": ".spec.dataParallelSize",
        "Ready": ".status.readyReplicas",
        "Registered": ".status.registeredEngines",
        "Autoscaler": ".status.autoscaling.reason",
        "Phase": ".status.phase",
        "Model": ".spec.model",
        "Age": ".metadata.creationTimestamp",
    }


# --------------------------------------------------------------------------- structural


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for key, child in (node.get("properties") or {}).items():
        yield from walk(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}.*")


def test_schema_is_structural_for_kubernetes_1_20(schema: dict[str, Any]) -> None:
    # The rules of https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/
    # custom-resource-definitions/#specifying-a-structural-schema that a 1.20 server enforces.
    for path, node in walk(schema):
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        elif not node.get("x-kubernetes-preserve-unknown-fields") or "type" in node:
            assert node.get("type") in (
                "object",
                "array",
                "string",
                "integer",
                "number",
                "boolean",
            ), path
        assert not ("properties" in node and "additionalProperties" in node), path
        assert "$ref" not in node and "x-kubernetes-validations" not in node, path  # no CEL
        if node.get("type") == "array":
            assert isinstance(node.get("items"), dict), path


def test_left_out_fields_get_the_crds_defaults(schema: dict[str, Any]) -> None:
    spec = schema["properties"]["spec"]["properties"]
    engine = spec["engine"]["properties"]
    coordinator = spec["coordinator"]["properties"]
    autoscaling = spec["autoscaling"]["properties"]
    volume = spec["modelVolume"]["properties"]
    parsed = parse_spec(
        {**MINIMAL, "modelVolume": {"claimName": "w"}, "autoscaling": {"maxReplicas": 3}},
        name="demo",
    )
    assert parsed.data_parallel_size == spec["dataParallelSize"]["default"]
    assert parsed.engine.max_batch_size == engine["maxBatchSize"]["default"]
    assert parsed.engine.dtype == engine["dtype"]["default"]
    assert parsed.engine.device == engine["device"]["default"]
    assert parsed.engine.prefix_caching is engine["prefixCaching"]["default"]
    grace = engine["terminationGracePeriodSeconds"]["default"]
    assert parsed.engine.termination_grace_period_seconds == grace
    assert parsed.coordinator.zmq_port == coordinator["zmqPort"]["default"]
    assert parsed.coordinator.http_port == coordinator["httpPort"]["default"]
    assert parsed.coordinator.routing == coordinator["routing"]["default"]
    assert parsed.model_volume is not None
    assert parsed.model_volume.mount_path == volume["mountPath"]["default"]
    assert parsed.model_volume.read_only is volume["readOnly"]["default"]
    assert parsed.image_pull_policy is None  # no default: the kubelet's own applies
    scaling = parsed.autoscaling
    assert scaling is not None
    assert scaling.mode == autoscaling["mode"]["default"]
    assert scaling.min_replicas == autoscaling["minReplicas"]["default"]
    assert scaling.metric == autoscaling["metric"]["default"]
    assert scaling.scale_up_window_seconds == autoscaling["scaleUpWindowSeconds"]["default"]
    assert scaling.scale_down_window_seconds == autoscaling["scaleDownWindowSeconds"]["default"]
    assert scaling.idle_before_zero_seconds == autoscaling["idleBeforeZeroSeconds"]["default"]


def test_the_autoscaler_reads_every_metric_the_crd_offers(schema: dict[str, Any]) -> None:
    metric = schema["properties"]["spec"]["properties"]["autoscaling"]["properties"]["metric"]
    known = {
        spec_module.QUEUED_REQUESTS_PER_ENGINE,
        spec_module.KV_CACHE_USAGE,
        spec_module.TTFT_P90,
    }
    assert set(metric["enum"]) == known
    assert set(spec_module.DEFAULT_TARGETS) < known  # TTFT's target is the user's objective


def bounded_integers(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, int, Any]]:
    """(dotted path, minimum, maximum or None) of every bounded integer field under ``node``."""
    for key, child in (node.get("properties") or {}).items():
        child_path = f"{path}.{key}" if path else key
        if child.get("type") == "integer" and "minimum" in child:
            yield child_path, child["minimum"], child.get("maximum")
        yield from bounded_integers(child, child_path)


SPEC_BOUNDS = list(bounded_integers(crd_module.SPEC_SCHEMA))


def test_the_crd_offers_exactly_the_engine_backends_the_cli_has(schema: dict[str, Any]) -> None:
    from dpserve.flags import ENGINE_BACKENDS

    backend = schema["properties"]["spec"]["properties"]["engine"]["properties"]["backend"]
    assert backend["enum"] == list(ENGINE_BACKENDS)
    assert backend["default"] == spec_module.DPSERVE_BACKEND == ENGINE_BACKENDS[0]


def test_the_bounds_cover_the_spec() -> None:
    paths = {path for path, _, _ in SPEC_BOUNDS}
    assert {"dataParallelSize", "engine.maxBatchSize", "coordinator.zmqPort"} <= paths
    assert "coordinator.limits.maxPromptTokens" in paths


def set_in_context(path: str, value: int) -> dict[str, Any]:
    """MINIMAL with ``value`` at ``path``, plus what the field needs around it to be valid."""
    spec = changed(path, value)
    if path.startswith("autoscaling.") and path != "autoscaling.maxReplicas":
        spec["autoscaling"]["maxReplicas"] = 4
    if path == "engine.tensorParallelSize":  # tensor parallelism is vLLM's, on GPUs
        spec["engine"].update(backend="vllm", device="cuda")
    if path == "engine.maxLoras":  # LoRA slots are for spec.adapters
        spec["adapters"] = []
    return spec


@pytest.mark.parametrize(
    ("path", "minimum", "maximum"), SPEC_BOUNDS, ids=[p for p, *_ in SPEC_BOUNDS]
)
def test_the_operator_enforces_every_bound_of_the_crd(
    path: str, minimum: int, maximum: int | None
) -> None:
    # The API server enforces these; the operator must too, with the same numbers, for
    # objects the schema never saw.
    for outside in [minimum - 1] + ([] if maximum is None else [maximum + 1]):
        with pytest.raises(InvalidSpec) as raised:
            parse_spec(set_in_context(path, outside), name="demo")
        problems = raised.value.problems
        assert any(problem.startswith(f"spec.{path}: ") for problem in problems), problems
    inside = maximum if maximum is not None else max(minimum, 1)
    parse_spec(set_in_context(path, inside), name="demo")


# --------------------------------------------------------------------------- valid resources

MINIMAL = {"model": "smollm2-135m-instruct", "image": "ghcr.io/dpserve/runtime-cpu:0.1.0"}
VALID_SPECS = {
    "minimal": MINIMAL,
    "scaled-to-zero": {**MINIMAL, "dataParallelSize": 0},
    "autoscaled-from-zero": {
        **MINIMAL,
        "dataParallelSize": 0,
        "autoscaling": {
            "minReplicas": 0,
            "maxReplicas": 4,
            "metric": "TTFTP90",
            "target": 0.5,
            "scaleUpWindowSeconds": 0,
            "scaleDownWindowSeconds": 60,
            "idleBeforeZeroSeconds": 120,
        },
    },
    "external-autoscaler": {**MINIMAL, "autoscaling": {"mode": "External"}},
    "gpu": {
        **MINIMAL,
        "image": "ghcr.io/dpserve/runtime-cuda:0.1.0",
        "engine": {
            "device": "cuda",
            "dtype": "bfloat16",
            "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "24Gi"}},
        },
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        "nodeSelector": {"accelerator": "a100"},
    },
    "vllm-on-cpu": {
        **MINIMAL,
        "image": "ghcr.io/dpserve/runtime-vllm-cpu:0.1.0",
        "engine": {"backend": "vllm", "device": "cpu", "vllm": {"args": ["--enforce-eager"]}},
    },
    "vllm-70b-at-tp-4": {
        **MINIMAL,
        "model": "/models/Llama-3.3-70B-Instruct",
        "modelVolume": {"claimName": "llama-70b"},
        "engine": {
            "backend": "vllm",
            "image": "ghcr.io/dpserve/runtime-vllm-cuda:0.1.0",
            "tensorParallelSize": 4,
            "device": "cuda",
            "dtype": "bfloat16",
            "resources": {"limits": {"nvidia.com/gpu": 4, "memory": "160Gi"}},
            "vllm": {"args": ["--max-model-len", "32768", "--gpu-memory-utilization=0.92"]},
        },
    },
    "model-on-a-volume": {
        **MINIMAL,
        "model": "/models/llama",
        "modelVolume": {"claimName": "weights", "readOnly": True},
        "coordinator": {"zmqPort": 6000, "httpPort": 9000, "routing": "round-robin"},
        "allowedClients": [
            {"namespaceSelector": {"matchLabels": {"team": "ml"}}},
            {"ipBlock": {"cidr": "10.0.0.0/8"}},
        ],
        "imagePullSecrets": [{"name": "pull"}],
        "podTemplate": {"metadata": {"labels": {"team": "ml"}, "annotations": {"a": "b"}}},
    },
}


def test_the_example_is_valid(schema: dict[str, Any]) -> None:
    example = yaml.safe_load(EXAMPLE_PATH.read_text())
    assert example["metadata"]["name"] == "demo"
    assert example["spec"]["dataParallelSize"] == 2
    assert example["spec"]["model"] == "smollm2-135m-instruct"
    assert example["spec"]["image"] == "ghcr.io/dpserve/runtime-cpu:0.1.0"
    assert schema_errors(schema, example) == []
    parse_spec(example["spec"], name=example["metadata"]["name"])


def test_the_vllm_example_is_valid(schema: dict[str, Any]) -> None:
    example = yaml.safe_load(VLLM_EXAMPLE_PATH.read_text())
    assert schema_errors(schema, example) == []
    spec = parse_spec(example["spec"], name=example["metadata"]["name"])
    assert (spec.engine.backend, spec.engine.device) == ("vllm", "cpu")
    assert spec.image == "ghcr.io/dpserve/runtime-vllm-cpu:0.1.0"
    # vLLM's CPU start compiles for minutes unless told to run eager.
    assert "--enforce-eager" in spec.engine.vllm_args


@pytest.mark.parametrize("spec", VALID_SPECS.values(), ids=VALID_SPECS.keys())
def test_valid_resources_pass_the_schema_and_the_operator(
    schema: dict[str, Any], spec: dict[str, Any]
) -> None:
    assert schema_errors(schema, resource(spec)) == []
    parse_spec(spec, name="demo")


# --------------------------------------------------------------------------- invalid resources


def changed(path: str, value: Any) -> dict[str, Any]:
    """MINIMAL with ``value`` at the dotted ``path`` (``...`` deletes the key)."""
    spec = copy.deepcopy(MINIMAL)
    *parents, last = path.split(".")
    node = spec
    for key in parents:
        node = node.setdefault(key, {})
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return spec


INVALID = [
    pytest.param(changed("dataParallelSize", "2"), "dataParallelSize", id="string-size"),
    pytest.param(changed("dataParallelSize", -1), "dataParallelSize", id="negative-size"),
    pytest.param(changed("dataParallelSize", 1.5), "dataParallelSize", id="fractional-size"),
    pytest.param(changed("model", ...), "model", id="missing-model"),
    pytest.param(changed("model", ""), "model", id="empty-model"),
    pytest.param(changed("image", ...), "image", id="missing-image"),
    pytest.param(changed("image", "ghcr.io/x y"), "image", id="image-with-space"),
    pytest.param(changed("engine.dtype", "fp8"), "dtype", id="bad-dtype"),
    pytest.param(changed("engine.device", "tpu"), "device", id="bad-device"),
    pytest.param(changed("engine.backend", "sglang"), "backend", id="bad-backend"),
    pytest.param(changed("engine.tensorParallelSize", 0), "tensorParallelSize", id="tp-zero"),
    pytest.param(changed("engine.tensorParallelSize", 17), "tensorParallelSize", id="tp-17"),
    pytest.param(changed("engine.image", "x y"), "image", id="engine-image-with-space"),
    pytest.param(changed("engine.vllm", {"args": "--enforce-eager"}), "args",
                 id="vllm-args-string"),
    pytest.param(changed("engine.vllm", {"args": [8192]}), "args", id="vllm-args-number"),
    pytest.param(changed("engine.vllm", {"args": ["--enforce-eager"] * 65}), "args",
                 id="vllm-args-too-many"),
    pytest.param(changed("engine.maxBatchSize", 0), "maxBatchSize", id="zero-batch"),
    pytest.param(changed("engine.terminationGracePeriodSeconds", 0),
                 "terminationGracePeriodSeconds", id="zero-grace"),
    pytest.param(changed("engine.resources.limits", {"cpu": "2 cores"}), "cpu",
                 id="bad-quantity"),
    pytest.param(changed("engine.resources.limits", {"memory": "-1Gi"}), "memory",
                 id="negative-quantity"),
    pytest.param(changed("coordinator.zmqPort", 70000), "zmqPort", id="port-70000"),
    pytest.param(changed("coordinator.httpPort", 0), "httpPort", id="port-0"),
    pytest.param(changed("coordinator.routing", "random"), "routing", id="bad-routing"),
    pytest.param(changed("imagePullPolicy", "always"), "imagePullPolicy", id="bad-pull-policy"),
    pytest.param(changed("nodeSelector", {"gpu": True}), "gpu", id="non-string-selector"),
    pytest.param(changed("tolerations", {"key": "x"}), "tolerations", id="tolerations-map"),
    pytest.param(changed("imagePullSecrets", [{}]), "imagePullSecrets", id="secret-no-name"),
    pytest.param(changed("modelVolume", {"mountPath": "/m"}), "modelVolume", id="no-claim"),
    pytest.param(changed("modelVolume", {"claimName": "w", "mountPath": "m"}), "mountPath",
                 id="relative-mount"),
    pytest.param(changed("autoscaling", {"maxReplicas": 0}), "maxReplicas", id="max-zero"),
    pytest.param(changed("autoscaling", {"maxReplicas": 2, "minReplicas": -1}), "minReplicas",
                 id="negative-min"),
    pytest.param(changed("autoscaling", {"maxReplicas": 2, "metric": "GPUUtilization"}),
                 "metric", id="bad-metric"),
    pytest.param(changed("autoscaling", {"maxReplicas": 2, "target": -1}), "target",
                 id="negative-target"),
    pytest.param(changed("autoscaling", {"mode": "Keda"}), "mode", id="bad-mode"),
    pytest.param(changed("autoscaling", {"maxReplicas": 2, "scaleDownWindowSeconds": 1.5}),
                 "scaleDownWindowSeconds", id="fractional-window"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "field"), INVALID)
def test_invalid_resources_fail_naming_the_field(
    schema: dict[str, Any], spec: dict[str, Any], field: str
) -> None:
    errors = schema_errors(schema, resource(spec))
    assert errors, "the schema accepted an invalid resource"
    described = [f"{error.json_path}: {error.message}" for error in errors]
    assert any(field in text for text in described), described


def test_missing_spec_fails(schema: dict[str, Any]) -> None:
    obj = resource(MINIMAL)
    del obj["spec"]
    (error,) = schema_errors(schema, obj)
    assert "'spec' is a required property" in error.message
