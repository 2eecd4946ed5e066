"""The operator's only door to the API server.

It speaks plain REST through the official (sync) ``kubernetes`` client's connection and auth
handling, with dicts in and out: the manifests stay plain data, and ``policy/v1beta1``
PodDisruptionBudgets, which Kubernetes 1.20 needs, have no typed API in current clients.

Every request first checks its (group, resource, verb) against ``rbac.REQUIRED_RULES``.
Writes are read-then-create-or-replace: the object is written only when the live one does not
already contain the desired fields, so re-running a reconcile is free and idempotent.

Why not server-side apply (measured against the v1.20.2 API server of tests/e2e, applying
these very children with ``fieldManager=dpserve-operator, force=true``): a no-op apply is not
free there. The engine NetworkPolicy (``ingress: []``, stored as absent) gets a new
resourceVersion and generation on every apply, and the StatefulSet a new resourceVersion
(only its managedFields time changes), so each reconcile would write and wake watchers unless
the desired objects were normalised first, which is what ``contains`` does. And children that
this code created are owned by the client's default manager (``OpenAPI-Generator``, Update):
after a switch to apply, a field dropped from the spec (an env var) stayed on the object until
that manager's managedFields entry was migrated.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import quote

import urllib3
from kubernetes import config
from kubernetes.client import ApiClient, Configuration
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.utils.quantity import parse_quantity

from . import crd, rbac

logger = logging.getLogger(__name__)

# The kinds the operator writes, and their REST resource names.
KIND_RESOURCES: dict[str, str] = {
    "Deployment": "deployments",
    "StatefulSet": "statefulsets",
    "Service": "services",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
    "Secret": "secrets",
}

ApplyResult = Literal["created", "updated", "unchanged"]

DEFAULT_TIMEOUT = (5.0, 15.0)  # (connect, read) seconds
HEALTH_TIMEOUT = (2.0, 3.0)
# Loading an adapter waits for every engine to read it from its directory.
ADAPTER_TIMEOUT = (2.0, 30.0)
# The HTTP front's alternative to Authorization (dpserve.openai.app.API_KEY_HEADER).
API_KEY_HEADER = "X-Api-Key"


class ApiError(Exception):
    """A failed API request; ``status`` 0 means no HTTP answer at all."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        super().__init__(f"{status} {reason}: {message}")

    @property
    def transient(self) -> bool:
        """Worth retrying as is: conflicts, throttling, server and network trouble."""
        return self.status in (0, 408, 409, 429) or self.status >= 500


def api_group(api_version: str) -> str:
    return api_version.split("/", 1)[0] if "/" in api_version else ""


def resource_path(
    api_version: str,
    resource: str,
    namespace: str | None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace is not None:
        path += f"/namespaces/{namespace}"
    path += f"/{resource}"
    if name is not None:
        path += f"/{name}"
    if subresource is not None:
        path += f"/{subresource}"
    return path


def choose_pdb_api_version(policy_group: Mapping[str, Any] | None) -> str:
    """``policy/v1`` when served (Kubernetes >= 1.21), else ``policy/v1beta1`` (1.20).

    ``policy_group`` is the discovery document of ``GET /apis/policy``.
    """
    served = {version.get("groupVersion") for version in (policy_group or {}).get("versions") or []}
    if "policy/v1" in served or not served:
        return "policy/v1"
    return "policy/v1beta1"


def load_configuration() -> Configuration:
    """Credentials: in a pod its service account, elsewhere ``$KUBECONFIG``/``~/.kube/config``.

    Both kopf (see ``handlers.login``) and ``Cluster`` use this, so they always act as the
    same identity.
    """
    configuration = Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except ConfigException:
        # The client reads $KUBECONFIG once, at import time; read it now instead.
        config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG") or None, client_configuration=configuration
        )
    return configuration


