"""Parse and validate an InferenceDeployment's ``spec`` into a frozen ``DeploymentSpec``.

The CRD's OpenAPI schema already rejects wrong types, bad enums and out-of-range numbers at
the API server; this module repeats those checks (objects written before the CRD was
installed, or a server that does not apply the schema, must not crash the operator) and adds
what a structural schema on Kubernetes 1.20 cannot express: names too long for the children,
port collisions, malformed image references, GPU requests that differ from limits or from the
tensor-parallel size, tensor parallelism where it cannot run, vLLM flags outside the allow-list
(``vllm_args``), requests above limits, reserved labels and environment variables.

The repeated checks take their defaults, enums, bounds and required fields from the CRD
itself (``crd.SPEC_SCHEMA``): each ``_Reader`` walks the schema alongside the data, so a
default is written once, in the CRD.

Every problem found is reported at once, each prefixed with its field path.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from dpserve import cpu_settings
from dpserve.limits import DEFAULT_LORA_LIMITS
from dpserve.sampling import InvalidSamplingParams, check_lora_name

from .crd import SPEC_SCHEMA
from .limits import parse_limits
from .vllm_args import VllmArgsError, parse_vllm_args

# Writable scratch directories (emptyDirs, the root filesystem is read-only): the model must
# not be mounted over them.
SCRATCH_DIR = "/tmp"
CACHE_DIR = "/home/dpserve/.cache"

# spec.autoscaling.mode Builtin: the operator sizes the engines; External: an HPA or KEDA
# does, through the scale subresource, and the operator only keeps the coordinator holding
# requests at zero engines.
BUILTIN = "Builtin"
# The values of spec.autoscaling.metric that operator/autoscaling.py knows how to read
# (tests/unit/test_crd.py fails when the CRD's enum offers one it does not).
QUEUED_REQUESTS_PER_ENGINE, KV_CACHE_USAGE, TTFT_P90 = (
    "QueuedRequestsPerEngine",
    "KVCacheUsage",
    "TTFTP90",
)
# The target each metric gets when spec.autoscaling.target is left out (TTFT has none: its
# target is the service level objective, which only the user knows). The CRD's description
# of `target` states these in words.
DEFAULT_TARGETS = {QUEUED_REQUESTS_PER_ENGINE: 0.0, KV_CACHE_USAGE: 0.8}

GPU_RESOURCE = "nvidia.com/gpu"

# spec.engine.backend: dpserve's own engine, or vLLM's behind dpserve's protocol.
DPSERVE_BACKEND, VLLM_BACKEND = "dpserve", "vllm"
# spec.engine.cpuWeights' default (the CRD's): engines are then started without the flag.
DEFAULT_CPU_WEIGHTS = "fp32"

# spec.adapterVolume is mounted here (read-only) in the engine pods; spec.adapters' paths
# point under it or under spec.modelVolume.mountPath.
ADAPTER_MOUNT_PATH = "/adapters"
DEFAULT_LORA_PATH_CHARS = DEFAULT_LORA_LIMITS.max_lora_path_chars

# `<name>-engine` must leave room for the StatefulSet's `controller-revision-hash` label value
# (`<sts name>-<10 char hash>`, at most 63 characters): 63 - 11 - len("-engine") = 45.
MAX_NAME_LENGTH = 45

# Environment variables the pods rely on; the engine's rank comes from POD_NAME.
RESERVED_ENV = frozenset({"POD_NAME"})

# Label keys the operator sets on pods (the selectors depend on them).
RESERVED_LABEL_PREFIX = "app.kubernetes.io/"

_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")

# A pragmatic image reference grammar (after github.com/distribution/reference): an optional
# registry host[:port], lowercase path components, an optional tag and an optional digest.
_IMAGE_HOST_PART = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_IMAGE_DOMAIN = rf"(?:{_IMAGE_HOST_PART}(?:\.{_IMAGE_HOST_PART})*(?::[0-9]+)?)"
_IMAGE_PATH = r"(?:[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)"
_IMAGE_REFERENCE = re.compile(
    rf"^(?:{_IMAGE_DOMAIN}/)?{_IMAGE_PATH}(?:/{_IMAGE_PATH})*"
    r"(?::[\w][\w.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)


class InvalidSpec(ValueError):
    """The spec cannot be turned into workloads; ``problems`` lists every reason."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class Resources:
    """Container resource requests/limits, quantities as strings."""

    requests: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    limits: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def to_manifest(self) -> dict[str, dict[str, str]]:
        manifest: dict[str, dict[str, str]] = {}
        if self.requests:
            manifest["requests"] = dict(self.requests)
        if self.limits:
            manifest["limits"] = dict(self.limits)
        return manifest


