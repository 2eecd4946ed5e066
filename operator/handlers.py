"""kopf handlers for InferenceDeployments: thin wiring around spec, manifests, status, cluster.

- create/update/resume → ``reconcile``: validate the spec, render the children, adopt them
  (owner references: deleting the InferenceDeployment garbage-collects everything, so there
  is no delete handler; kopf still puts its finalizer on the resource because of the timers
  and removes it on deletion), create-or-replace each, then write the status;
- ``spec.dataParallelSize`` changes → ``scale_engines``: patch only the StatefulSet's replicas
  (what ``kubectl scale infd/NAME`` does through the CRD's scale subresource);
- every 2 s, every 0.5 s while converging (not Ready, or registeredEngines != desired) →
  ``refresh_status``: status from the StatefulSet, the coordinator Deployment and the
  coordinator's ``/ready`` (through the API server's service proxy), plus a GET of the
  ``<name>-credentials`` Secret: when it is gone, a reconcile generates new keys (rotation,
  see ``credentials``). It writes only when something changed, so idle deployments cost
  four GETs and no writes;
- every 60 s → ``correct_drift``: re-apply the children (recreates a deleted child, and
  retries after a reconcile gave up), writing nothing when all match;
- every second, with ``spec.autoscaling`` in mode Builtin → ``autoscale``: read the
  coordinator's ``/metrics`` (service proxy), decide (``autoscaling.decide``), set
  ``spec.dataParallelSize`` through the scale subresource when the count changes (an event
  says why, with the figures), and keep ``status.autoscaling`` up to date. In mode External
  (or without ``spec.autoscaling``) it does nothing: whoever writes the scale subresource
  decides;
- ``spec.adapters`` changes, and every 2 s while it is set → ``sync_adapters``: read the
  adapters the engines report (the coordinator's ``/metrics``), load and unload through the
  coordinator's HTTP front (service proxy, the deployment's admin token) until they are
  ``spec.adapters`` (``adapters.plan``), write ``status.adapters`` (with the ranks holding
  each, the front's ``/v1/lora_adapters``); a failed load or unload
  posts a warning event (once per distinct error). No pod restarts: the list is not in any
  pod template.

An invalid spec never raises: it becomes phase Degraded with a Degraded/InvalidSpec condition
and a warning event (not repeated while the status already reports that very problem).
Non-retryable API errors (403, 422, ...) are reported the same way (reason ApplyFailed);
retryable ones (conflicts, 5xx, network) raise ``kopf.TemporaryError`` a bounded number of
times, after which the drift timer keeps trying.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import kopf

from . import adapters, credentials, manifests
from .autoscaling import Decision, Memory, decide
from .cluster import ApiError, Cluster, bearer_token, load_configuration, replacement_for
from .crd import GROUP, PLURAL, VERSION
from .load import LoadSignal, MalformedMetrics, TtftWindow, read_metrics
from .main import LIVENESS_PATH
from .spec import AdaptersSpec, DeploymentSpec, InvalidSpec, parse_spec
from .status import (
    READY,
    REASON_APPLY_FAILED,
    REASON_INVALID_SPEC,
    WARNING,
    Event,
    Observation,
    compute_status,
    condition,
    phase_event,
    scaling_event,
    status_patch,
    sticky_apply_error,
)

RESOURCE = (GROUP, VERSION, PLURAL)

STATUS_REFRESH_SECONDS = 2.0
# The timer ticks this often; converged deployments skip ticks up to STATUS_REFRESH_SECONDS.
STATUS_TICK_SECONDS = 0.5
DRIFT_CHECK_SECONDS = 60.0
RETRY_DELAY_SECONDS = 10.0
MAX_RETRIES = 12
AUTOSCALE_TICK_SECONDS = 1.0
# How often the coordinator's adapters are compared with spec.adapters (one GET of /metrics).
ADAPTER_SYNC_SECONDS = 2.0
# How long after a reconcile a status timer tick whose body predates it is skipped.
STALE_STATUS_SECONDS = 2.0
# status.autoscaling is rewritten at once when the decision changes, else at most this often.
AUTOSCALING_STATUS_SECONDS = 5.0

# Routine messages go to this logger, not to kopf's per-object `logger`, which also posts
# every INFO+ line as a Kubernetes event.
log = logging.getLogger(__name__)


class QuietLivenessProbes(logging.Filter):
    """Drops aiohttp's access-log line for each answered liveness probe (``GET /healthz``,
    every few seconds from the kubelet), which would otherwise be most of the operator's log.
    Probes answered with an error, and any other request, are still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_line = str(getattr(record, "first_request_line", ""))
        parts = request_line.split()
        path = parts[1].split("?", 1)[0] if len(parts) > 1 else ""
        status = getattr(record, "response_status", None)
        answered = isinstance(status, int) and status < 400
        return not (path == LIVENESS_PATH and answered)


