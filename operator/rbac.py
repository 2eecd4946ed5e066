"""Every Kubernetes API permission the operator uses, in one table.

``cluster.Cluster`` refuses to send a request whose (group, resource, verb) is not declared
here, and the Helm chart's ClusterRole is tested to grant exactly this set: adding an API call
without adding its permission fails in the unit tests instead of with a 403 in production.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .crd import GROUP, PLURAL


@dataclass(frozen=True)
class Rule:
    api_group: str
    resource: str
    verbs: frozenset[str]
    why: str


def _rule(api_group: str, resource: str, verbs: Iterable[str], why: str) -> Rule:
    return Rule(api_group, resource, frozenset(verbs), why)


# fmt: off
REQUIRED_RULES: tuple[Rule, ...] = (
    # --- kopf itself
    _rule(GROUP, PLURAL, ["list", "watch", "patch"],
          "kopf lists/watches the resources and patches its progress annotations"),
    _rule(GROUP, f"{PLURAL}/status", ["patch"],
          "kopf merge-patches the status written by the handlers"),
    _rule("apiextensions.k8s.io", "customresourcedefinitions", ["list", "watch"],
          "kopf notices the CRD being (re)installed"),
    _rule("", "namespaces", ["list", "watch"],
          "kopf resolves --namespace patterns when not cluster-wide"),
    _rule("", "events", ["create"],
          "kopf.info/kopf.warn post events on the InferenceDeployment"),
    # --- the handlers (cluster.Cluster)
    _rule(GROUP, f"{PLURAL}/finalizers", ["update"],
          "children carry blockOwnerDeletion owner references, which the "
          "OwnerReferencesPermissionEnforcement admission plugin checks against this"),
    _rule(GROUP, f"{PLURAL}/scale", ["patch"],
          "the built-in autoscaler sets spec.dataParallelSize through the scale subresource"),
    _rule("apps", "deployments", ["get", "create", "update"],
          "coordinator Deployment: read-then-create-or-replace"),
    _rule("apps", "statefulsets", ["get", "create", "update", "patch"],
          "engine StatefulSet: read-then-create-or-replace, and patch replicas on scaling"),
    _rule("", "services", ["get", "create", "update"],
          "coordinator Service and engine headless Service"),
    _rule("", "pods", ["list"],
          "the status names a child pod that is OOM-killed, crash-looping, unschedulable or "
          "cannot pull its image, with the pod's own message"),
    _rule("", "services/proxy", ["get", "create"],
          "GET the coordinator's /ready (status) and /metrics (autoscaler, adapters), and POST "
          "its /v1/load_lora_adapter and /v1/unload_lora_adapter (spec.adapters), through the "
          "API server's service proxy"),
    _rule("policy", "poddisruptionbudgets", ["get", "create", "update"],
          "engine PodDisruptionBudget (policy/v1 or policy/v1beta1)"),
    _rule("networking.k8s.io", "networkpolicies", ["get", "create", "update"],
          "coordinator and engine NetworkPolicies"),
    _rule("", "secrets", ["get", "create", "update"],
          "<name>-credentials (CURVE keys; read to notice a deletion, which rotates them) and "
          "<name>-client-credentials"),
)
# fmt: on


def permission_set(rules: Iterable[Rule] = REQUIRED_RULES) -> frozenset[tuple[str, str, str]]:
    """The rules flattened to (api_group, resource, verb) triples."""
    return frozenset((rule.api_group, rule.resource, verb) for rule in rules for verb in rule.verbs)


PERMISSIONS = permission_set()


class UndeclaredPermission(RuntimeError):
    """The code is about to use an API permission missing from REQUIRED_RULES (a bug)."""


def require(api_group: str, resource: str, verb: str) -> None:
    if (api_group, resource, verb) not in PERMISSIONS:
        raise UndeclaredPermission(
            f"{verb} {resource!r} in API group {api_group!r} is not declared in "
            "dpserve_operator.rbac.REQUIRED_RULES (and so not granted by the Helm chart)"
        )