@dataclass(frozen=True)
class ModelVolume:
    claim_name: str
    mount_path: str
    read_only: bool


@dataclass(frozen=True)
class EngineSpec:
    resources: Resources
    max_batch_size: int
    dtype: str
    device: str
    termination_grace_period_seconds: int
    env: tuple[Mapping[str, Any], ...]
    prefix_caching: bool = True  # share KV blocks of equal prompt prefixes (--no-prefix-caching)
    backend: str = DPSERVE_BACKEND
    # GPUs one engine shards the model over (vLLM's tensor parallelism); 1 on CPU.
    tensor_parallel_size: int = 1
    # The engines' image when it is not DeploymentSpec.image.
    image: str | None = None
    # spec.engine.vllm.args, checked and in one form (vllm_args.parse_vllm_args).
    vllm_args: tuple[str, ...] = ()
    # spec.engine.maxLoras: LoRA slots per engine (--max-loras); None: the engine's default.
    max_loras: int | None = None
    # spec.engine.cpuWeights: how a CPU engine holds its projection weights (--cpu-weights).
    cpu_weights: str = DEFAULT_CPU_WEIGHTS


@dataclass(frozen=True)
class CoordinatorSpec:
    zmq_port: int
    http_port: int
    routing: str
    resources: Resources
    # spec.coordinator.toolCallParser (--tool-call-parser); None: tool_choice auto refused.
    tool_call_parser: str | None = None
    # spec.coordinator.reasoningParser (--reasoning-parser); None: the thought stays in content.
    reasoning_parser: str | None = None
    # spec.coordinator.chatTemplate (--chat-template, the text); None: the model's own.
    chat_template: str | None = None
    # (dpserve.limits field name, value) of each limit set in spec.coordinator.limits.
    limits: tuple[tuple[str, int | float], ...] = ()


@dataclass(frozen=True)
class AutoscalingSpec:
    """``spec.autoscaling``: its presence turns autoscaling on (``dataParallelSize`` is then
    the current engine count, written through the scale subresource)."""

    mode: str
    min_replicas: int
    # None only in External mode (the HPA or ScaledObject has its own bounds).
    max_replicas: int | None
    metric: str
    target: float
    scale_up_window_seconds: int
    scale_down_window_seconds: int
    idle_before_zero_seconds: int

    @property
    def builtin(self) -> bool:
        return self.mode == BUILTIN

    @property
    def from_zero(self) -> bool:
        """Engines may be scaled to zero: the coordinator holds requests meanwhile."""
        return self.min_replicas == 0 or not self.builtin


@dataclass(frozen=True)
class Adapter:
    """One of ``spec.adapters``: a LoRA adapter's name and its directory in the engine pods."""

    name: str
    path: str


@dataclass(frozen=True)
class AdaptersSpec:
    """``spec.adapters`` (present, even empty: the engines serve adapters) and the volume
    they may come from besides the model's."""

    adapters: tuple[Adapter, ...]
    # spec.adapterVolume.claimName, mounted at ADAPTER_MOUNT_PATH; None without one.
    volume_claim: str | None = None

    def wanted(self) -> dict[str, str]:
        """name -> path of every adapter the coordinator should hold."""
        return {adapter.name: adapter.path for adapter in self.adapters}


@dataclass(frozen=True)
class PodTemplateOverrides:
    labels: Mapping[str, str]
    annotations: Mapping[str, str]


@dataclass(frozen=True)
class DeploymentSpec:
    model: str
    image: str
    image_pull_policy: str | None
    data_parallel_size: int
    engine: EngineSpec
    coordinator: CoordinatorSpec
    model_volume: ModelVolume | None
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    affinity: Mapping[str, Any] | None
    image_pull_secrets: tuple[str, ...]
    service_account_name: str | None
    allowed_clients: tuple[Mapping[str, Any], ...]
    pod_template: PodTemplateOverrides
    autoscaling: AutoscalingSpec | None = None
    adapters: AdaptersSpec | None = None


def freeze(value: Any) -> Any:
    """Read-only deep copy of JSON data (dicts become mapping proxies, lists tuples)."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(key): freeze(item) for key, item in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze(item) for item in value)
    return value


def thaw(value: Any) -> Any:
    """Plain, independent JSON data (dicts and lists) from ``freeze``'s output."""
    if isinstance(value, Mapping):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(item) for item in value]
    return value


_MISSING: Any = object()


