"""Pure status computation: phases, conditions, transition times, patches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest

from dpserve_operator.crd import STATUS_SCHEMA
from dpserve_operator.status import (
    DEGRADED,
    NORMAL,
    PENDING,
    PROGRESSING,
    READY,
    WARNING,
    Event,
    Observation,
    compute_status,
    condition,
    phase_event,
    pod_problems,
    scaling_event,
    status_patch,
    sticky_apply_error,
)

SELECTOR = "app.kubernetes.io/component=engine,app.kubernetes.io/instance=demo"
T0, T1, T2 = "2026-01-01T00:00:00Z", "2026-01-01T00:00:02Z", "2026-01-01T00:00:04Z"


def statefulset(
    replicas: int,
    ready: int,
    *,
    wanted: int | None = None,
    current: str = "rev-1",
    update: str = "rev-1",
    updated: int | None = None,
    generation: int = 1,
    observed: int = 1,
) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas if wanted is None else wanted},
        "status": {
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
            "currentRevision": current,
            "updateRevision": update,
            "observedGeneration": observed,
        },
    }


def coordinator(ready: bool) -> dict[str, Any]:
    return {"status": {"replicas": 1, "readyReplicas": 1 if ready else 0}}


def health(engines: int) -> dict[str, Any]:
    return {"status": "ok" if engines else "no_engines", "engines": engines, "draining": 0,
            "queued": 0, "state": "running"}  # fmt: skip


def observe(
    *,
    desired: int | None = 2,
    sts: dict[str, Any] | None = None,
    coord: dict[str, Any] | None = None,
    engines: int | None = None,
    health_error: str | None = None,
    spec_error: str | None = None,
    apply_error: str | None = None,
    generation: int = 1,
) -> Observation:
    return Observation(
        generation=generation,
        spec_error=spec_error,
        apply_error=apply_error,
        desired_engines=desired,
        statefulset=sts,
        coordinator=coord,
        health=None if engines is None else health(engines),
        health_error=health_error,
    )


def compute(
    observation: Observation,
    previous: dict[str, Any] | None = None,
    observed_generation: int | None = 1,
    now: str = T0,
) -> dict[str, Any]:
    return compute_status(
        observation,
        previous=previous,
        observed_generation=observed_generation,
        selector=SELECTOR,
        now=now,
    )


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


SERVING = observe(sts=statefulset(2, 2), coord=coordinator(True), engines=2)


# --------------------------------------------------------------------------- phases


def test_all_engines_registered_is_ready() -> None:
    status = compute(SERVING)
    assert status["phase"] == READY
    assert status["replicas"] == 2 and status["readyReplicas"] == 2
    assert status["registeredEngines"] == 2
    assert status["selector"] == SELECTOR
    assert status["observedGeneration"] == 1
    assert conditions(status) == {
        "Ready": ("True", "AllEnginesRegistered"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert condition(status, "Ready")["message"] == "2/2 engines registered, 2 engine pods ready"


def test_invalid_spec_is_degraded() -> None:
    status = compute(observe(desired=None, spec_error="spec.model: is required"))
    assert status["phase"] == DEGRADED
    degraded = condition(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert degraded["message"] == "spec.model: is required"
    assert conditions(status)["Ready"] == ("False", "InvalidSpec")


def test_apply_failure_is_degraded() -> None:
    status = compute(observe(sts=statefulset(2, 2), apply_error="StatefulSet/demo-engine: 422"))
    assert status["phase"] == DEGRADED
    assert conditions(status)["Degraded"] == ("True", "ApplyFailed")


def test_missing_children_are_pending() -> None:
    status = compute(observe(sts=None, coord=coordinator(False)))
    assert status["phase"] == PENDING
    assert conditions(status)["Progressing"] == ("True", "Creating")
    assert "engine StatefulSet" in condition(status, "Progressing")["message"]
    assert status["replicas"] == 0 and status["readyReplicas"] == 0


def test_first_start_without_ready_engines_is_pending_then_progressing() -> None:
    starting = compute(observe(sts=statefulset(2, 0), coord=coordinator(False), engines=0))
    assert starting["phase"] == PENDING
    assert starting["registeredEngines"] == 0  # read from the coordinator's 503 JSON
    assert conditions(starting)["Progressing"] == ("True", "WaitingForEngines")
    one_up = compute(
        observe(sts=statefulset(2, 1), coord=coordinator(True), engines=1), previous=starting
    )
    assert one_up["phase"] == PROGRESSING
    assert compute(SERVING, previous=one_up)["phase"] == READY


def test_a_new_generation_not_yet_applied_is_progressing() -> None:
    status = compute(
        observe(sts=statefulset(2, 2), coord=coordinator(True), engines=2, generation=2),
        previous=compute(SERVING),
        observed_generation=1,
    )
    assert status["phase"] == PROGRESSING
    assert conditions(status)["Progressing"] == ("True", "Reconciling")
    assert status["observedGeneration"] == 1


@pytest.mark.parametrize(
    ("observation", "reason"),
    [
        # A scale writes the spec: a new generation (2), applied (observed_generation 2).
        (observe(desired=3, sts=statefulset(2, 2, wanted=3), coord=coordinator(True), engines=2,
                 generation=2), "ScalingUp"),
        (observe(desired=1, sts=statefulset(2, 2, wanted=1), coord=coordinator(True), engines=2,
                 generation=2), "ScalingDown"),
        (observe(sts=statefulset(2, 2, current="rev-1", update="rev-2", updated=1),
                 coord=coordinator(True), engines=2, generation=2), "RollingUpdate"),
        # A rollout of the same generation (the operator rotating keys, `kubectl rollout
        # restart`) is no loss either.
        (observe(sts=statefulset(2, 2, generation=2, observed=1), coord=coordinator(True),
                 engines=2), "RollingUpdate"),
    ],
)  # fmt: skip
def test_scaling_and_rollouts_are_progressing(observation: Observation, reason: str) -> None:
    status = compute(
        observation, previous=compute(SERVING), observed_generation=observation.generation
    )
    assert status["phase"] == PROGRESSING
    assert conditions(status)["Progressing"] == ("True", reason)
    assert conditions(status)["Degraded"] == ("False", "AsExpected")


def test_a_patch_from_2_to_3_is_progressing_until_the_third_registers() -> None:
    # Issue 37: right after `kubectl patch ... 3` the StatefulSet reports 3 replicas, 2
    # ready, and 2 engines are registered. That was reported Degraded/EnginesUnavailable.
    ready = compute(SERVING)
    scaled = observe(desired=3, sts=statefulset(3, 2), coord=coordinator(True), engines=2,
                     generation=2)  # fmt: skip
    status = compute(scaled, previous=ready, observed_generation=2)
    assert status["phase"] == PROGRESSING
    assert conditions(status)["Degraded"] == ("False", "AsExpected")
    assert conditions(status)["Progressing"] == ("True", "WaitingForEngines")
    # Registered is what counts: Ready before the new pod's readiness probe runs.
    registered = dataclasses.replace(scaled, health=health(3))
    assert compute(registered, previous=status, observed_generation=2)["phase"] == READY


def test_a_finished_rollout_with_a_stale_current_revision_counts_as_done() -> None:
    sts = statefulset(2, 2, current="rev-1", update="rev-2", updated=2)
    status = compute(observe(sts=sts, coord=coordinator(True), engines=2))
    assert status["phase"] == READY


def test_losing_an_engine_after_ready_is_degraded_then_recovers() -> None:
    ready = compute(SERVING, now=T0)
    lost = compute(
        observe(sts=statefulset(2, 1), coord=coordinator(True), engines=1), previous=ready, now=T1
    )
    assert lost["phase"] == DEGRADED
    assert conditions(lost)["Degraded"] == ("True", "EnginesUnavailable")
    assert condition(lost, "Degraded")["message"].startswith("1/2 engines registered")
    recovered = compute(SERVING, previous=lost, now=T2)
    assert recovered["phase"] == READY
    assert condition(recovered, "Degraded")["status"] == "False"


def test_a_pod_that_runs_but_did_not_register_is_not_ready() -> None:
    status = compute(
        observe(sts=statefulset(2, 2), coord=coordinator(True), engines=1),
        previous=compute(SERVING),
    )
    assert status["phase"] == DEGRADED
    assert status["registeredEngines"] == 1 and status["readyReplicas"] == 2


def test_losing_the_coordinator_after_ready_is_degraded() -> None:
    status = compute(
        observe(sts=statefulset(2, 2), coord=coordinator(False), health_error="connection refused"),
        previous=compute(SERVING),
    )
    assert status["phase"] == DEGRADED
    assert conditions(status)["Degraded"] == ("True", "CoordinatorUnavailable")
    assert "connection refused" in condition(status, "Degraded")["message"]


def test_unreachable_health_falls_back_on_readiness_and_reports_unknown() -> None:
    status = compute(
        observe(sts=statefulset(2, 2), coord=coordinator(True), health_error="403 Forbidden")
    )
    assert status["phase"] == READY
    assert status["registeredEngines"] is None
    assert "registered engines unknown (403 Forbidden)" in condition(status, "Ready")["message"]


def test_zero_engines_is_ready_although_the_coordinator_is_not() -> None:
    status = compute(observe(desired=0, sts=statefulset(0, 0), coord=coordinator(False), engines=0))
    assert status["phase"] == READY
    assert conditions(status)["Ready"] == ("True", "ScaledToZero")


# --------------------------------------------------------------------------- transitions


def test_transition_time_moves_only_when_a_condition_flips() -> None:
    first = compute(observe(sts=statefulset(2, 0), coord=coordinator(False), engines=0), now=T0)
    progressing_since = condition(first, "Progressing")["lastTransitionTime"]
    assert progressing_since == T0
    # Same statuses, new message: the times stay.
    second = compute(
        observe(sts=statefulset(2, 1), coord=coordinator(True), engines=1), previous=first, now=T1
    )
    assert condition(second, "Progressing")["lastTransitionTime"] == T0
    assert condition(second, "Ready")["lastTransitionTime"] == T0
    # Ready flips to True and Progressing to False: both move.
    third = compute(SERVING, previous=second, now=T2)
    assert condition(third, "Ready")["lastTransitionTime"] == T2
    assert condition(third, "Progressing")["lastTransitionTime"] == T2
    assert condition(third, "Degraded")["lastTransitionTime"] == T0


def test_conditions_carry_the_generation_they_describe() -> None:
    status = compute(
        observe(sts=statefulset(2, 2), coord=coordinator(True), engines=2, generation=5),
        observed_generation=5,
    )
    assert {c["observedGeneration"] for c in status["conditions"]} == {5}
    assert [c["type"] for c in status["conditions"]] == ["Ready", "Progressing", "Degraded"]


# --------------------------------------------------------------------------- patches


def test_an_unchanged_world_patches_nothing() -> None:
    first = compute(SERVING, now=T0)
    again = compute(SERVING, previous=first, now=T2)
    assert status_patch(first, again) == {}


def test_patch_holds_only_changed_keys_and_deletes_unknown_counts() -> None:
    before = compute(SERVING, now=T0)
    after = compute(
        observe(sts=statefulset(2, 2), coord=coordinator(True), health_error="timeout"),
        previous=before,
        now=T1,
    )
    patch = status_patch(before, after)
    assert patch["registeredEngines"] is None  # a merge-patch null removes the field
    assert "replicas" not in patch and "selector" not in patch
    assert "conditions" in patch  # the Ready message changed
    assert patch["phase"] == READY  # unchanged, but the verdict is written whole


def test_a_change_of_counts_alone_rewrites_the_verdict_with_it() -> None:
    # Another writer may have left another phase meanwhile: the one written matches the
    # conditions written with it.
    before = compute(SERVING, now=T0)
    # A scale-down's leaving pod still counted: only `replicas` differs.
    after = compute(dataclasses.replace(SERVING, statefulset=statefulset(3, 2, wanted=2)),
                    previous=before, now=T1)  # fmt: skip
    patch = status_patch(before, after)
    assert patch == {"replicas": 3, "phase": READY, "conditions": after["conditions"]}


def test_patch_from_nothing_is_the_whole_status_minus_unknowns() -> None:
    status = compute(observe(sts=None, coord=None))
    patch = status_patch(None, status)
    assert "registeredEngines" not in patch
    assert patch["phase"] == PENDING


def test_sticky_apply_error_lasts_for_its_generation_only() -> None:
    failed = compute(observe(sts=statefulset(2, 2), apply_error="422 Invalid"))
    assert sticky_apply_error(failed, 1) == "422 Invalid"
    assert sticky_apply_error(failed, 2) is None
    assert sticky_apply_error(compute(SERVING), 1) is None
    assert sticky_apply_error(None, 1) is None


# --------------------------------------------------------------------------- the CRD agrees


@pytest.mark.parametrize(
    "observation",
    [
        SERVING,
        observe(desired=None, spec_error="bad"),
        observe(sts=None, coord=None),
        observe(sts=statefulset(2, 2), coord=coordinator(True), health_error="down"),
    ],
)
def test_computed_status_matches_the_crd_status_schema(observation: Observation) -> None:
    schema = STATUS_SCHEMA
    status = {k: v for k, v in compute(observation).items() if v is not None}
    jsonschema.validate(status, schema, format_checker=jsonschema.FormatChecker())
    # Nothing the status writes would be pruned by the API server.
    assert set(status) <= set(schema["properties"])
    for item in status["conditions"]:
        assert set(item) <= set(schema["properties"]["conditions"]["items"]["properties"])


# --------------------------------------------------------------------------- child pods


def pod(
    name: str,
    *,
    waiting: tuple[str, str] | None = None,
    last_terminated: tuple[str, int] | None = None,
    ready: bool = False,
    restarts: int = 0,
    unschedulable: str | None = None,
    memory_limit: str | None = "1Gi",
    deleting: bool = False,
) -> dict[str, Any]:
    """A pod as the API server returns it, with one container named after its component."""
    container = name.rsplit("-", 2)[1] if name.count("-") >= 2 else "main"
    metadata: dict[str, Any] = {"name": name}
    if deleting:
        metadata["deletionTimestamp"] = T0
    status: dict[str, Any] = {"phase": "Pending" if unschedulable else "Running"}
    if unschedulable is not None:
        status["conditions"] = [{"type": "PodScheduled", "status": "False",
                                 "reason": "Unschedulable", "message": unschedulable}]  # fmt: skip
    else:
        state: dict[str, Any] = {"running": {"startedAt": T0}}
        if waiting is not None:
            state = {"waiting": {"reason": waiting[0], "message": waiting[1]}}
        entry: dict[str, Any] = {"name": container, "image": IMAGE, "ready": ready,
                                 "restartCount": restarts, "state": state}  # fmt: skip
        if last_terminated is not None:
            reason, code = last_terminated
            said = "Traceback\nValueError: boom\n"
            terminated = {"reason": reason, "exitCode": code, "message": said}
            entry["lastState"] = {"terminated": terminated}
        status["containerStatuses"] = [entry]
    limits = {"memory": memory_limit} if memory_limit else {}
    spec = {"containers": [{"name": container, "resources": {"limits": limits}}]}
    return {"metadata": metadata, "spec": spec, "status": status}


IMAGE = "ghcr.io/dpserve/runtime-cpu:0.1.0"
BACK_OFF = "back-off 40s restarting failed container=coordinator pod=demo-coordinator-5d9f"


def test_a_pod_that_runs_fine_is_no_problem() -> None:
    assert pod_problems([pod("demo-engine-0", ready=True)]) == []
    # A container that was OOM-killed once but runs and is ready again is fine now.
    recovered = pod("demo-engine-0", ready=True, restarts=1, last_terminated=("OOMKilled", 137))
    assert pod_problems([recovered]) == []


def test_oom_killed_names_the_pod_the_exit_code_and_the_limit() -> None:
    crashing = pod("demo-coordinator-5d9f-x2x", waiting=("CrashLoopBackOff", BACK_OFF),
                   last_terminated=("OOMKilled", 137), restarts=3)  # fmt: skip
    [problem] = pod_problems([crashing])
    assert problem.reason == "OOMKilled"
    for part in ("demo-coordinator-5d9f-x2x", "OOMKilled", "137", "1Gi", "3 time(s)"):
        assert part in problem.message


def test_crash_loop_quotes_the_last_exit_and_says_where_the_logs_are() -> None:
    crashing = pod("demo-engine-1", waiting=("CrashLoopBackOff", BACK_OFF),
                   last_terminated=("Error", 1), restarts=5)  # fmt: skip
    [problem] = pod_problems([crashing])
    assert problem.reason == "CrashLoopBackOff"
    for part in ("demo-engine-1", "exit code 1", "ValueError: boom", BACK_OFF, "--previous"):
        assert part in problem.message


@pytest.mark.parametrize("reason", ["ErrImagePull", "ImagePullBackOff"])
def test_image_pull_failures_are_one_reason_with_the_kubelets_message(reason: str) -> None:
    said = 'rpc error: failed to pull "ghcr.io/dpserve/nope:1": dial tcp: no route to host'
    [problem] = pod_problems([pod("demo-engine-0", waiting=(reason, said))])
    assert problem.reason == "ImagePullBackOff"
    assert said in problem.message and IMAGE in problem.message


def test_unschedulable_quotes_the_scheduler() -> None:
    said = "0/1 nodes are available: 1 Insufficient memory."
    [problem] = pod_problems([pod("demo-engine-2", unschedulable=said)])
    assert (problem.reason, said in problem.message) == ("Unschedulable", True)


def test_pods_being_deleted_are_left_out() -> None:
    gone = pod("demo-engine-0", waiting=("ImagePullBackOff", "x"), deleting=True)
    assert pod_problems([gone]) == []


def test_a_pod_problem_turns_the_deployment_degraded_with_its_reason() -> None:
    oom = pod("demo-coordinator-5d9f-x2x", waiting=("CrashLoopBackOff", BACK_OFF),
              last_terminated=("OOMKilled", 137), restarts=2)  # fmt: skip
    fine = pod("demo-engine-0", ready=True)
    observation = observe(sts=statefulset(2, 0), coord=coordinator(False), engines=0)
    status = compute(dataclasses.replace(observation, pods=[fine, oom]))
    assert status["phase"] == DEGRADED
    degraded = condition(status, "Degraded") or {}
    assert (degraded["status"], degraded["reason"]) == ("True", "OOMKilled")
    assert "demo-coordinator-5d9f-x2x" in degraded["message"]
    assert conditions(status)["Ready"] == ("False", "OOMKilled")
    # Fixed (the pod runs and everything registers): Ready again.
    healed = dataclasses.replace(SERVING, pods=[fine, pod("demo-coordinator-a", ready=True)])
    assert compute(healed, previous=status)["phase"] == READY


def test_registered_engines_behind_an_unready_coordinator_are_not_ready() -> None:
    status = compute(observe(sts=statefulset(2, 2), coord=coordinator(False), engines=2))
    assert status["phase"] != READY
    ready = condition(status, "Ready") or {}
    assert ready["status"] == "False"
    assert "coordinator pod is not Ready" in ready["message"]


# --------------------------------------------------------------------------- transition table


@dataclass(frozen=True)
class Step:
    """One moment of a deployment's life: what the operator observes, and whether a spec
    change brought it (``scaled_by``: "user" for kubectl patch/scale/edit or an HPA, else the
    built-in autoscaler's decision reason, which it posts as an event of its own)."""

    observation: Observation
    scaled_by: str | None = None


def world(
    desired: int,
    running: int,
    ready: int,
    registered: int | None,
    *,
    generation: int = 1,
    coordinator_ready: bool = True,
    pods: list[dict[str, Any]] | None = None,
) -> Observation:
    """The operator's view: the StatefulSet (already at ``desired`` in its spec, as the scale
    handler patches it first), ``running`` pods of which ``ready`` are Ready, ``registered``
    engines in the coordinator's /ready (None: unreachable)."""
    return Observation(
        generation=generation,
        spec_error=None,
        apply_error=None,
        desired_engines=desired,
        statefulset=statefulset(running, ready, wanted=desired),
        coordinator=coordinator(coordinator_ready),
        health=None if registered is None else health(registered),
        health_error="connection refused" if registered is None else None,
        pods=pods,
    )


def replay(steps: list[Step]) -> tuple[list[str], list[tuple[str, str]]]:
    """The phases the status goes through and the events posted meanwhile, as the handlers
    post them: the scale handler's ``scaling_event`` for each change of the count (and the
    autoscaler's own event for its changes), ``phase_event`` for each status written. Every
    step is observed after its generation was applied."""
    phases: list[str] = []
    events: list[Event] = []
    status: dict[str, Any] | None = None
    desired: int | None = None
    for step in steps:
        now = step.observation.desired_engines
        if step.scaled_by is not None:
            assert desired is not None and now != desired, "a scale step changes the count"
            if step.scaled_by != "user":
                events.append(Event(NORMAL, step.scaled_by, "the autoscaler's reading"))
            events.append(scaling_event(desired, now or 0))
        else:
            assert status is None or now == desired, "only a scale step changes the count"
        desired = now
        new = compute(
            step.observation, previous=status, observed_generation=step.observation.generation
        )
        event = phase_event(status, new)
        if event is not None:
            events.append(event)
        phases.append(new["phase"])
        status = new
    return phases, [(event.type, event.reason) for event in events]


def engine_pod(index: int, **problem: Any) -> dict[str, Any]:
    return pod(f"demo-engine-{index}", **problem)


PULL_FAILURE = ("ErrImagePull", 'failed to pull "ghcr.io/dpserve/runtime-cpu:0.1.0": not found')
OOM_LOOP = {"waiting": ("CrashLoopBackOff", BACK_OFF), "last_terminated": ("OOMKilled", 137),
            "restarts": 2}  # fmt: skip
R, P, D = READY, PROGRESSING, DEGRADED
SCALING = (NORMAL, "Scaling")
BECAME_READY = (NORMAL, "Ready")

TRANSITIONS = {
    # kubectl patch 2 -> 3, as issue 37 saw it: the StatefulSet at 3 replicas with 2 ready
    # and 2 registered is the new engine starting, not capacity lost; Ready the moment the
    # third engine registers, before its pod's readiness probe has run.
    "scale up 2 -> 3": (
        [Step(world(2, 2, 2, 2)),
         Step(world(3, 2, 2, 2, generation=2), scaled_by="user"),
         Step(world(3, 3, 2, 2, generation=2)),
         Step(world(3, 3, 2, 3, generation=2)),
         Step(world(3, 3, 3, 3, generation=2))],
        [R, P, P, R, R],
        [BECAME_READY, SCALING, BECAME_READY],
    ),
    # kubectl scale 3 -> 2: the leaving engine hands its requests over and deregisters;
    # Ready then, while the kubelet still removes its pod.
    "scale down 3 -> 2": (
        [Step(world(3, 3, 3, 3)),
         Step(world(2, 3, 3, 3, generation=2), scaled_by="user"),
         Step(world(2, 3, 2, 2, generation=2)),
         Step(world(2, 2, 2, 2, generation=2))],
        [R, P, R, R],
        [BECAME_READY, SCALING, BECAME_READY],
    ),
    # Nobody asked: kubectl delete pod, a crash, an eviction. Degraded (one Warning) until
    # the replacement registers, also while the StatefulSet counts one pod.
    "pod lost": (
        [Step(world(2, 2, 2, 2)),
         Step(world(2, 2, 1, 1)),
         Step(world(2, 1, 1, 1)),
         Step(world(2, 2, 1, 1)),
         Step(world(2, 2, 2, 2))],
        [R, D, D, D, R],
        [BECAME_READY, (WARNING, "EnginesUnavailable"), BECAME_READY],
    ),
    "coordinator restarted": (
        [Step(world(2, 2, 2, 2)),
         Step(world(2, 2, 2, None, coordinator_ready=False)),
         Step(world(2, 2, 2, 1)),
         Step(world(2, 2, 2, 2))],
        [R, D, D, R],
        [BECAME_READY, (WARNING, "CoordinatorUnavailable"), BECAME_READY],
    ),
    # A scale that cannot come: the new pod's image cannot be pulled.
    "image pull failure on scale up": (
        [Step(world(2, 2, 2, 2, pods=[engine_pod(0, ready=True), engine_pod(1, ready=True)])),
         Step(world(3, 3, 2, 2, generation=2,
                    pods=[engine_pod(0, ready=True), engine_pod(1, ready=True),
                          engine_pod(2, waiting=PULL_FAILURE)]), scaled_by="user"),
         Step(world(3, 3, 2, 2, generation=2,
                    pods=[engine_pod(0, ready=True), engine_pod(1, ready=True),
                          engine_pod(2, waiting=("ImagePullBackOff", "back-off"))]))],
        [R, D, D],
        [BECAME_READY, SCALING, (WARNING, "ImagePullBackOff")],
    ),
    "engine OOM-killed": (
        [Step(world(2, 2, 2, 2)),
         Step(world(2, 2, 1, 1, pods=[engine_pod(0, ready=True), engine_pod(1, **OOM_LOOP)])),
         Step(world(2, 2, 2, 2, pods=[engine_pod(0, ready=True), engine_pod(1, ready=True)]))],
        [R, D, R],
        [BECAME_READY, (WARNING, "OOMKilled"), BECAME_READY],
    ),
    "unschedulable on scale up": (
        [Step(world(2, 2, 2, 2)),
         Step(world(3, 3, 2, 2, generation=2,
                    pods=[engine_pod(2, unschedulable="0/1 nodes are available")]),
              scaled_by="user")],
        [R, D],
        [BECAME_READY, SCALING, (WARNING, "Unschedulable")],
    ),
    # The built-in autoscaler writes the scale subresource: a spec change like any other.
    "autoscaler up 2 -> 3 and down again": (
        [Step(world(2, 2, 2, 2)),
         Step(world(3, 2, 2, 2, generation=2), scaled_by="ScaledUp"),
         Step(world(3, 3, 2, 2, generation=2)),
         Step(world(3, 3, 3, 3, generation=2)),
         Step(world(2, 3, 3, 3, generation=3), scaled_by="ScaledDown"),
         Step(world(2, 2, 2, 2, generation=3))],
        [R, P, P, R, P, R],
        [BECAME_READY, (NORMAL, "ScaledUp"), SCALING, BECAME_READY,
         (NORMAL, "ScaledDown"), SCALING, BECAME_READY],
    ),
    "autoscaler from zero and back to zero": (
        [Step(world(0, 0, 0, 0, coordinator_ready=False)),
         Step(world(1, 1, 0, 0, generation=2, coordinator_ready=False), scaled_by="ScaledFromZero"),
         Step(world(1, 1, 1, 1, generation=2)),
         Step(world(0, 1, 1, 1, generation=3), scaled_by="ScaledToZero"),
         Step(world(0, 1, 0, 0, generation=3, coordinator_ready=False))],
        [R, P, R, P, R],
        [BECAME_READY, (NORMAL, "ScaledFromZero"), SCALING, BECAME_READY,
         (NORMAL, "ScaledToZero"), SCALING, BECAME_READY],
    ),
    # Asked for while short: the change is what the status follows from then on.
    "scale up while an engine is missing": (
        [Step(world(2, 2, 2, 2)),
         Step(world(2, 2, 1, 1)),
         Step(world(3, 3, 1, 1, generation=2), scaled_by="user"),
         Step(world(3, 3, 3, 3, generation=2))],
        [R, D, P, R],
        [BECAME_READY, (WARNING, "EnginesUnavailable"), SCALING, BECAME_READY],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(TRANSITIONS))
def test_transitions_phases_and_events(name: str) -> None:
    steps, phases, events = TRANSITIONS[name]
    seen_phases, seen_events = replay(steps)
    assert (seen_phases, seen_events) == (phases, events)


def test_a_scale_nobody_asked_for_is_never_a_warning() -> None:
    # Every row whose steps are either steady or asked-for scales of pods that can run.
    for name in ("scale up 2 -> 3", "scale down 3 -> 2", "autoscaler up 2 -> 3 and down again",
                 "autoscaler from zero and back to zero"):  # fmt: skip
        phases, events = replay(TRANSITIONS[name][0])
        assert DEGRADED not in phases, name
        assert all(kind == NORMAL for kind, _ in events), (name, events)
