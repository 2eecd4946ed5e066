"""Pure computation of an InferenceDeployment's status from what the operator observed.

Phases:

- ``Pending``: the children do not exist yet, or nothing runs yet on a first start;
- ``Progressing``: converging on a new spec (scaling, rolling out, starting engines);
- ``Ready``: every desired engine is registered with the coordinator (its pod's readiness,
  which follows the registration by up to a probe period, is not waited for);
- ``Degraded``: the spec is invalid, the children could not be applied, a child pod cannot
  run (OOM-killed, crash-looping, unschedulable, its image cannot be pulled: the reason and
  the pod's own message, see ``pod_problems``), or a deployment that was Ready lost engines
  or its coordinator without anyone asking for it.

A change somebody asked for (``kubectl patch``/``scale``/``edit``, an HPA, the built-in
autoscaler: each writes the spec, so the generation moves) is never Degraded on its own:
until the new count is registered it is Progressing. Only a shortfall at the generation the
deployment was last Ready for (or Degraded for losing capacity) is capacity lost unasked.

The three conditions (Ready, Progressing, Degraded) carry a reason and a message; a
condition's ``lastTransitionTime`` only moves when its status flips.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PENDING, PROGRESSING, READY, DEGRADED = "Pending", "Progressing", "Ready", "Degraded"
CONDITION_TYPES = ("Ready", "Progressing", "Degraded")

# Condition reasons with a fixed meaning, which the handlers rely on too.
REASON_INVALID_SPEC = "InvalidSpec"
REASON_APPLY_FAILED = "ApplyFailed"
REASON_OOM_KILLED = "OOMKilled"
REASON_CRASH_LOOP = "CrashLoopBackOff"
REASON_UNSCHEDULABLE = "Unschedulable"
REASON_IMAGE_PULL = "ImagePullBackOff"
# Capacity that was there went missing without a spec change.
REASON_ENGINES_UNAVAILABLE = "EnginesUnavailable"
REASON_COORDINATOR_UNAVAILABLE = "CoordinatorUnavailable"
_LOST_CAPACITY = frozenset({REASON_ENGINES_UNAVAILABLE, REASON_COORDINATOR_UNAVAILABLE})
# Announced where they are detected (the handlers), not on the phase change.
_ANNOUNCED_ELSEWHERE = frozenset({REASON_INVALID_SPEC, REASON_APPLY_FAILED})

NORMAL, WARNING = "Normal", "Warning"

# The kubelet alternates ErrImagePull and ImagePullBackOff while it retries: one reason for
# both keeps the condition (and the events) from flapping. The others are reported as named.
_IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff"})
_IMAGE_REASONS = frozenset({"InvalidImageName", "ErrImageNeverPull", "RegistryUnavailable"})
_START_FAILURES = frozenset(
    {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}
)
MAX_PROBLEM_MESSAGE_CHARS = 1000  # the Degraded message naming every problem pod, cut here


@dataclass(frozen=True)
class Observation:
    """What the operator saw at one moment; ``None`` means absent or unknown."""

    generation: int
    # Set when the spec failed validation (then desired_engines is None).
    spec_error: str | None
    # Set when the children could not be written (a non-retryable API error).
    apply_error: str | None
    desired_engines: int | None
    statefulset: Mapping[str, Any] | None
    coordinator: Mapping[str, Any] | None
    # The coordinator's /ready JSON (also on 503) or, when unreachable, why.
    health: Mapping[str, Any] | None
    health_error: str | None = None
    # The coordinator's and engines' pods (a pod list's items); None: not read.
    pods: Sequence[Mapping[str, Any]] | None = None


@dataclass(frozen=True)
class PodProblem:
    """Why one child pod does not run: a condition reason and a message that names the pod
    and quotes what Kubernetes says about it."""

    reason: str
    message: str


@dataclass(frozen=True)
class Event:
    """A Kubernetes event to post on the InferenceDeployment."""

    type: str  # NORMAL or WARNING
    reason: str
    message: str


def scaling_event(old: object, new: int) -> Event:
    """What a change of ``spec.dataParallelSize`` is announced as, whoever made it (an edit,
    ``kubectl scale``, an HPA, the built-in autoscaler): a Normal event, as the status that
    follows is Progressing, never Degraded."""
    return Event(NORMAL, "Scaling", f"engines: {old} → {new}")


def phase_event(
    old_status: Mapping[str, Any] | None, new_status: Mapping[str, Any]
) -> Event | None:
    """The event a status change is announced with: Normal ``Ready`` on becoming Ready, a
    Warning on becoming Degraded or Degraded for a new reason (capacity lost unasked, a
    child pod that cannot run), else none. InvalidSpec and ApplyFailed are announced where
    they are detected."""
    old_status = old_status or {}
    new_phase = new_status.get("phase")
    old_reason = (condition(old_status, "Degraded") or {}).get("reason")
    degraded = condition(new_status, "Degraded") or {}
    if new_phase == old_status.get("phase") and (
        new_phase != DEGRADED
        or degraded.get("reason") == old_reason
        # One incident, one Warning: a coordinator back up whose engines have not
        # re-registered yet is still the same loss.
        or {degraded.get("reason"), old_reason} <= _LOST_CAPACITY
    ):
        return None
    if new_phase == READY:
        ready = condition(new_status, "Ready") or {}
        return Event(NORMAL, "Ready", str(ready.get("message") or ""))
    if new_phase == DEGRADED and degraded.get("reason") not in _ANNOUNCED_ELSEWHERE:
        return Event(
            WARNING, str(degraded.get("reason") or DEGRADED), str(degraded.get("message") or "")
        )
    return None


def pod_problems(pods: Iterable[Mapping[str, Any]]) -> list[PodProblem]:
    """What keeps child pods from running, one entry per pod at most (pods being deleted are
    left out: their replacement is what counts), in the pods' order."""
    problems = []
    for pod in pods:
        metadata = pod.get("metadata") or {}
        if metadata.get("deletionTimestamp"):
            continue
        problem = _pod_problem(str(metadata.get("name") or "?"), pod)
        if problem is not None:
            problems.append(problem)
    return problems