class _Reader:
    """Typed access to one object of the spec, recording problems instead of raising.

    ``schema`` is the object's node in the CRD's schema: defaults, enums, bounds and required
    fields come from there. Asking for a field the schema lacks is a bug in this module, and
    raises ``KeyError`` at once (every field is read on every parse, so the unit tests see it).
    """

    def __init__(
        self, data: Any, path: str, problems: list[str], schema: Mapping[str, Any]
    ) -> None:
        self.path = path
        self.problems = problems
        self.schema = schema
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            self.fail(path, f"must be an object, got {_describe(data)}")
            data = {}
        self.data: Mapping[str, Any] = data

    def fail(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}")

    def at(self, key: str) -> str:
        return f"{self.path}.{key}"

    def get(self, key: str) -> Any:
        value = self.data.get(key, _MISSING)
        return _MISSING if value is None else value

    def field(self, key: str) -> Mapping[str, Any]:
        """The CRD's schema of ``key``."""
        try:
            node: Mapping[str, Any] = self.schema["properties"][key]
        except KeyError:
            raise KeyError(f"{self.at(key)} is not in the CRD's schema") from None
        return node

    def default(self, key: str) -> Any:
        """The CRD's default of ``key``."""
        field = self.field(key)
        if "default" not in field:
            raise KeyError(f"{self.at(key)} has no default in the CRD's schema")
        return field["default"]

    def string(self, key: str) -> str | None:
        """The string at ``key``; the CRD's default (or None) when absent or invalid."""
        default: str | None = self.field(key).get("default")
        required = key in self.schema.get("required", ())
        value = self.get(key)
        if value is _MISSING:
            if required:
                self.fail(self.at(key), "is required")
            return default
        if not isinstance(value, str):
            self.fail(self.at(key), f"must be a string, got {_describe(value)}")
            return default
        if required and not value.strip():
            self.fail(self.at(key), "must not be empty")
            return default
        field = self.field(key)
        minimum = field.get("minLength", 0)
        if len(value) < minimum:
            shortest = "not be empty" if minimum == 1 else f"have at least {minimum} characters"
            self.fail(self.at(key), f"must {shortest}")
            return default
        if "maxLength" in field and len(value) > field["maxLength"]:
            self.fail(self.at(key), f"must have at most {field['maxLength']} characters")
            return default
        return value

    def integer(self, key: str) -> int:
        """The integer at ``key``, within the CRD's bounds; the CRD's default otherwise."""
        value = self.optional_integer(key)
        default: int = self.default(key)
        return default if value is None else value

    def optional_integer(self, key: str) -> int | None:
        """The integer at ``key``, within the CRD's bounds; None when absent or invalid."""
        field = self.field(key)
        value = self.get(key)
        if value is _MISSING:
            return None
        # bool is an int subclass in Python, but `true` is not a number in the spec.
        if not isinstance(value, int) or isinstance(value, bool):
            self.fail(self.at(key), f"must be an integer, got {_describe(value)}")
            return None
        minimum, maximum = field.get("minimum"), field.get("maximum")
        if minimum is not None and value < minimum:
            self.fail(self.at(key), f"must be >= {minimum}, got {value}")
            return None
        if maximum is not None and value > maximum:
            self.fail(self.at(key), f"must be <= {maximum}, got {value}")
            return None
        return value

    def boolean(self, key: str) -> bool:
        default: bool = self.default(key)
        value = self.get(key)
        if value is _MISSING:
            return default
        if not isinstance(value, bool):
            self.fail(self.at(key), f"must be true or false, got {_describe(value)}")
            return default
        return value

    def number(self, key: str, *, default: float | None) -> float | None:
        """The number at ``key``, at least the CRD's minimum; ``default`` otherwise (the one
        number field has a default that depends on another field, so the caller gives it)."""
        minimum: float = self.field(key)["minimum"]
        value = self.get(key)
        if value is _MISSING:
            return default
        if not isinstance(value, int | float) or isinstance(value, bool):
            self.fail(self.at(key), f"must be a number, got {_describe(value)}")
            return default
        if value < minimum:
            self.fail(self.at(key), f"must be >= {minimum:g}, got {value}")
            return default
        return float(value)

    def choice(self, key: str) -> str:
        """One of the CRD's enum at ``key``; the CRD's default when absent or invalid."""
        default: str = self.default(key)
        return self.optional_choice(key) or default

    def optional_choice(self, key: str) -> str | None:
        """One of the CRD's enum at ``key``; None when absent or invalid."""
        choices: list[str] = self.field(key)["enum"]
        value = self.get(key)
        if value is _MISSING:
            return None
        if value not in choices:
            self.fail(self.at(key), f"must be one of {', '.join(choices)}; got {value!r}")
            return None
        return str(value)

    def child(self, key: str) -> _Reader:
        return _Reader(self.data.get(key), self.at(key), self.problems, self.field(key))

    def string_map(self, key: str) -> dict[str, str]:
        self.field(key)
        value = self.get(key)
        if value is _MISSING:
            return {}
        if not isinstance(value, Mapping):
            self.fail(self.at(key), f"must be a map of strings, got {_describe(value)}")
            return {}
        result: dict[str, str] = {}
        for item_key, item in value.items():
            if not isinstance(item, str):
                self.fail(f"{self.at(key)}.{item_key}", f"must be a string, got {_describe(item)}")
            else:
                result[str(item_key)] = item
        return result

    def object_list(self, key: str) -> list[Mapping[str, Any]]:
        self.field(key)
        value = self.get(key)
        if value is _MISSING:
            return []
        if not isinstance(value, list):
            self.fail(self.at(key), f"must be a list, got {_describe(value)}")
            return []
        result: list[Mapping[str, Any]] = []
        for index, item in enumerate(value):
            if not isinstance(item, Mapping):
                self.fail(f"{self.at(key)}[{index}]", f"must be an object, got {_describe(item)}")
            else:
                result.append(item)
        return result

    def string_list(self, key: str) -> list[str]:
        """The list of strings at ``key``, within the CRD's maxItems and items' maxLength."""
        field = self.field(key)
        value = self.get(key)
        if value is _MISSING:
            return []
        if not isinstance(value, list):
            self.fail(self.at(key), f"must be a list of strings, got {_describe(value)}")
            return []
        if len(value) > field["maxItems"]:
            self.fail(
                self.at(key), f"must have at most {field['maxItems']} items, got {len(value)}"
            )
            return []
        result: list[str] = []
        for index, item in enumerate(value):
            max_length = field["items"]["maxLength"]
            if not isinstance(item, str) or not item:
                self.fail(f"{self.at(key)}[{index}]", f"must be a string, got {_describe(item)}")
            elif len(item) > max_length:
                self.fail(f"{self.at(key)}[{index}]", f"is longer than {max_length} characters")
            else:
                result.append(item)
        return result

    def resources(self, key: str) -> Resources:
        reader = self.child(key)
        requests = _quantities(reader, "requests")
        limits = _quantities(reader, "limits")
        # Extended resources (GPUs) cannot be overcommitted: Kubernetes requires the request,
        # when given, to equal the limit. Fill in the missing side so users may write either.
        if GPU_RESOURCE in requests and GPU_RESOURCE in limits:
            if parse_quantity(requests[GPU_RESOURCE]) != parse_quantity(limits[GPU_RESOURCE]):
                reader.fail(
                    f"{reader.path}.requests.{GPU_RESOURCE}",
                    f"must equal limits.{GPU_RESOURCE} ({requests[GPU_RESOURCE]} != "
                    f"{limits[GPU_RESOURCE]}): GPUs cannot be overcommitted",
                )
        elif GPU_RESOURCE in requests:
            limits[GPU_RESOURCE] = requests[GPU_RESOURCE]
        elif GPU_RESOURCE in limits:
            requests[GPU_RESOURCE] = limits[GPU_RESOURCE]
        for resource_name in sorted(set(requests) & set(limits) - {GPU_RESOURCE}):
            if parse_quantity(requests[resource_name]) > parse_quantity(limits[resource_name]):
                reader.fail(
                    f"{reader.path}.requests.{resource_name}",
                    f"{requests[resource_name]} exceeds limits.{resource_name} "
                    f"({limits[resource_name]})",
                )
        return Resources(MappingProxyType(requests), MappingProxyType(limits))