# kopf serves its liveness endpoint with aiohttp, which logs each request here.
ACCESS_LOGGER = "aiohttp.access"


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    access_log = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, QuietLivenessProbes) for f in access_log.filters):
        access_log.addFilter(QuietLivenessProbes())
    # Keep kopf's bookkeeping in annotations under our own prefix: the status schema is
    # structural and would prune kopf's default `status.kopf` progress records anyway.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    if getattr(memo, "cluster", None) is None:
        memo.cluster = Cluster.from_environment()


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    # Instead of kopf's default client login, which reads $KUBECONFIG as of import time:
    # kopf and the handlers' Cluster then share one credential source.
    configuration = load_configuration()
    scheme, token = bearer_token(configuration)
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
        trust_env=settings.networking.trust_env,
    )


def _cluster(memo: kopf.Memo) -> Cluster:
    cluster: Cluster = memo.cluster
    return cluster


# --------------------------------------------------------------------------- handlers


@kopf.on.field(*RESOURCE, field="spec.dataParallelSize", id="scale-engines", retries=MAX_RETRIES)
def scale_engines(body: kopf.Body, old: Any, memo: kopf.Memo, **_: Any) -> None:
    # Registered before reconcile, so it runs first on the same change: the replicas move
    # without waiting for every other child to be compared.
    if old is None:
        return  # creation: reconcile creates the StatefulSet at the right size
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    try:
        spec = parse_spec(body.get("spec"), name=name)
    except InvalidSpec:
        return  # reconcile reports it
    try:
        scaled = _cluster(memo).scale_statefulset(
            namespace, manifests.engine_name(name), spec.data_parallel_size
        )
    except ApiError as error:
        if error.transient:
            raise kopf.TemporaryError(
                f"scaling failed: {error}", delay=RETRY_DELAY_SECONDS
            ) from error
        # Not retryable: reconcile, which runs on the same change, reports it in the status.
        log.warning("scaling %s failed: %s", name, error)
        return
    if scaled:
        _post(body, scaling_event(old, spec.data_parallel_size))


@kopf.on.resume(*RESOURCE, id="reconcile", retries=MAX_RETRIES)
@kopf.on.create(*RESOURCE, id="reconcile", retries=MAX_RETRIES)
@kopf.on.update(*RESOURCE, id="reconcile", retries=MAX_RETRIES)
def reconcile(
    body: kopf.Body, status: kopf.Status, patch: kopf.Patch, memo: kopf.Memo, **_: Any
) -> None:
    # The status timer runs beside this handler, on the body of the moment it started: for
    # a little while its status may predate what this reconcile writes (see refresh_status).
    # Marked before the apply as well as after it: a tick that read the mark while this ran
    # had computed "Reconciling" from such a body and written it over this reconcile's Ready
    # (CI, cc67691: Ready, Progressing, Ready after a scale-down).
    memo.applied = (_generation(body), time.monotonic())
    _apply(_cluster(memo), body, status, patch, retry_transient_errors=True)
    memo.applied = (_generation(body), time.monotonic())