def _pod_problem(name: str, pod: Mapping[str, Any]) -> PodProblem | None:
    status = pod.get("status") or {}
    for pod_condition in status.get("conditions") or []:
        if (
            pod_condition.get("type") == "PodScheduled"
            and pod_condition.get("status") == "False"
            and pod_condition.get("reason") == REASON_UNSCHEDULABLE
        ):
            why = pod_condition.get("message") or "no node can run it"
            return PodProblem(REASON_UNSCHEDULABLE, f"pod {name} cannot be scheduled: {why}")
    limits = {
        str(container.get("name")): ((container.get("resources") or {}).get("limits") or {})
        for container in (pod.get("spec") or {}).get("containers") or []
    }
    statuses = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    for container in statuses:
        problem = _container_problem(name, container, limits.get(str(container.get("name")), {}))
        if problem is not None:
            return problem
    return None


def _container_problem(
    pod: str, container: Mapping[str, Any], limits: Mapping[str, Any]
) -> PodProblem | None:
    where = f"pod {pod} container {container.get('name')}"
    state = container.get("state") or {}
    waiting = state.get("waiting") or {}
    reason = str(waiting.get("reason") or "")
    said = str(waiting.get("message") or "")
    if reason in _IMAGE_PULL_REASONS or reason in _IMAGE_REASONS:
        image = container.get("image") or "its image"
        kind = REASON_IMAGE_PULL if reason in _IMAGE_PULL_REASONS else reason
        return PodProblem(kind, f"{where} cannot pull {image}: {reason}: {said}".rstrip(": "))
    if reason in _START_FAILURES:
        return PodProblem(reason, f"{where} cannot start: {said or reason}")
    terminated = state.get("terminated") or (container.get("lastState") or {}).get("terminated")
    if container.get("ready") or not terminated:
        return None
    restarts = int(container.get("restartCount") or 0)
    code = terminated.get("exitCode")
    if terminated.get("reason") == REASON_OOM_KILLED:
        memory = limits.get("memory")
        limit = f"its memory limit ({memory})" if memory else "the memory available to it"
        return PodProblem(
            REASON_OOM_KILLED,
            f"{where} was OOMKilled (exit code {code}): it needs more than {limit}; "
            f"restarted {restarts} time(s)",
        )
    if reason == REASON_CRASH_LOOP:
        last = terminated.get("reason") or "Error"
        tail = str(terminated.get("message") or "").strip().splitlines()[-1:] or [""]
        detail = f": {tail[0][:200]}" if tail[0] else ""
        return PodProblem(
            REASON_CRASH_LOOP,
            f"{where} keeps exiting ({last}, exit code {code}{detail}); restarted "
            f"{restarts} time(s); {said or 'back-off'}; see `kubectl logs {pod} --previous`",
        )
    return None


@dataclass(frozen=True)
class _Verdict:
    phase: str
    ready: tuple[bool, str, str]
    progressing: tuple[bool, str, str]
    degraded: tuple[bool, str, str]