def _quantities(reader: _Reader, key: str) -> dict[str, str]:
    value = reader.get(key)
    if value is _MISSING:
        return {}
    if not isinstance(value, Mapping):
        reader.fail(reader.at(key), f"must be a map of quantities, got {_describe(value)}")
        return {}
    result: dict[str, str] = {}
    for resource_name, quantity in value.items():
        path = f"{reader.at(key)}.{resource_name}"
        text = _quantity_text(quantity)
        if text is None:
            reader.fail(path, f"must be a quantity such as 2, 500m or 4Gi; got {quantity!r}")
            continue
        if parse_quantity(text) < 0:
            reader.fail(path, f"must not be negative, got {quantity!r}")
            continue
        result[str(resource_name)] = text
    return result


def _quantity_text(quantity: Any) -> str | None:
    if isinstance(quantity, bool) or not isinstance(quantity, int | str):
        return None
    text = str(quantity).strip()
    try:
        parse_quantity(text)
    except ValueError:
        return None
    return text


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list"}.get(
        type(value), "object" if isinstance(value, Mapping) else type(value).__name__
    )
    return f"{kind} {value!r}" if kind != "object" else "an object"


def validate_name(name: str) -> list[str]:
    """Problems with the resource name as a prefix for the children's names."""
    if not _DNS1035_LABEL.match(name):
        return [
            f"metadata.name: {name!r} must be a DNS-1035 label (lowercase letters, digits and "
            "'-', starting with a letter): it prefixes the Service names"
        ]
    if len(name) > MAX_NAME_LENGTH:
        return [
            f"metadata.name: {name!r} is {len(name)} characters; at most {MAX_NAME_LENGTH} fit "
            "the engine StatefulSet's pod labels"
        ]
    return []