def bearer_token(configuration: Configuration) -> tuple[str | None, str | None]:
    """(scheme, token) of the configuration's Authorization header, if any."""
    # kubernetes >= 36 keeps the header under "BearerToken", older ones under "authorization".
    header = configuration.get_api_key_with_prefix(
        "BearerToken"
    ) or configuration.get_api_key_with_prefix("authorization")
    if not header:
        return None, None
    scheme, _, token = header.partition(" ")
    return (scheme, token) if token else (None, scheme)


class Cluster:
    def __init__(self, api_client: ApiClient) -> None:
        self.api_client = api_client
        self._pdb_api_version: str | None = None

    @classmethod
    def from_environment(cls) -> Cluster:
        return cls(ApiClient(load_configuration()))

    # ------------------------------------------------------------------ raw requests

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        timeout: tuple[float, float] = DEFAULT_TIMEOUT,
        ok_statuses: tuple[int, ...] = (),
        extra_headers: Mapping[str, str] | None = None,
    ) -> tuple[int, Any]:
        """Send one request; returns (HTTP status, decoded JSON or text).

        Raises ``ApiError`` for non-2xx answers not listed in ``ok_statuses``.
        """
        headers = {"Accept": "application/json", **(extra_headers or {})}
        if body is not None:
            headers["Content-Type"] = content_type
        serialized = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = self.api_client.call_api(*serialized, _request_timeout=timeout)
            raw = response.read()
        except ApiException as error:  # raised for TLS failures, with status 0
            raise ApiError(error.status or 0, "ConnectionError", str(error.reason)) from error
        except urllib3.exceptions.HTTPError as error:
            raise ApiError(0, type(error).__name__, str(error)) from error
        payload = _decode(raw)
        if 200 <= response.status < 300 or response.status in ok_statuses:
            return response.status, payload
        if isinstance(payload, Mapping):
            reason = str(payload.get("reason") or response.reason or "")
            message = str(payload.get("message") or payload)
        else:
            reason, message = str(response.reason or ""), str(payload)[:500]
        raise ApiError(response.status, reason, message)

    # ------------------------------------------------------------------ objects

    # The API server answers a GET, POST or PUT of an object with that object as JSON, which
    # read, create and replace return as such.
    def read(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        resource = KIND_RESOURCES[kind]
        rbac.require(api_group(api_version), resource, "get")
        status, payload = self.request(
            "GET", resource_path(api_version, resource, namespace, name), ok_statuses=(404,)
        )
        live: dict[str, Any] | None = None if status == 404 else payload
        return live

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        api_version, resource, namespace, _ = _address(manifest)
        rbac.require(api_group(api_version), resource, "create")
        _, payload = self.request(
            "POST", resource_path(api_version, resource, namespace), body=dict(manifest)
        )
        created: dict[str, Any] = payload
        return created

    def replace(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        api_version, resource, namespace, name = _address(manifest)
        rbac.require(api_group(api_version), resource, "update")
        _, payload = self.request(
            "PUT", resource_path(api_version, resource, namespace, name), body=dict(manifest)
        )
        replaced: dict[str, Any] = payload
        return replaced

    def apply(self, desired: Mapping[str, Any]) -> ApplyResult:
        """Create ``desired``, or replace the live object unless it already matches."""
        api_version, _, namespace, name = _address(desired)
        live = self.read(api_version, desired["kind"], namespace, name)
        if live is None:
            self.create(desired)
            return "created"
        if contains(live, desired):
            return "unchanged"
        self.replace(replacement_for(desired, live))
        return "updated"

    def scale_statefulset(self, namespace: str, name: str, replicas: int) -> bool:
        """Patch only ``spec.replicas``; False when the StatefulSet does not exist (yet)."""
        rbac.require("apps", "statefulsets", "patch")
        status, _ = self.request(
            "PATCH",
            resource_path("apps/v1", "statefulsets", namespace, name),
            body={"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
            ok_statuses=(404,),
        )
        return status != 404

    def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """The pods matching ``label_selector`` in ``namespace``."""
        rbac.require("", "pods", "list")
        path = resource_path("v1", "pods", namespace)
        _, payload = self.request("GET", f"{path}?labelSelector={quote(label_selector)}")
        items: list[dict[str, Any]] = (payload or {}).get("items") or []
        return items

    # ------------------------------------------------------------------ coordinator health

    def coordinator_health(
        self, namespace: str, service: str, port_name: str
    ) -> tuple[dict[str, Any] | None, str | None]:
        """The coordinator's ``/ready`` JSON via the API server's service proxy.

        Returns (body, None), also for a 503 (the coordinator answers 503 + JSON while no
        engine is registered and accepting), or (None, why) when it could not be asked.
        """
        rbac.require("", "services/proxy", "get")
        path = resource_path("v1", "services", namespace, f"{service}:{port_name}", "proxy/ready")
        try:
            status, payload = self.request("GET", path, timeout=HEALTH_TIMEOUT, ok_statuses=(503,))
        except ApiError as error:
            return None, f"GET /ready via the service proxy failed: {error}"
        # A 503 from the API server itself ("no endpoints available") is a Status object.
        if (
            isinstance(payload, Mapping)
            and payload.get("kind") != "Status"
            and ("engines" in payload)
        ):
            return dict(payload), None
        detail = payload.get("message") if isinstance(payload, Mapping) else payload
        return None, f"/ready answered {status}: {str(detail)[:200]}"

    # ------------------------------------------------------------------ autoscaling

    def coordinator_metrics(self, namespace: str, service: str, port_name: str) -> str:
        """The coordinator's ``/metrics`` page (Prometheus text) via the service proxy; raises
        ``ApiError`` when it cannot be had."""
        rbac.require("", "services/proxy", "get")
        path = resource_path("v1", "services", namespace, f"{service}:{port_name}", "proxy/metrics")
        _, payload = self.request("GET", path, timeout=HEALTH_TIMEOUT)
        if not isinstance(payload, str):
            raise ApiError(200, "NotMetrics", f"/metrics answered {str(payload)[:200]}")
        return payload

    # ------------------------------------------------------------------ LoRA adapters

    def coordinator_post(
        self,
        namespace: str,
        service: str,
        port_name: str,
        endpoint: str,
        body: Mapping[str, Any],
        api_key: str,
    ) -> tuple[int, Any]:
        """POST ``body`` to the coordinator's HTTP ``endpoint`` via the service proxy; returns
        the front's (status, decoded body), also for its 4xx refusals. ``api_key``
        goes as ``X-Api-Key``: the API server drops an Authorization header after using it
        to authenticate this operator. Raises ``ApiError`` when the front was not reached."""
        rbac.require("", "services/proxy", "create")
        path = resource_path(
            "v1", "services", namespace, f"{service}:{port_name}", f"proxy{endpoint}"
        )
        return self.request(
            "POST",
            path,
            body=dict(body),
            timeout=ADAPTER_TIMEOUT,
            # The front's refusals (a bad key, no admin role, the engines' reasons) are
            # answers to report, not failures to reach it.
            ok_statuses=(400, 401, 403, 404),
            extra_headers={API_KEY_HEADER: api_key},
        )

    def coordinator_get(
        self, namespace: str, service: str, port_name: str, endpoint: str, api_key: str
    ) -> Any:
        """GET the coordinator's HTTP ``endpoint`` (JSON) via the service proxy, the key as
        for ``coordinator_post``; raises ``ApiError`` when it cannot be had."""
        rbac.require("", "services/proxy", "get")
        path = resource_path(
            "v1", "services", namespace, f"{service}:{port_name}", f"proxy{endpoint}"
        )
        _, payload = self.request(
            "GET", path, timeout=HEALTH_TIMEOUT, extra_headers={API_KEY_HEADER: api_key}
        )
        return payload

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        """Set an InferenceDeployment's engine count through its scale subresource (what an
        HPA or ``kubectl scale`` does): ``spec.dataParallelSize``."""
        rbac.require(crd.GROUP, f"{crd.PLURAL}/scale", "patch")
        self.request(
            "PATCH",
            resource_path(crd.API_VERSION, crd.PLURAL, namespace, name, "scale"),
            body={"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
        )

    # ------------------------------------------------------------------ discovery

    def pdb_api_version(self) -> str:
        """The PodDisruptionBudget apiVersion this server serves (asked once, then cached)."""
        if self._pdb_api_version is None:
            # Discovery is a non-resource URL every authenticated user may read.
            status, payload = self.request("GET", "/apis/policy", ok_statuses=(404,))
            self._pdb_api_version = choose_pdb_api_version(
                payload if status == 200 and isinstance(payload, Mapping) else None
            )
        return self._pdb_api_version


def _address(manifest: Mapping[str, Any]) -> tuple[str, str, str, str]:
    metadata = manifest["metadata"]
    return (
        manifest["apiVersion"],
        KIND_RESOURCES[manifest["kind"]],
        metadata["namespace"],
        metadata["name"],
    )


def _decode(raw: bytes | None) -> Any:
    if not raw:
        return None
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


# --------------------------------------------------------------------------- pure helpers

# Quantities the API server rewrites into canonical form ("0.5" → "500m").
_QUANTITY_PARENTS = frozenset({"requests", "limits"})


def contains(live: Any, desired: Any, *, quantities: bool = False) -> bool:
    """Whether ``live`` already holds every field of ``desired`` with the same value.

    Fields the server added (defaults, status) are ignored; a field the server omitted is
    equal to an empty desired value (Go's ``omitempty`` drops ``[]``, ``{}``, ``false``).
    Under ``requests``/``limits`` values compare as quantities (``0.5`` == ``500m``).
    """
    if isinstance(desired, Mapping):
        if live is None:
            return not desired
        if not isinstance(live, Mapping):
            return False
        return all(
            contains(live.get(key), value, quantities=quantities or key in _QUANTITY_PARENTS)
            for key, value in desired.items()
        )
    if isinstance(desired, list):
        if live is None:
            return not desired
        if not isinstance(live, list) or len(live) != len(desired):
            return False
        return all(contains(item, want) for item, want in zip(live, desired, strict=True))
    if live is None:
        return desired in (None, "", False, 0)
    if quantities:
        try:
            return bool(parse_quantity(live) == parse_quantity(desired))
        except ValueError:
            return bool(live == desired)
    return live == desired and type(live) is type(desired)


def replacement_for(desired: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    """The full object to PUT: ``desired`` plus what others legitimately keep on it.

    Kept from the live object: resourceVersion (optimistic concurrency), foreign labels,
    annotations, finalizers and owner references, the Service's allocated cluster IPs, and
    pod-template annotations (``kubectl rollout restart`` stamps one there).
    """
    replacement = copy.deepcopy(dict(desired))
    live_meta = live.get("metadata") or {}
    meta = replacement.setdefault("metadata", {})
    if live_meta.get("resourceVersion"):
        meta["resourceVersion"] = live_meta["resourceVersion"]
    for key in ("labels", "annotations"):
        merged = {**(live_meta.get(key) or {}), **(meta.get(key) or {})}
        if merged:
            meta[key] = merged
    if live_meta.get("finalizers"):
        meta["finalizers"] = list(live_meta["finalizers"])
    ours = {ref.get("uid") for ref in meta.get("ownerReferences") or []}
    foreign = [ref for ref in live_meta.get("ownerReferences") or [] if ref.get("uid") not in ours]
    if foreign:
        meta["ownerReferences"] = [*(meta.get("ownerReferences") or []), *foreign]

    if "spec" not in replacement:  # a Secret
        return replacement
    live_spec = live.get("spec") or {}
    spec = replacement["spec"]
    if desired.get("kind") == "Service":
        for key in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"):
            if key not in spec and key in live_spec:
                spec[key] = copy.deepcopy(live_spec[key])
    live_template_meta = (live_spec.get("template") or {}).get("metadata") or {}
    if "template" in spec and live_template_meta.get("annotations"):
        template_meta = spec["template"].setdefault("metadata", {})
        template_meta["annotations"] = {
            **live_template_meta["annotations"],
            **(template_meta.get("annotations") or {}),
        }
    return replacement
