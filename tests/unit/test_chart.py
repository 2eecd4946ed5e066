"""The dpserve-operator Helm chart: lint, values schema, rendered objects, RBAC = the code's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from dpserve_operator import main, rbac
from dpserve_operator.crd import CRD_TEXT

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "dpserve-operator"
RELEASE, NAMESPACE = "dpserve-operator", "dpserve-system"
K8S_VERSIONS = ["1.25", kubernetes_validate.latest_version()]


@pytest.fixture(scope="module")
def chart() -> Iterator[helm_python.Chart]:
    with helm_python.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: helm_python.Chart, values: dict[str, Any] | None = None) -> list[dict]:
    rendered = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    objects = []
    for path, text in rendered.items():
        if path.endswith(".yaml"):
            objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = {}
    for obj in objects:
        assert obj["kind"] not in result, f"two {obj['kind']} objects"
        result[obj["kind"]] = obj
    return result


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (only,) = by_kind(objects)["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


# --------------------------------------------------------------------------- lint & values


def test_lint_passes() -> None:
    report = helm_python.lint(CHART, namespace=NAMESPACE)
    assert report["errors"] == []
    errors = [m for m in report["messages"] if m["severity"] >= 3]
    assert errors == []


def test_lint_with_single_namespace_values_passes() -> None:
    report = helm_python.lint(CHART, {"watch": {"allNamespaces": False, "namespace": "ml"}})
    assert report["errors"] == []


def test_schema_is_strict_at_the_top(chart: helm_python.Chart) -> None:
    assert chart.schema is not None
    assert chart.schema["additionalProperties"] is False
    assert set(chart.schema["properties"]) == set(chart.values)


def test_default_values_pass_the_schema(chart: helm_python.Chart) -> None:
    chart.validate_schema(chart.values)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"replicaCount": 2}, "replicaCount"),
        ({"watch": {"allNamespaces": "yes"}}, "allNamespaces"),
        ({"watch": {"namespace": "Not_A_Namespace"}}, "namespace"),
        ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"image": {"repository": "ghcr.io/dpserve/operator", "tagg": "x"}}, "tagg"),
        ({"resources": {"limits": {"memory": "lots"}}}, "memory"),
        ({"serviceAccount": {"create": "true"}}, "create"),
    ],
)
def test_schema_rejects_bad_values(
    chart: helm_python.Chart, values: dict[str, Any], named: str
) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=named):
        chart.validate_schema(values)


# --------------------------------------------------------------------------- rendered objects


@pytest.mark.parametrize("k8s", K8S_VERSIONS)
@pytest.mark.parametrize(
    "values",
    [
        {},
        {"watch": {"allNamespaces": False}},
        {
            "imagePullSecrets": [{"name": "pull"}],
            "podAnnotations": {"a": "b"},
            "podLabels": {"team": "ml"},
            "nodeSelector": {"role": "infra"},
            "tolerations": [{"key": "infra", "operator": "Exists"}],
            "affinity": {"podAntiAffinity": {}},
            "serviceAccount": {"annotations": {"iam": "role"}},
        },
    ],
    ids=["defaults", "one-namespace", "everything"],
)
def test_every_rendered_object_validates_strictly(
    chart: helm_python.Chart, values: dict[str, Any], k8s: str
) -> None:
    objects = render(chart, values)
    assert {obj["kind"] for obj in objects} == {
        "Deployment",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
    }
    for obj in objects:
        kubernetes_validate.validate(obj, k8s, strict=True)


def test_operator_deployment(chart: helm_python.Chart) -> None:
    objects = render(chart)
    deployment = by_kind(objects)["Deployment"]
    assert deployment["metadata"]["namespace"] == NAMESPACE
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    operator = operator_container(objects)
    assert operator["command"] == ["dpserve", "operator", "--all-namespaces"]
    assert operator["image"] == "ghcr.io/dpserve/operator:0.1.0"  # appVersion
    liveness = operator["livenessProbe"]["httpGet"]
    assert liveness["path"] == main.LIVENESS_PATH
    port = {p["name"]: p["containerPort"] for p in operator["ports"]}[liveness["port"]]
    assert port == 8080  # main.run's default liveness port
    context = operator["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["runAsNonRoot"] is True and context["runAsUser"] == 10001
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["serviceAccountName"] == by_kind(objects)["ServiceAccount"]["metadata"]["name"]


@pytest.mark.parametrize(
    ("watch", "expected"),
    [
        ({"allNamespaces": False}, ["--namespace", NAMESPACE]),
        ({"allNamespaces": False, "namespace": "ml"}, ["--namespace", "ml"]),
        ({"allNamespaces": True, "namespace": "ml"}, ["--all-namespaces"]),
    ],
)
def test_watched_namespaces(
    chart: helm_python.Chart, watch: dict[str, Any], expected: list[str]
) -> None:
    command = operator_container(render(chart, {"watch": watch}))["command"]
    assert command == ["dpserve", "operator", *expected]


def test_image_tag_and_pull_policy_values(chart: helm_python.Chart) -> None:
    values = {"image": {"repository": "registry.local/op", "tag": "dev", "pullPolicy": "Always"}}
    operator = operator_container(render(chart, values))
    assert operator["image"] == "registry.local/op:dev"
    assert operator["imagePullPolicy"] == "Always"


def test_rbac_and_service_account_can_be_left_out(chart: helm_python.Chart) -> None:
    values = {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "ops"}}
    objects = by_kind(render(chart, values))
    assert set(objects) == {"Deployment"}
    assert objects["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


def test_binding_grants_the_role_to_the_operator(chart: helm_python.Chart) -> None:
    objects = by_kind(render(chart))
    binding = objects["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == objects["ClusterRole"]["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": objects["ServiceAccount"]["metadata"]["name"],
            "namespace": NAMESPACE,
        }
    ]


# --------------------------------------------------------------------------- RBAC


def granted(cluster_role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in cluster_role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_cluster_role_grants_exactly_what_the_operator_uses(chart: helm_python.Chart) -> None:
    role = by_kind(render(chart))["ClusterRole"]
    assert granted(role) == set(rbac.PERMISSIONS)
    assert not any("*" in rule["verbs"] or "*" in rule["resources"] for rule in role["rules"])


def test_the_code_refuses_undeclared_permissions() -> None:
    rbac.require("apps", "statefulsets", "patch")
    with pytest.raises(rbac.UndeclaredPermission, match="deployments"):
        rbac.require("apps", "deployments", "delete")


# --------------------------------------------------------------------------- CRD


def test_chart_ships_the_crd(chart: helm_python.Chart) -> None:
    (crd,) = chart.crds
    assert crd["filename"].endswith("crds/inferencedeployment.yaml")
    assert crd["data"] == CRD_TEXT


def test_the_notes_point_at_both_examples_and_each_is_a_valid_resource(
    chart: helm_python.Chart,
) -> None:
    from dpserve_operator.spec import parse_spec

    notes = chart.render({}, name=RELEASE, namespace=NAMESPACE)
    (text,) = [body for path, body in notes.items() if path.endswith("NOTES.txt")]
    backends = {}
    for example in ("examples/inference.yaml", "examples/inference-vllm.yaml"):
        assert example in text, example
        resource = yaml.safe_load((ROOT / example).read_text())
        spec = parse_spec(resource["spec"], name=resource["metadata"]["name"])
        backends[example] = spec.engine.backend
    assert backends == {
        "examples/inference.yaml": "dpserve",
        "examples/inference-vllm.yaml": "vllm",
    }