def parse_spec(raw_spec: Mapping[str, Any] | None, *, name: str) -> DeploymentSpec:
    """Validate ``raw_spec`` (the resource's ``.spec``) for a resource called ``name``.

    Raises ``InvalidSpec`` listing every problem found.
    """
    problems: list[str] = validate_name(name)
    spec = _Reader(raw_spec, "spec", problems, SPEC_SCHEMA)

    model = spec.string("model") or ""
    if model and (model != model.strip() or any(ord(char) < 32 for char in model)):
        spec.fail("spec.model", f"{model!r} has surrounding whitespace or control characters")

    image = spec.string("image") or ""
    _check_image(spec, "image", image)

    engine = _parse_engine(spec.child("engine"))
    coordinator = _parse_coordinator(spec.child("coordinator"))
    model_volume = _parse_model_volume(spec)
    adapters = _parse_adapters(spec, engine, model_volume)

    service_account_name = spec.string("serviceAccountName")
    if service_account_name is not None and not (
        _DNS1123_SUBDOMAIN.match(service_account_name) and len(service_account_name) <= 253
    ):
        spec.fail("spec.serviceAccountName", f"{service_account_name!r} is not a valid name")

    affinity = spec.get("affinity")
    if affinity is not _MISSING and not isinstance(affinity, Mapping):
        spec.fail("spec.affinity", f"must be an object, got {_describe(affinity)}")
        affinity = _MISSING

    pull_secrets: list[str] = []
    for index, secret in enumerate(spec.object_list("imagePullSecrets")):
        secret_name = secret.get("name")
        if not isinstance(secret_name, str) or not secret_name:
            spec.fail(f"spec.imagePullSecrets[{index}].name", "is required")
        else:
            pull_secrets.append(secret_name)

    allowed_clients = spec.object_list("allowedClients")
    for index, peer in enumerate(allowed_clients):
        if not any(key in peer for key in ("podSelector", "namespaceSelector", "ipBlock")):
            spec.fail(
                f"spec.allowedClients[{index}]",
                "needs a podSelector, namespaceSelector or ipBlock",
            )

    pod_template = _parse_pod_template(spec.child("podTemplate"))
    autoscaling = None
    if spec.get("autoscaling") is not _MISSING:
        autoscaling = _parse_autoscaling(spec.child("autoscaling"))
    image_pull_policy = spec.optional_choice("imagePullPolicy")
    data_parallel_size = spec.integer("dataParallelSize")
    node_selector = spec.string_map("nodeSelector")
    tolerations = spec.object_list("tolerations")

    if model_volume is not None and model_volume.mount_path in (SCRATCH_DIR, CACHE_DIR):
        spec.fail(
            "spec.modelVolume.mountPath",
            f"{model_volume.mount_path} is used by the operator's scratch volumes",
        )

    if problems:
        raise InvalidSpec(problems)
    return DeploymentSpec(
        model=model,
        image=image,
        image_pull_policy=image_pull_policy,
        data_parallel_size=data_parallel_size,
        engine=engine,
        coordinator=coordinator,
        model_volume=model_volume,
        node_selector=freeze(node_selector),
        tolerations=freeze(tolerations),
        affinity=None if affinity is _MISSING else freeze(affinity),
        image_pull_secrets=tuple(pull_secrets),
        service_account_name=service_account_name,
        allowed_clients=freeze(allowed_clients),
        pod_template=pod_template,
        autoscaling=autoscaling,
        adapters=adapters,
    )