@kopf.timer(
    *RESOURCE,
    id="refresh-status",
    interval=STATUS_TICK_SECONDS,
    # On the tick grid, not a full tick after each refresh ends: a refresh (five reads and a
    # status patch through the API server) would otherwise lengthen every tick by its own time.
    sharp=True,
    initial_delay=STATUS_REFRESH_SECONDS,
)
def refresh_status(
    body: kopf.Body, status: kopf.Status, patch: kopf.Patch, memo: kopf.Memo, **_: Any
) -> None:
    name = body["metadata"]["name"]
    generation = _generation(body)
    spec: DeploymentSpec | None = None
    spec_error: str | None = None
    try:
        spec = parse_spec(body.get("spec"), name=name)
    except InvalidSpec as invalid:
        spec_error = str(invalid)
    # `memo` is kopf's per-object copy of the operator's memo: this deployment's clock.
    now = time.monotonic()
    applied_generation, applied_at = getattr(memo, "applied", (None, float("-inf")))
    if (
        applied_generation is not None
        and int(status.get("observedGeneration") or 0) < applied_generation
        and now - applied_at < STALE_STATUS_SECONDS
    ):
        # This body's status predates the reconcile that just ran for a newer generation:
        # a status computed from it ("Reconciling", the old counts) would overwrite the
        # reconcile's fresher one. The next tick has the new body.
        return
    if converged(status, spec, generation) and (
        now - getattr(memo, "last_status_refresh", float("-inf")) < STATUS_REFRESH_SECONDS
    ):
        return
    memo.last_status_refresh = now
    cluster = _cluster(memo)
    try:
        if spec is not None and not cluster.read(
            "v1", "Secret", body["metadata"]["namespace"], credentials.credentials_secret_name(name)
        ):
            # The keys' Secret was deleted: rotate (new keys, new client Secret, pods roll).
            _apply(cluster, body, status, patch, retry_transient_errors=False)
            return
        _write_status(
            cluster,
            body,
            status,
            patch,
            spec=spec,
            spec_error=spec_error,
            apply_error=sticky_apply_error(status, generation),
            observed_generation=status.get("observedGeneration"),
        )
    except ApiError as error:
        # Next tick retries; the status keeps its last known values meanwhile.
        log.warning("status refresh of %s failed: %s", name, error)


@kopf.timer(
    *RESOURCE, id="correct-drift", interval=DRIFT_CHECK_SECONDS, initial_delay=DRIFT_CHECK_SECONDS
)
def correct_drift(
    body: kopf.Body, status: kopf.Status, patch: kopf.Patch, memo: kopf.Memo, **_: Any
) -> None:
    try:
        _apply(_cluster(memo), body, status, patch, retry_transient_errors=False)
    except ApiError as error:
        log.warning("drift check of %s failed: %s", body["metadata"]["name"], error)


def converged(status: Mapping[str, Any], spec: DeploymentSpec | None, generation: int) -> bool:
    """Ready with every desired engine registered, for the current generation: the status
    timer may then slow down to STATUS_REFRESH_SECONDS."""
    return (
        spec is not None
        and status.get("phase") == READY
        and status.get("registeredEngines") == spec.data_parallel_size
        and status.get("observedGeneration") == generation
    )


# --------------------------------------------------------------------------- the work


def _ensure_credentials(
    cluster: Cluster, body: kopf.Body, name: str, namespace: str
) -> tuple[dict[str, str], str | None]:
    """The key files of ``<name>-credentials``, generating (and storing) new ones when the
    Secret is missing or does not hold a valid key set. Returns (files, what was done)."""
    secret_name = credentials.credentials_secret_name(name)
    live = cluster.read("v1", "Secret", namespace, secret_name)
    files = credentials.decode_secret_data(live)
    if live is not None and credentials.valid_key_files(files):
        completed = credentials.with_admin_token(files)
        if completed is None:
            return files, None
        desired = manifests.credentials_secret(name, namespace, completed)
        kopf.adopt(desired, owner=body)
        cluster.replace(replacement_for(desired, live))
        return completed, f"added {credentials.ADMIN_API_TOKEN_FILE} to Secret/{secret_name}"
    files = credentials.generate_key_files()
    desired = manifests.credentials_secret(name, namespace, files)
    kopf.adopt(desired, owner=body)
    if live is None:
        cluster.create(desired)
        return files, f"created Secret/{secret_name} (new keys)"
    cluster.replace(replacement_for(desired, live))
    return files, f"replaced Secret/{secret_name} (new keys: it held no valid key set)"