def compute_status(
    observation: Observation,
    *,
    previous: Mapping[str, Any] | None,
    observed_generation: int | None,
    selector: str,
    now: str,
) -> dict[str, Any]:
    """The full status for ``observation``.

    ``previous`` is the current status (for phase memory and condition transition times),
    ``observed_generation`` the last generation the children were applied for, ``now`` an
    RFC 3339 timestamp.
    """
    previous = previous or {}
    statefulset_status = _status_of(observation.statefulset)
    registered = _registered_engines(observation.health)
    verdict = _verdict(observation, previous, observed_generation, registered)

    status: dict[str, Any] = {
        "phase": verdict.phase,
        "replicas": int(statefulset_status.get("replicas") or 0),
        "readyReplicas": int(statefulset_status.get("readyReplicas") or 0),
        # Unknown (health unreachable) is left out rather than reported as 0 engines.
        "registeredEngines": registered,
        "selector": selector,
        "observedGeneration": observed_generation,
        "conditions": [
            _condition(kind, flag, observation.generation, previous, now)
            for kind, flag in zip(
                CONDITION_TYPES, (verdict.ready, verdict.progressing, verdict.degraded), strict=True
            )
        ],
    }
    return status


def status_patch(previous: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """The merge-patch turning ``previous`` into ``new`` for the keys this module owns: the
    keys that changed, and the phase and conditions with any change.

    Empty when nothing changed, so an idle operator writes nothing. ``None`` values delete.
    """
    previous = previous or {}
    changes = {key: value for key, value in new.items() if previous.get(key) != value}
    if changes:
        # The verdict goes whole: the reconcile handler and the status timer write
        # concurrently, each from its own view, and a phase from one computation must not be
        # left beside the conditions of another.
        for key in ("phase", "conditions"):
            changes[key] = new[key]
    return changes


def sticky_apply_error(previous: Mapping[str, Any] | None, generation: int) -> str | None:
    """The apply failure recorded for this very generation, if any.

    The periodic status refresh keeps reporting it until a reconcile of the same or a newer
    generation succeeds (which rewrites the Degraded condition).
    """
    for condition in (previous or {}).get("conditions") or []:
        if (
            condition.get("type") == "Degraded"
            and condition.get("status") == "True"
            and condition.get("reason") == REASON_APPLY_FAILED
            and condition.get("observedGeneration") == generation
        ):
            return str(condition.get("message") or "applying the children failed")
    return None


def condition(status: Mapping[str, Any] | None, kind: str) -> Mapping[str, Any] | None:
    # Conditions as this operator writes them (``_condition`` builds each one).
    conditions: list[Mapping[str, Any]] = (status or {}).get("conditions") or []
    for item in conditions:
        if item.get("type") == kind:
            return item
    return None


# --------------------------------------------------------------------------- internals


def _status_of(obj: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return (obj or {}).get("status") or {}


def _registered_engines(health: Mapping[str, Any] | None) -> int | None:
    if health is None:
        return None
    engines = health.get("engines")
    if isinstance(engines, int) and not isinstance(engines, bool) and engines >= 0:
        return engines
    return None


def _condition(
    kind: str,
    flag: tuple[bool, str, str],
    generation: int,
    previous: Mapping[str, Any],
    now: str,
) -> dict[str, Any]:
    value, reason, message = flag
    status = "True" if value else "False"
    before = condition(previous, kind)
    transition = now
    if before is not None and before.get("status") == status and before.get("lastTransitionTime"):
        transition = str(before["lastTransitionTime"])
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": transition,
        "observedGeneration": generation,
    }


def _verdict(
    observation: Observation,
    previous: Mapping[str, Any],
    observed_generation: int | None,
    registered: int | None,
) -> _Verdict:
    if observation.spec_error is not None:
        reason, message = REASON_INVALID_SPEC, observation.spec_error
        return _Verdict(
            DEGRADED, (False, reason, message), (False, reason, message), (True, reason, message)
        )
    if observation.apply_error is not None:
        reason, message = REASON_APPLY_FAILED, observation.apply_error
        return _Verdict(
            DEGRADED, (False, reason, message), (False, reason, message), (True, reason, message)
        )

    problems = pod_problems(observation.pods or ())
    if problems:
        reason = problems[0].reason
        message = "; ".join(p.message for p in problems)
        if len(message) > MAX_PROBLEM_MESSAGE_CHARS:
            message = message[: MAX_PROBLEM_MESSAGE_CHARS - 1] + "…"
        return _Verdict(
            DEGRADED, (False, reason, message), (False, reason, message), (True, reason, message)
        )

    missing = [
        kind
        for kind, obj in (("engine StatefulSet", observation.statefulset),
                          ("coordinator Deployment", observation.coordinator))
        if obj is None
    ]  # fmt: skip
    if missing or observed_generation is None:
        message = f"creating the {' and '.join(missing) or 'children'}"
        return _Verdict(
            PENDING, (False, "Creating", message), (True, "Creating", message), _healthy()
        )

    desired = observation.desired_engines or 0
    statefulset = observation.statefulset or {}
    sts_status = _status_of(statefulset)
    running = int(sts_status.get("replicas") or 0)
    ready = int(sts_status.get("readyReplicas") or 0)
    coordinator_ready = int(_status_of(observation.coordinator).get("readyReplicas") or 0) >= 1
    rollout_done = _rollout_done(statefulset)
    reconciled = observed_generation >= observation.generation

    if registered is None:
        # Without /ready, the coordinator's readiness (it needs >= 1 engine registered) and
        # the engine pods' readiness are the best evidence left.
        engines_serving = ready >= desired and (desired == 0 or coordinator_ready)
        # Pods still leaving after a scale-down cannot be told apart from serving ones.
        engine_pods_settled = running == desired
        engines_text = (
            f"{ready}/{desired} engine pods ready; registered engines unknown "
            f"({observation.health_error or 'coordinator /ready unavailable'})"
        )
    else:
        # What the coordinator routes to is what counts: an engine's pod turns Ready a probe
        # period after it registered. The coordinator pod Ready too: registered engines
        # behind a coordinator whose readiness fails are not served through its Service.
        engines_serving = registered >= desired and (desired == 0 or coordinator_ready)
        # After a scale-down, a pod that is still going away (its engine already handed its
        # requests over and deregistered) does not keep the deployment from Ready.
        engine_pods_settled = running == desired or (running > desired and registered == desired)
        engines_text = f"{registered}/{desired} engines registered, {ready} engine pods ready"
        if not coordinator_ready and desired > 0:
            engines_text += "; the coordinator pod is not Ready"

    if reconciled and rollout_done and engine_pods_settled and engines_serving:
        reason = "ScaledToZero" if desired == 0 else "AllEnginesRegistered"
        message = (
            "no engines requested (dataParallelSize 0): requests wait in the coordinator's queue"
            " (up to queueTimeout) until engines are added, by an edit or by the autoscaler"
            if desired == 0
            else engines_text
        )
        return _Verdict(
            READY, (True, reason, message), (False, "RolloutComplete", message), _healthy()
        )

    previous_phase = previous.get("phase")
    if reconciled and rollout_done and _settled_at(previous, observation.generation):
        # Nobody asked for a change (the spec is the one the deployment was Ready for), yet
        # capacity went missing: an engine crashed, was evicted, deleted or deregistered, or
        # the coordinator restarted. It stays Degraded until everything is back.
        reason = (
            REASON_COORDINATOR_UNAVAILABLE if not coordinator_ready else REASON_ENGINES_UNAVAILABLE
        )
        if running < desired:
            engines_text = f"{running}/{desired} engine pods exist; {engines_text}"
        return _Verdict(
            DEGRADED, (False, reason, engines_text), (False, "RolloutComplete", engines_text),
            (True, reason, engines_text),
        )  # fmt: skip

    if not reconciled:
        reason, message = "Reconciling", "applying the new spec"
    elif running < desired:
        reason, message = "ScalingUp", f"{running}/{desired} engine pods exist; {engines_text}"
    elif running > desired:
        reason, message = "ScalingDown", f"draining engines: {running} pods for {desired} wanted"
    elif not rollout_done:
        updated = int(sts_status.get("updatedReplicas") or 0)
        reason, message = "RollingUpdate", f"{updated}/{desired} engine pods updated"
    else:
        reason, message = "WaitingForEngines", engines_text
    nothing_up = ready == 0 and not registered
    phase = PENDING if nothing_up and previous_phase in (None, PENDING) else PROGRESSING
    return _Verdict(phase, (False, reason, message), (True, reason, message), _healthy())


def _settled_at(previous: Mapping[str, Any], generation: int) -> bool:
    """Whether ``previous`` is a verdict on this very generation that the engines were all
    there for: Ready, or Degraded because capacity went missing since. A spec change since
    (a new generation) means the shortfall was asked for."""
    phase = previous.get("phase")
    if phase == READY:
        verdict = condition(previous, "Ready")
    elif phase == DEGRADED:
        verdict = condition(previous, "Degraded")
        if verdict is None or verdict.get("reason") not in _LOST_CAPACITY:
            return False
    else:
        return False
    return verdict is not None and verdict.get("observedGeneration") == generation


def _healthy() -> tuple[bool, str, str]:
    return (False, "AsExpected", "")


def _rollout_done(statefulset: Mapping[str, Any]) -> bool:
    """Whether the StatefulSet controller has caught up with its spec on every pod."""
    status = _status_of(statefulset)
    generation = (statefulset.get("metadata") or {}).get("generation")
    observed = status.get("observedGeneration")
    if generation is not None and (observed is None or observed < generation):
        return False
    update_revision = status.get("updateRevision")
    if not update_revision or status.get("currentRevision") == update_revision:
        return True
    # Some releases leave currentRevision behind after a completed rolling update; every pod
    # being on the update revision settles it too.
    wanted = int((statefulset.get("spec") or {}).get("replicas") or 0)
    return (
        int(status.get("updatedReplicas") or 0) >= wanted
        and int(status.get("replicas") or 0) == wanted
    )