def _check_image(reader: _Reader, key: str, image: str) -> None:
    if image and not _IMAGE_REFERENCE.match(image):
        reader.fail(
            reader.at(key),
            f"{image!r} is not a valid image reference "
            "(expected e.g. ghcr.io/dpserve/runtime-cpu:0.1.0)",
        )


def _parse_engine(engine: _Reader) -> EngineSpec:
    backend = engine.choice("backend")
    image = engine.string("image")
    if image is not None:
        _check_image(engine, "image", image)
    device = engine.choice("device")
    tensor_parallel_size = engine.integer("tensorParallelSize")
    resources = _engine_gpus(engine, engine.resources("resources"), device, tensor_parallel_size)
    if tensor_parallel_size > 1 and backend != VLLM_BACKEND:
        engine.fail(
            engine.at("tensorParallelSize"),
            f"{tensor_parallel_size} needs backend {VLLM_BACKEND} (spec.engine.backend is "
            f"{backend}: its engines run on one GPU each)",
        )
    vllm_args = _parse_vllm(engine.child("vllm"), backend)
    env = engine.object_list("env")
    seen: set[str] = set()
    for index, variable in enumerate(env):
        path = f"{engine.path}.env[{index}]"
        env_name = variable.get("name")
        if not isinstance(env_name, str) or not _ENV_NAME.match(env_name):
            engine.fail(f"{path}.name", f"{env_name!r} is not a valid environment variable name")
            continue
        if env_name in RESERVED_ENV:
            engine.fail(f"{path}.name", f"{env_name} is set by the operator (the engine rank)")
        if env_name in seen:
            engine.fail(f"{path}.name", f"{env_name} is defined twice")
        seen.add(env_name)
        if "value" in variable and not isinstance(variable["value"], str):
            engine.fail(f"{path}.value", f"must be a string, got {_describe(variable['value'])}")
        elif isinstance(variable.get("value"), str):
            # The CPU engine's own settings: a value it would refuse at start-up is refused
            # here, rather than as engine pods in CrashLoopBackOff.
            why = cpu_settings.value_error(env_name, variable["value"])
            if why is not None:
                engine.fail(f"{path}.value", why)
    return EngineSpec(
        resources=resources,
        max_batch_size=engine.integer("maxBatchSize"),
        dtype=engine.choice("dtype"),
        device=device,
        termination_grace_period_seconds=engine.integer("terminationGracePeriodSeconds"),
        env=freeze(env),
        prefix_caching=engine.boolean("prefixCaching"),
        backend=backend,
        tensor_parallel_size=tensor_parallel_size,
        image=image,
        vllm_args=vllm_args,
        max_loras=engine.optional_integer("maxLoras"),
        cpu_weights=_cpu_weights(engine, backend, device, resources),
    )


def _cpu_weights(engine: _Reader, backend: str, device: str, resources: Resources) -> str:
    """``spec.engine.cpuWeights``, refused where the engine would refuse ``--cpu-weights`` at
    start (``engine.layers.weight_format``): better a message naming the field now than a
    crash-looping pod."""
    chosen = engine.choice("cpuWeights")
    if chosen == DEFAULT_CPU_WEIGHTS:
        return chosen
    where = engine.at("cpuWeights")
    if backend != DPSERVE_BACKEND:
        engine.fail(where, f"{chosen} is for backend {DPSERVE_BACKEND} (vLLM runs its own)")
    elif device == "cuda" or GPU_RESOURCE in resources.limits:
        engine.fail(where, f"{chosen} is for CPU engines; these run on GPUs")
    elif engine.choice("dtype") not in ("auto", "float32"):
        engine.fail(where, f"{chosen} needs spec.engine.dtype auto or float32")
    return chosen


def _engine_gpus(
    engine: _Reader, resources: Resources, device: str, tensor_parallel_size: int
) -> Resources:
    """The engine's resources with ``nvidia.com/gpu`` following ``tensorParallelSize``.

    GPUs are asked for by device cuda or by naming the resource; an engine then gets one GPU
    per tensor-parallel rank, filled in where left out. A count that says otherwise is refused
    rather than overridden: one of the two fields does not say what its writer meant. Without
    GPUs, tensor parallelism is refused: it would only split a CPU's cores between ranks that
    then talk through shared memory (vLLM's CPU build runs it for tests, not for serving).
    """
    gpus = resources.limits.get(GPU_RESOURCE)
    if gpus is None and device != "cuda":
        if tensor_parallel_size > 1:
            engine.fail(
                engine.at("tensorParallelSize"),
                f"{tensor_parallel_size} needs GPUs (spec.engine.device cuda or an "
                f"{GPU_RESOURCE} resource); tensor parallelism on CPU is not offered",
            )
        return resources
    if gpus is not None and parse_quantity(gpus) != tensor_parallel_size:
        engine.fail(
            f"{engine.at('resources')}.limits.{GPU_RESOURCE}",
            f"{gpus} differs from spec.engine.tensorParallelSize ({tensor_parallel_size}): an "
            f"engine gets one GPU per tensor-parallel rank (leave {GPU_RESOURCE} out, or set "
            f"it to {tensor_parallel_size})",
        )
        return resources
    count = str(tensor_parallel_size)
    return Resources(
        MappingProxyType({**resources.requests, GPU_RESOURCE: count}),
        MappingProxyType({**resources.limits, GPU_RESOURCE: count}),
    )