def _apply(
    cluster: Cluster,
    body: kopf.Body,
    status: Mapping[str, Any],
    patch: kopf.Patch,
    *,
    retry_transient_errors: bool,
) -> None:
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    generation = _generation(body)
    try:
        spec = parse_spec(body.get("spec"), name=name)
    except InvalidSpec as invalid:
        message = str(invalid)
        if not _already_reported(status, REASON_INVALID_SPEC, message, generation):
            kopf.warn(body, reason=REASON_INVALID_SPEC, message=message)
        _write_status(
            cluster, body, status, patch,
            spec=None, spec_error=message, apply_error=None, observed_generation=generation,
        )  # fmt: skip
        return

    changes: list[str] = []
    try:
        files, generated = _ensure_credentials(cluster, body, name, namespace)
    except ApiError as error:
        if error.transient and retry_transient_errors:
            raise kopf.TemporaryError(
                f"Secret/{credentials.credentials_secret_name(name)}: {error}",
                delay=RETRY_DELAY_SECONDS,
            ) from error
        raise
    if generated is not None:
        changes.append(generated)
    children = [
        manifests.client_credentials_secret(name, namespace, files),
        *manifests.all_children(
            name,
            namespace,
            spec,
            pdb_api_version=cluster.pdb_api_version(),
            credentials_hash=credentials.credentials_hash(files),
        ),
    ]
    kopf.adopt(children, owner=body)
    for child in children:
        child_ref = f"{child['kind']}/{child['metadata']['name']}"
        try:
            result = cluster.apply(child)
        except ApiError as error:
            if error.transient:
                if retry_transient_errors:
                    raise kopf.TemporaryError(
                        f"{child_ref}: {error}", delay=RETRY_DELAY_SECONDS
                    ) from error
                raise
            message = f"{child_ref}: {error}"
            if not _already_reported(status, REASON_APPLY_FAILED, message, generation):
                kopf.warn(body, reason=REASON_APPLY_FAILED, message=message)
            _write_status(
                cluster, body, status, patch,
                spec=spec, spec_error=None, apply_error=message,
                observed_generation=status.get("observedGeneration"),
            )  # fmt: skip
            return
        if result != "unchanged":
            changes.append(f"{result} {child_ref}")
    if changes:
        kopf.info(body, reason="Applied", message="; ".join(changes))
    _write_status(
        cluster, body, status, patch,
        spec=spec, spec_error=None, apply_error=None, observed_generation=generation,
    )  # fmt: skip