def _parse_vllm(vllm: _Reader, backend: str) -> tuple[str, ...]:
    items = vllm.string_list("args")
    if vllm.data and backend != VLLM_BACKEND:
        vllm.fail(vllm.path, f"is for backend {VLLM_BACKEND}; spec.engine.backend is {backend}")
        return ()
    try:
        return parse_vllm_args(items, vllm.at("args"))
    except VllmArgsError as exc:
        vllm.problems.extend(exc.problems)
        return ()


def _parse_coordinator(coordinator: _Reader) -> CoordinatorSpec:
    zmq_port = coordinator.integer("zmqPort")
    http_port = coordinator.integer("httpPort")
    if zmq_port == http_port:
        coordinator.fail(
            coordinator.at("httpPort"), f"must differ from zmqPort (both are {zmq_port})"
        )
    return CoordinatorSpec(
        zmq_port=zmq_port,
        http_port=http_port,
        routing=coordinator.choice("routing"),
        resources=coordinator.resources("resources"),
        tool_call_parser=coordinator.optional_choice("toolCallParser"),
        reasoning_parser=coordinator.optional_choice("reasoningParser"),
        chat_template=coordinator.string("chatTemplate"),
        limits=parse_limits(
            coordinator.data.get("limits"), coordinator.at("limits"), coordinator.problems
        ),
    )


def _parse_autoscaling(autoscaling: _Reader) -> AutoscalingSpec:
    mode = autoscaling.choice("mode")
    min_replicas = autoscaling.integer("minReplicas")
    max_replicas = autoscaling.optional_integer("maxReplicas")
    metric = autoscaling.choice("metric")
    target = autoscaling.number("target", default=DEFAULT_TARGETS.get(metric))
    if mode == BUILTIN:
        if max_replicas is None and autoscaling.get("maxReplicas") is _MISSING:
            autoscaling.fail(autoscaling.at("maxReplicas"), "is required with mode Builtin")
        elif max_replicas is not None and max_replicas < min_replicas:
            autoscaling.fail(
                autoscaling.at("maxReplicas"),
                f"must be >= minReplicas ({max_replicas} < {min_replicas})",
            )
        if target is None and autoscaling.get("target") is _MISSING:
            autoscaling.fail(
                autoscaling.at("target"),
                f"is required with metric {metric}: the TTFT p90 objective in seconds",
            )
    if metric == KV_CACHE_USAGE and target is not None and not 0 < target <= 1:
        autoscaling.fail(
            autoscaling.at("target"), f"must be a fraction in (0, 1] for {metric}, got {target:g}"
        )
    if metric == TTFT_P90 and target is not None and target <= 0:
        autoscaling.fail(autoscaling.at("target"), f"must be > 0 seconds for {metric}")
    return AutoscalingSpec(
        mode=mode,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        metric=metric,
        target=target or 0.0,
        scale_up_window_seconds=autoscaling.integer("scaleUpWindowSeconds"),
        scale_down_window_seconds=autoscaling.integer("scaleDownWindowSeconds"),
        idle_before_zero_seconds=autoscaling.integer("idleBeforeZeroSeconds"),
    )


def _parse_model_volume(spec: _Reader) -> ModelVolume | None:
    if spec.get("modelVolume") is _MISSING:
        return None
    volume = spec.child("modelVolume")
    claim_name = volume.string("claimName") or ""
    if claim_name and not _DNS1123_SUBDOMAIN.match(claim_name):
        volume.fail(volume.at("claimName"), f"{claim_name!r} is not a valid claim name")
    mount_path = volume.string("mountPath") or ""
    if not mount_path.startswith("/") or ":" in mount_path:
        volume.fail(volume.at("mountPath"), f"{mount_path!r} must be an absolute path")
    return ModelVolume(
        claim_name=claim_name,
        mount_path=mount_path.rstrip("/") or "/",
        read_only=volume.boolean("readOnly"),
    )


def _parse_adapters(
    spec: _Reader, engine: EngineSpec, model_volume: ModelVolume | None
) -> AdaptersSpec | None:
    """``spec.adapters`` and ``spec.adapterVolume``, checked as the runtime checks them (names
    by ``sampling.check_lora_name``), with each path inside a volume the engines mount."""
    volume_claim: str | None = None
    if spec.get("adapterVolume") is not _MISSING:
        volume = spec.child("adapterVolume")
        volume_claim = volume.string("claimName") or ""
        if volume_claim and not _DNS1123_SUBDOMAIN.match(volume_claim):
            volume.fail(volume.at("claimName"), f"{volume_claim!r} is not a valid claim name")
        if model_volume is not None and model_volume.mount_path == ADAPTER_MOUNT_PATH:
            spec.fail(
                "spec.modelVolume.mountPath",
                f"{ADAPTER_MOUNT_PATH} is where spec.adapterVolume is mounted",
            )
    if spec.get("adapters") is _MISSING:
        if volume_claim is not None:
            spec.fail("spec.adapterVolume", "is for spec.adapters, which is not set")
        if engine.max_loras is not None:
            spec.fail("spec.engine.maxLoras", "is for spec.adapters, which is not set")
        return None
    roots = [root for root in (
        model_volume.mount_path if model_volume is not None else None,
        ADAPTER_MOUNT_PATH if volume_claim is not None else None,
    ) if root is not None]  # fmt: skip
    items = spec.object_list("adapters")
    most = spec.field("adapters")["maxItems"]
    if len(items) > most:
        spec.fail("spec.adapters", f"has {len(items)} adapters; at most {most}")
    adapters: list[Adapter] = []
    seen: set[str] = set()
    for index, item in enumerate(items):
        path_prefix = f"spec.adapters[{index}]"
        try:
            name = check_lora_name(item.get("name"))
        except InvalidSamplingParams as exc:
            spec.fail(f"{path_prefix}.name", str(exc))
            continue
        if name in seen:
            spec.fail(f"{path_prefix}.name", f"{name!r} is listed twice")
        seen.add(name)
        path = _adapter_path(spec, f"{path_prefix}.path", item.get("path"), roots)
        if path is not None:
            adapters.append(Adapter(name, path))
    return AdaptersSpec(tuple(adapters), volume_claim)


def _adapter_path(spec: _Reader, at: str, path: Any, roots: list[str]) -> str | None:
    """``path`` when it is a directory under one of ``roots`` (the mounted volumes)."""
    most = DEFAULT_LORA_PATH_CHARS
    if not isinstance(path, str) or not path.startswith("/") or len(path) > most:
        spec.fail(at, f"must be an absolute path of at most {most} characters, got {path!r:.200}")
        return None
    parts = path.split("/")
    if ".." in parts or any(ord(char) < 32 for char in path):
        spec.fail(at, f"{path!r} must not hold '..' or control characters")
        return None
    normal = "/".join(part for part in parts if part and part != ".")
    normal = f"/{normal}"
    if not roots:
        spec.fail(
            at,
            "needs a volume to read from: spec.modelVolume, or spec.adapterVolume (mounted at "
            f"{ADAPTER_MOUNT_PATH})",
        )
        return None
    if not any(normal.startswith(f"{root.rstrip('/')}/") for root in roots):
        spec.fail(at, f"{path!r} is not inside {' or '.join(roots)} (the mounted volumes)")
        return None
    return normal


def _parse_pod_template(template: _Reader) -> PodTemplateOverrides:
    metadata = template.child("metadata")
    labels = metadata.string_map("labels")
    annotations = metadata.string_map("annotations")
    for key, value in labels.items():
        path = f"{metadata.path}.labels.{key}"
        if key.startswith(RESERVED_LABEL_PREFIX):
            metadata.fail(path, f"keys under {RESERVED_LABEL_PREFIX} are set by the operator")
        elif not _valid_label_key(key):
            metadata.fail(path, "is not a valid label key")
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            metadata.fail(path, f"{value!r} is not a valid label value")
    for key in annotations:
        if not _valid_label_key(key):
            metadata.fail(f"{metadata.path}.annotations.{key}", "is not a valid annotation key")
    return PodTemplateOverrides(labels=freeze(labels), annotations=freeze(annotations))


def _valid_label_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_QUALIFIED_NAME.match(name))