def _write_status(
    cluster: Cluster,
    body: kopf.Body,
    status: Mapping[str, Any],
    patch: kopf.Patch,
    *,
    spec: DeploymentSpec | None,
    spec_error: str | None,
    apply_error: str | None,
    observed_generation: int | None,
) -> None:
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    statefulset = cluster.read("apps/v1", "StatefulSet", namespace, manifests.engine_name(name))
    coordinator = cluster.read("apps/v1", "Deployment", namespace, manifests.coordinator_name(name))
    health: dict[str, Any] | None = None
    health_error: str | None = "no coordinator Deployment"
    if coordinator is not None:
        health, health_error = cluster.coordinator_health(
            namespace, manifests.coordinator_name(name), manifests.HTTP_PORT_NAME
        )
    pods: list[dict[str, Any]] | None = None
    try:
        pods = cluster.list_pods(namespace, manifests.instance_selector(name))
    except ApiError as error:  # the rest of the status is still worth writing
        log.warning("listing the pods of %s failed: %s", name, error)
    observation = Observation(
        generation=_generation(body),
        spec_error=spec_error,
        apply_error=apply_error,
        desired_engines=spec.data_parallel_size if spec is not None else None,
        statefulset=statefulset,
        coordinator=coordinator,
        health=health,
        health_error=health_error,
        pods=pods,
    )
    new_status = compute_status(
        observation,
        previous=status,
        observed_generation=observed_generation,
        selector=manifests.engine_selector(name),
        now=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
    changes = status_patch(status, new_status)
    if not changes:
        return
    patch.status.update(changes)
    _announce_phase(body, status, new_status)


def _announce_phase(
    body: kopf.Body, old_status: Mapping[str, Any], new_status: Mapping[str, Any]
) -> None:
    """An event when the deployment becomes Ready, or Degraded for a new reason (capacity
    lost on its own, a child pod that cannot run): ``status.phase_event``."""
    event = phase_event(old_status, new_status)
    if event is not None:
        _post(body, event)


def _post(body: kopf.Body, event: Event) -> None:
    if event.type == WARNING:
        kopf.warn(body, reason=event.reason, message=event.message)
    else:
        kopf.info(body, reason=event.reason, message=event.message)


def _already_reported(
    status: Mapping[str, Any], reason: str, message: str, generation: int
) -> bool:
    degraded = condition(status, "Degraded") or {}
    return (
        degraded.get("status") == "True"
        and degraded.get("reason") == reason
        and degraded.get("message") == message
        and degraded.get("observedGeneration") == generation
    )


def _generation(body: Mapping[str, Any]) -> int:
    return int((body.get("metadata") or {}).get("generation") or 0)


# --------------------------------------------------------------------------- autoscaling


@kopf.timer(*RESOURCE, id="autoscale", interval=AUTOSCALE_TICK_SECONDS)
def autoscale(
    body: kopf.Body, status: kopf.Status, patch: kopf.Patch, memo: kopf.Memo, **_: Any
) -> None:
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    try:
        spec = parse_spec(body.get("spec"), name=name)
    except InvalidSpec:
        return  # reconcile reports it
    if spec.autoscaling is None or not spec.autoscaling.builtin:
        if status.get("autoscaling"):
            patch.status["autoscaling"] = None  # turned off: no stale decision on show
        memo.autoscaler = None
        return
    now = time.monotonic()
    if getattr(memo, "autoscaler", None) is None:
        memo.autoscaler = (Memory(), TtftWindow())
    memory, ttft = memo.autoscaler
    load = _read_load(_cluster(memo), namespace, name, now, ttft)
    current = spec.data_parallel_size
    decision, next_memory = decide(
        spec.autoscaling,
        current,
        load,
        memory,
        now,
        default_capacity=spec.engine.max_batch_size,
    )
    if decision.changes(current):
        try:
            _cluster(memo).scale(namespace, name, decision.desired)
        except ApiError as error:
            log.warning("autoscaling %s to %d failed: %s", name, decision.desired, error)
            return  # the next tick decides again, from the same memory
        kopf.info(body, reason=decision.reason, message=decision.message(current))
    memo.autoscaler = (next_memory, ttft)
    _write_autoscaling_status(
        status,
        patch,
        memo,
        decision,
        load,
        metric=spec.autoscaling.metric,
        changed=decision.changes(current),
    )


def _read_load(
    cluster: Cluster, namespace: str, name: str, now: float, ttft: TtftWindow
) -> LoadSignal | None:
    try:
        page = cluster.coordinator_metrics(
            namespace, manifests.coordinator_name(name), manifests.HTTP_PORT_NAME
        )
        return read_metrics(page, now, ttft)
    except (ApiError, MalformedMetrics) as error:
        log.info("autoscaler of %s has no reading: %s", name, error)
        return None


def _write_autoscaling_status(
    status: Mapping[str, Any],
    patch: kopf.Patch,
    memo: kopf.Memo,
    decision: Decision,
    load: LoadSignal | None,
    *,
    metric: str,
    changed: bool,
) -> None:
    previous = status.get("autoscaling") or {}
    now = time.monotonic()
    new = {
        "metric": metric,
        "desiredReplicas": decision.desired,
        # The last change's reason stays (kubectl get infd shows it) until the next change.
        "reason": decision.reason if changed else previous.get("reason", decision.reason),
        "signal": decision.signal,
        "currentValue": None if decision.value is None else f"{decision.value:.3g}",
        "heldRequests": None if load is None else load.queued,
        "lastScaleTime": (
            datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            if changed
            else previous.get("lastScaleTime")
        ),
    }
    if all(previous.get(key) == value for key, value in new.items()):
        return
    decided_differently = any(
        previous.get(key) != new[key] for key in ("desiredReplicas", "reason", "heldRequests")
    )
    last = getattr(memo, "last_autoscaling_status", float("-inf"))
    if decided_differently or now - last >= AUTOSCALING_STATUS_SECONDS:
        memo.last_autoscaling_status = now
        patch.status["autoscaling"] = new


# --------------------------------------------------------------------------- LoRA adapters


@kopf.on.field(*RESOURCE, field="spec.adapters", id="adapters-changed")
def adapters_changed(
    body: kopf.Body, status: kopf.Status, patch: kopf.Patch, memo: kopf.Memo, **_: Any
) -> None:
    # At once on an edit, rather than at the next tick (at creation the coordinator is not
    # up yet: the timer takes over).
    _keep_adapters(body, status, patch, memo)


@kopf.timer(*RESOURCE, id="sync-adapters", interval=ADAPTER_SYNC_SECONDS, sharp=True)
def sync_adapters(
    body: kopf.Body, status: kopf.Status, patch: kopf.Patch, memo: kopf.Memo, **_: Any
) -> None:
    """Keep the coordinator's adapters equal to spec.adapters: a restarted coordinator
    comes back with none, and engines get from the coordinator what it loaded."""
    _keep_adapters(body, status, patch, memo)


# Guards the creation of each deployment's adapter lock (``_adapter_lock``).
_ADAPTER_LOCKS_GUARD = threading.Lock()


def _adapter_lock(memo: kopf.Memo) -> threading.Lock:
    """One deployment's adapter sync at a time: kopf runs the edit handler and the timer, both
    synchronous, on threads of its own, so an edit landing on a tick ran both at once; each
    read the coordinator's adapters before either changed them, and each sent the same
    unloads and loads (an adapter unloaded and loaded twice; CI, 3522275)."""
    with _ADAPTER_LOCKS_GUARD:
        lock: threading.Lock | None = getattr(memo, "adapter_lock", None)
        if lock is None:
            lock = memo.adapter_lock = threading.Lock()
        return lock


def _keep_adapters(
    body: kopf.Body, status: Mapping[str, Any], patch: kopf.Patch, memo: kopf.Memo
) -> None:
    with _adapter_lock(memo):
        _keep_adapters_now(body, status, patch, memo)


def _keep_adapters_now(
    body: kopf.Body, status: Mapping[str, Any], patch: kopf.Patch, memo: kopf.Memo
) -> None:
    name = body["metadata"]["name"]
    try:
        spec = parse_spec(body.get("spec"), name=name)
    except InvalidSpec:
        return  # reconcile reports it
    if spec.adapters is None:
        if status.get("adapters"):
            patch.status["adapters"] = None
        memo.adapters = None
        return
    try:
        _sync_adapters(_cluster(memo), body, status, patch, memo, spec.adapters)
    except ApiError as error:
        log.info("adapters of %s not synced: %s", name, error)


def _sync_adapters(
    cluster: Cluster,
    body: kopf.Body,
    status: Mapping[str, Any],
    patch: kopf.Patch,
    memo: kopf.Memo,
    spec: AdaptersSpec,
) -> None:
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    service = manifests.coordinator_name(name)
    try:
        reading = adapters.read_metrics(
            cluster.coordinator_metrics(namespace, service, manifests.HTTP_PORT_NAME)
        )
    except adapters.MalformedAdapterMetrics as error:
        log.info("adapters of %s: no reading: %s", name, error)
        return
    reported = dict(reading.adapters)
    previous = status.get("adapters") or []
    # The directories loaded from, and the last errors, as this process last left them: the
    # body a tick gets may predate the status the previous tick wrote. From the status when
    # the operator (re)starts.
    if getattr(memo, "adapters", None) is None:
        memo.adapters = (adapters.previous_paths(previous), adapters.previous_errors(previous))
    loaded_from, errors = memo.adapters
    # An error stays until its adapter is reported (or another attempt fails differently).
    for adapter_name in set(errors) & set(reported):
        del errors[adapter_name]
    todo = adapters.plan(spec.adapters, reported, loaded_from)
    token = _admin_token(cluster, namespace, name)
    if token is None:
        return  # reconcile creates the Secret
    # With no engine registered there is nothing to load into: engines that register get
    # the adapters on the first tick after.
    if not todo.empty and reading.engines > 0:
        done: list[str] = []

        def send(endpoint: str, payload: dict[str, str], reason: str, what: str) -> bool:
            try:
                answer = cluster.coordinator_post(
                    namespace, service, manifests.HTTP_PORT_NAME, endpoint, payload, token
                )
                outcome = adapters.outcome(*answer)
            except ApiError as error:
                outcome = adapters.Outcome(False, f"the coordinator was not reached: {error}")
            adapter = payload["lora_name"]
            if outcome.done:
                errors.pop(adapter, None)
                done.append(what)
                return True
            assert outcome.error is not None
            if errors.get(adapter) != outcome.error:
                kopf.warn(body, reason=reason, message=f"{adapter}: {outcome.error}")
            errors[adapter] = outcome.error
            return False

        for adapter_name in todo.unloads:
            if send(
                adapters.UNLOAD_ENDPOINT,
                {"lora_name": adapter_name},
                adapters.UNLOAD_FAILED,
                f"unloaded {adapter_name}",
            ):
                reported.pop(adapter_name, None)
                loaded_from.pop(adapter_name, None)
        for adapter in todo.loads:
            if adapter.name in reported:
                continue  # its unload (a new path) failed: it keeps the old directory
            if send(
                adapters.LOAD_ENDPOINT,
                {"lora_name": adapter.name, "lora_path": adapter.path},
                adapters.LOAD_FAILED,
                f"loaded {adapter.name} from {adapter.path}",
            ):
                reported.setdefault(adapter.name, 0)
                loaded_from[adapter.name] = adapter.path
        if done:
            kopf.info(body, reason=adapters.CHANGED, message="; ".join(done))
    entries = adapters.status_entries(
        spec.adapters, reported, errors, loaded_from, _ranks(cluster, namespace, service, token)
    )
    if entries != [dict(entry) for entry in previous]:
        patch.status["adapters"] = entries


def _ranks(
    cluster: Cluster, namespace: str, service: str, token: str
) -> dict[str, list[int]] | None:
    """Which engines hold each adapter (the front's ``/v1/lora_adapters``, from the
    coordinator's STATUS); None when the front did not say (the status then lists no ranks,
    rather than stale ones)."""
    try:
        return adapters.read_ranks(
            cluster.coordinator_get(
                namespace, service, manifests.HTTP_PORT_NAME, adapters.RANKS_ENDPOINT, token
            )
        )
    except (ApiError, adapters.MalformedAdapterMetrics) as error:
        log.info("adapters of %s: no ranks: %s", service, error)
        return None


def _admin_token(cluster: Cluster, namespace: str, name: str) -> str | None:
    """The HTTP front's admin token (the only one it takes for loading and unloading
    adapters), from ``<name>-credentials`` (never logged)."""
    secret = cluster.read("v1", "Secret", namespace, credentials.credentials_secret_name(name))
    text = credentials.decode_secret_data(secret).get(credentials.ADMIN_API_TOKEN_FILE, "")
    tokens = [line.strip() for line in text.splitlines() if line.strip()]
    return tokens[0] if tokens else None
