"""A stand-in kubelet that runs a Node's Pods as local processes.

`NodeAgent` watches the Pods bound to one Node (see `tests.e2e.cluster`) and,
for each, runs every container's ``command`` + ``args`` as a subprocess on this
machine, reporting status back to the API server the way kubelet would.

What it does, and where it differs from kubelet:

* The image is ignored: a container must have ``command`` (the argv the
  container would run). ``$(VAR)`` references are expanded like Kubernetes does.
* Environment: the agent's own environment minus ``PYTEST_*`` (PATH gets the
  current virtualenv's bin dir first, so ``python`` and ``dpserve`` resolve
  there), then the agent's ``pod_env`` (the fixture sets KUBECONFIG to the test
  cluster's: no service-account token is mounted; and the runtime image's
  prebuilt CPU kernels, with no compiler), then HOSTNAME (the Pod's
  name), then ``envFrom`` and ``env`` (``value``, ``fieldRef``, ``secretKeyRef``,
  ``configMapKeyRef``). ``secret`` volumes the container mounts are written
  (their ``items`` or every key, with ``mode``/``defaultMode``) to a fresh
  per-container directory at each start, and a mountPath at the start of an
  argv element or env value is rewritten to that directory. Other volumes,
  ports, resources and securityContext are ignored;
  ``workingDir`` is used if it exists here, else a per-Pod scratch directory.
* Networking: every Pod shares 127.0.0.1 (it is the reported podIP/hostIP), so
  two Pods listening on the same port collide. There is no DNS: Service names
  in argv and env are rewritten to ``127.0.0.1`` (see `ServiceNameRewriter`).
* Probes: httpGet, tcpSocket and exec for readiness, liveness and startup,
  always against 127.0.0.1. They run every ``min(periodSeconds, 1 s)`` so
  tests do not wait out kubelet's 10 s default period.
* Restarts (restartPolicy Always/OnFailure) back off 1 s, 2 s, 4 s ... 16 s
  instead of kubelet's 10 s ... 5 min.
* Termination: on deletionTimestamp the agent runs ``lifecycle.preStop``
  (exec or httpGet), sends SIGTERM to the container's main process, waits out
  the grace period, SIGKILLs the process group and deletes the Pod with grace
  period 0 (guarded by a UID precondition).
* Each container's stdout and stderr go to ``<log_dir>/<ns>_<pod>_<container>.log``;
  `NodeAgent.read_log` and `NodeAgent.wait_for_log` read them. The agent's own
  decisions go to ``<log_dir>/agent.log``.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.utils.quantity import parse_quantity

from tests.e2e.cluster import DEFAULT_NODE_NAME, LOOPBACK, kill_process_group, parent_death_prefix

JSON = dict[str, Any]

STRATEGIC_MERGE = "application/strategic-merge-patch+json"
TICK_SECONDS = 0.2
MAX_PROBE_PERIOD = 1.0
BACKOFF_BASE_SECONDS = 1.0
BACKOFF_CAP_SECONDS = 16.0
# A container that stayed up this long starts its next backoff from scratch.
BACKOFF_RESET_SECONDS = 30.0
# Grace for processes of Pods that vanished from the API without a graceful delete.
FORCED_KILL_GRACE_SECONDS = 2.0


def shorten(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# -- $(VAR) expansion ---------------------------------------------------------------


def expand_vars(text: str, mapping: Mapping[str, str]) -> str:
    """Expand ``$(NAME)`` as Kubernetes does for command, args and env values.

    ``$$`` escapes a dollar; references to undefined variables stay verbatim.
    A port of k8s.io/kubernetes/third_party/forked/golang/expansion.
    """
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    while cursor < len(text):
        if text[cursor] == "$" and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            rest = text[cursor + 1 :]
            if rest[0] == "$":
                out.append("$")
                advance = 1
            elif rest[0] == "(":
                close = rest.find(")", 1)
                if close == -1:
                    out.append("$(")
                    advance = 1
                else:
                    name = rest[1:close]
                    out.append(mapping.get(name, f"$({name})"))
                    advance = close + 1
            else:
                out.append("$" + rest[0])
                advance = 1
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    out.append(text[checkpoint:])
    return "".join(out)


# -- Service name rewriting ----------------------------------------------------------

_DNS_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"


class ServiceNameRewriter:
    """Rewrites Service host names in a Pod's argv and env to 127.0.0.1.

    Qualified names are rewritten wherever they stand as a whole host name:
    ``svc.ns``, ``svc.ns.svc``, ``svc.ns.svc.cluster.local`` (for Services of
    any namespace) and ``pod.svc.ns...`` (a headless Service's per-Pod name).
    A bare ``svc`` of the Pod's own namespace is rewritten only where it looks
    like a host: after ``://``, ``@``, ``=`` or ``,``, or at the start of the
    string, and followed by ``:<digit>``, ``/`` or the end of the string. So an
    argv element or env value equal to a Service's name is rewritten too.
    """

    def __init__(self, services: Iterable[tuple[str, str]], namespace: str) -> None:
        pairs = sorted(set(services), key=lambda pair: (-len(pair[0]), pair))
        qualified = "|".join(f"{re.escape(svc)}\\.{re.escape(ns)}" for svc, ns in pairs)
        local = sorted({svc for svc, ns in pairs if ns == namespace}, key=lambda s: (-len(s), s))
        self._qualified = (
            re.compile(
                r"(?<![A-Za-z0-9._-])"
                rf"(?:{_DNS_LABEL}\.)?(?:{qualified})(?:\.svc(?:\.cluster\.local)?)?"
                r"(?![A-Za-z0-9_-]|\.[A-Za-z0-9])"
            )
            if pairs
            else None
        )
        self._bare = (
            re.compile(
                r"(?:(?<=://)|(?<=@)|(?<==)|(?<=,)|^)"
                rf"(?:{'|'.join(re.escape(svc) for svc in local)})"
                r"(?=:\d|/|$)"
            )
            if local
            else None
        )

    def __call__(self, text: str) -> str:
        if self._qualified is not None:
            text = self._qualified.sub(LOOPBACK, text)
        if self._bare is not None:
            text = self._bare.sub(LOOPBACK, text)
        return text


# -- container runtime ---------------------------------------------------------------


class ContainerConfigError(Exception):
    """The container cannot be started yet (kubelet's CreateContainerConfigError)."""


@dataclass
class ProbeState:
    successes: int = 0
    failures: int = 0
    last_run: float = 0.0
    ok: bool = False


@dataclass
class ContainerRunner:
    """One container of a Pod: its process, restarts, probes and reported state."""

    spec: JSON
    log_path: Path
    is_init: bool = False
    process: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None
    argv: list[str] = field(default_factory=list)
    # The full process environment, and the part the Pod spec declared (what
    # $(VAR) in exec handlers may refer to).
    env: dict[str, str] = field(default_factory=dict)
    declared_env: dict[str, str] = field(default_factory=dict)
    # Container paths (volume mounts) and Service names → local ones, for exec handlers.
    rewrite: Callable[[str], str] = str
    restart_count: int = 0
    started_at: str | None = None
    started_monotonic: float = 0.0
    # Set when the process ended and will not (yet) be restarted.
    terminated: JSON | None = None
    last_terminated: JSON | None = None
    waiting_reason: str = "ContainerCreating"
    waiting_message: str = ""
    next_start: float = 0.0
    backoff_seconds: float = 0.0
    started: bool = False
    ready: bool = False
    readiness: ProbeState = field(default_factory=ProbeState)
    liveness: ProbeState = field(default_factory=ProbeState)
    startup: ProbeState = field(default_factory=ProbeState)

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def state(self) -> JSON:
        if self.alive():
            return {"running": {"startedAt": self.started_at}}
        if self.terminated is not None:
            return {"terminated": self.terminated}
        waiting: JSON = {"reason": self.waiting_reason}
        if self.waiting_message:
            waiting["message"] = self.waiting_message
        return {"waiting": waiting}

    def status(self) -> JSON:
        status: JSON = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.ready and self.alive(),
            "started": self.started and self.alive(),
            "restartCount": self.restart_count,
            "state": self.state(),
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
        }
        if self.process is not None:
            status["containerID"] = f"dpserve://{self.process.pid}"
        return status


class PodWorker(threading.Thread):
    """Runs one Pod (identified by UID) from first sight until it is deleted."""

    def __init__(self, agent: NodeAgent, pod: JSON) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.agent = agent
        self.namespace: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        self.uid: str = meta["uid"]
        self._pod = pod
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._kill_lock = threading.Lock()
        self._gone_from_api = False
        self.finished = threading.Event()
        self.start_time = utc_now()
        self.workdir = agent.work_dir / f"{self.namespace}_{self.pod_name}_{self.uid[:8]}"
        spec = pod["spec"]
        self.init_runners = [
            ContainerRunner(c, self._log_path(c["name"]), is_init=True)
            for c in spec.get("initContainers") or []
        ]
        self.runners = [ContainerRunner(c, self._log_path(c["name"])) for c in spec["containers"]]
        self._last_status: JSON | None = None
        self._transition_times: dict[str, tuple[str, str]] = {}

    # -- inputs from the watch ---------------------------------------------------

    @property
    def pod(self) -> JSON:
        with self._lock:
            return self._pod

    def update(self, pod: JSON) -> None:
        with self._lock:
            self._pod = pod
        self._wake.set()

    def mark_gone(self) -> None:
        """The Pod left the API (force-deleted): stop its processes without ceremony."""
        self._gone_from_api = True
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    # -- main loop ---------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        except Exception:
            self.agent.log.exception("pod worker %s/%s crashed", self.namespace, self.pod_name)
            self.agent.record_error(f"pod worker {self.namespace}/{self.pod_name} crashed")
        finally:
            self.kill_all(FORCED_KILL_GRACE_SECONDS)
            self.finished.set()

    def _run(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        pod = self.pod
        if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            # Finished under an earlier agent; only its deletion is left to handle.
            self._wait_for_deletion()
            return
        while not self.agent.stopping.is_set():
            pod = self.pod
            if self._gone_from_api:
                self.agent.log.info("%s/%s left the API; killing", self.namespace, self.pod_name)
                return
            if pod["metadata"].get("deletionTimestamp"):
                self._terminate_gracefully(pod)
                self._delete_from_api(pod)
                return
            now = time.monotonic()
            initialized = self._tick_init_containers(pod, now)
            if initialized:
                for runner in self.runners:
                    self._tick_container(pod, runner, now)
            self._report_status(pod, initialized)
            if self._phase(initialized) in ("Succeeded", "Failed"):
                self._wait_for_deletion()
                return
            self._wake.wait(TICK_SECONDS)
            self._wake.clear()

    def _wait_for_deletion(self) -> None:
        while not self.agent.stopping.is_set() and not self._gone_from_api:
            pod = self.pod
            if pod["metadata"].get("deletionTimestamp"):
                self._delete_from_api(pod)
                return
            self._wake.wait(1.0)
            self._wake.clear()

    # -- containers --------------------------------------------------------------

    def _restart_policy(self) -> str:
        return str(self.pod["spec"].get("restartPolicy") or "Always")

    def _tick_init_containers(self, pod: JSON, now: float) -> bool:
        """Run init containers one after another; True once all exited 0."""
        for runner in self.init_runners:
            if runner.terminated is not None and runner.terminated.get("exitCode") == 0:
                continue
            self._tick_container(pod, runner, now)
            return False
        return True

    def _tick_container(self, pod: JSON, runner: ContainerRunner, now: float) -> None:
        if runner.process is not None and not runner.alive():
            self._on_exit(runner, now)
        if runner.process is None or not runner.alive():
            if runner.terminated is None and now >= runner.next_start:
                self._start_container(pod, runner, now)
            return
        self._run_probes(runner, now)

    def _on_exit(self, runner: ContainerRunner, now: float) -> None:
        assert runner.process is not None
        code = runner.process.returncode
        # A negative return code is death by signal; report it like a shell would.
        exit_code = code if code >= 0 else 128 - code
        terminated: JSON = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": runner.started_at,
            "finishedAt": utc_now(),
            "containerID": f"dpserve://{runner.process.pid}",
        }
        if code < 0:
            terminated["signal"] = -code
        self.agent.log.info(
            "%s/%s container %s exited with %s",
            self.namespace,
            self.pod_name,
            runner.name,
            exit_code,
        )
        if runner.log_file is not None:
            runner.log_file.close()
            runner.log_file = None
        runner.process = None
        runner.ready = False
        runner.started = False
        policy = self._restart_policy()
        restart = policy == "Always" or (policy == "OnFailure" and exit_code != 0)
        if runner.is_init and exit_code == 0:
            restart = False
        elif runner.is_init:
            restart = policy != "Never"
        if not restart:
            runner.terminated = terminated
            return
        runner.last_terminated = terminated
        runner.restart_count += 1
        if now - runner.started_monotonic > BACKOFF_RESET_SECONDS:
            runner.backoff_seconds = 0.0
        runner.backoff_seconds = min(
            BACKOFF_CAP_SECONDS, max(BACKOFF_BASE_SECONDS, runner.backoff_seconds * 2)
        )
        runner.next_start = now + runner.backoff_seconds
        runner.waiting_reason = "CrashLoopBackOff"
        runner.waiting_message = (
            f"back-off {runner.backoff_seconds:.0f}s restarting failed container={runner.name}"
        )

    def _start_container(self, pod: JSON, runner: ContainerRunner, now: float) -> None:
        try:
            argv, env, declared, rewrite = self.agent.build_process_config(pod, runner.spec)
        except ContainerConfigError as exc:
            runner.waiting_reason = "CreateContainerConfigError"
            runner.waiting_message = str(exc)
            runner.next_start = now + 1.0
            return
        working_dir = runner.spec.get("workingDir")
        cwd = working_dir if working_dir and os.path.isdir(working_dir) else str(self.workdir)
        # Only the program writes here (like `kubectl logs`); starts go to agent.log.
        runner.log_file = runner.log_path.open("ab")
        try:
            runner.process = subprocess.Popen(
                [*parent_death_prefix(), *argv],
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=runner.log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            runner.log_file.close()
            runner.log_file = None
            runner.waiting_reason = "RunContainerError"
            runner.waiting_message = str(exc)
            runner.next_start = now + max(BACKOFF_BASE_SECONDS, runner.backoff_seconds)
            return
        runner.argv, runner.env, runner.declared_env = argv, env, declared
        runner.rewrite = rewrite
        runner.started_at = utc_now()
        runner.started_monotonic = now
        runner.waiting_reason, runner.waiting_message = "", ""
        runner.readiness, runner.liveness, runner.startup = ProbeState(), ProbeState(), ProbeState()
        runner.started = "startupProbe" not in runner.spec
        runner.ready = runner.started and "readinessProbe" not in runner.spec
        self.agent.log.info(
            "%s/%s container %s started pid %d (restart #%d): %s",
            self.namespace,
            self.pod_name,
            runner.name,
            runner.process.pid,
            runner.restart_count,
            shorten(repr(argv)),
        )

    def _run_probes(self, runner: ContainerRunner, now: float) -> None:
        if runner.is_init:
            return
        since_start = now - runner.started_monotonic
        if not runner.started:
            probe = runner.spec["startupProbe"]
            if self._probe_due(probe, runner.startup, now, since_start):
                if self._probe(probe, runner, runner.startup, now) and runner.startup.ok:
                    runner.started = True
                elif runner.startup.failures >= int(probe.get("failureThreshold") or 3):
                    self._restart_unhealthy(runner, "startup")
            if not runner.started:
                return
        readiness = runner.spec.get("readinessProbe")
        if readiness and self._probe_due(readiness, runner.readiness, now, since_start):
            self._probe(readiness, runner, runner.readiness, now)
            runner.ready = runner.readiness.ok
        liveness = runner.spec.get("livenessProbe")
        if liveness and self._probe_due(liveness, runner.liveness, now, since_start):
            self._probe(liveness, runner, runner.liveness, now)
            if runner.liveness.failures >= int(liveness.get("failureThreshold") or 3):
                self._restart_unhealthy(runner, "liveness")

    @staticmethod
    def _probe_due(probe: JSON, state: ProbeState, now: float, since_start: float) -> bool:
        if since_start < float(probe.get("initialDelaySeconds") or 0):
            return False
        period = min(float(probe.get("periodSeconds") or 10), MAX_PROBE_PERIOD)
        return now - state.last_run >= period

    def _probe(self, probe: JSON, runner: ContainerRunner, state: ProbeState, now: float) -> bool:
        """Run one probe, update its counters; True when its thresholds flipped it."""
        state.last_run = now
        success = self.agent.run_handler(probe, runner, float(probe.get("timeoutSeconds") or 1))
        if success:
            state.successes += 1
            state.failures = 0
            if not state.ok and state.successes >= int(probe.get("successThreshold") or 1):
                state.ok = True
                return True
        else:
            state.failures += 1
            state.successes = 0
            if state.ok and state.failures >= int(probe.get("failureThreshold") or 3):
                state.ok = False
                return True
        return False

    def _restart_unhealthy(self, runner: ContainerRunner, which: str) -> None:
        self.agent.log.info(
            "%s/%s container %s failed its %s probe; killing",
            self.namespace,
            self.pod_name,
            runner.name,
            which,
        )
        grace = self._grace_seconds(self.pod)
        self._stop_container(runner, grace, run_pre_stop=True)
        # _on_exit applies the restart policy on the next tick.

    # -- termination -------------------------------------------------------------

    def _grace_seconds(self, pod: JSON) -> float:
        meta, spec = pod["metadata"], pod["spec"]
        for value in (
            meta.get("deletionGracePeriodSeconds"),
            spec.get("terminationGracePeriodSeconds"),
        ):
            if value is not None:
                return float(value)
        return 30.0

    def _stop_container(self, runner: ContainerRunner, grace: float, run_pre_stop: bool) -> None:
        """preStop, SIGTERM to the main process, wait the grace period, SIGKILL the group."""
        process = runner.process
        if process is None or process.poll() is not None:
            return
        deadline = time.monotonic() + grace
        pre_stop = (runner.spec.get("lifecycle") or {}).get("preStop")
        if run_pre_stop and pre_stop:
            self.agent.log.info(
                "%s/%s running preStop of %s", self.namespace, self.pod_name, runner.name
            )
            self.agent.run_handler(pre_stop, runner, max(0.1, deadline - time.monotonic()))
        # Like a container runtime: TERM goes to the main process only; the
        # rest of the process group dies with SIGKILL after the grace period.
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.agent.log.info(
                "%s/%s container %s outlived its grace period; SIGKILL",
                self.namespace,
                self.pod_name,
                runner.name,
            )
        kill_process_group(process, grace_seconds=0)

    def _terminate_gracefully(self, pod: JSON) -> None:
        grace = self._grace_seconds(pod)
        self.agent.log.info(
            "%s/%s deleted; terminating with grace %.0fs", self.namespace, self.pod_name, grace
        )
        # Containers stop in parallel, each within the same grace period.
        threads = [
            threading.Thread(target=self._stop_container, args=(runner, grace, True), daemon=True)
            for runner in [*self.init_runners, *self.runners]
            if runner.alive()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(grace + 15)
        for runner in [*self.init_runners, *self.runners]:
            if runner.process is not None and runner.process.poll() is not None:
                self._on_exit_final(runner)

    def _on_exit_final(self, runner: ContainerRunner) -> None:
        if runner.log_file is not None:
            runner.log_file.close()
            runner.log_file = None

    def kill_all(self, grace: float) -> None:
        # Both this worker's thread and NodeAgent.stop() may get here.
        with self._kill_lock:
            for runner in [*self.init_runners, *self.runners]:
                if runner.process is not None:
                    self._stop_container(runner, grace, run_pre_stop=False)
                if runner.log_file is not None:
                    runner.log_file.close()
                    runner.log_file = None

    def _delete_from_api(self, pod: JSON) -> None:
        body = k8s.V1DeleteOptions(
            grace_period_seconds=0, preconditions=k8s.V1Preconditions(uid=self.uid)
        )
        try:
            self.agent.core.delete_namespaced_pod(self.pod_name, self.namespace, body=body)
            self.agent.log.info("%s/%s deleted from the API", self.namespace, self.pod_name)
        except ApiException as exc:
            # 404: already gone; 409: the name now belongs to a newer Pod.
            if exc.status not in (404, 409):
                raise

    # -- status ------------------------------------------------------------------

    def _phase(self, initialized: bool) -> str:
        if any(r.terminated and r.terminated.get("exitCode") for r in self.init_runners):
            return "Failed"
        if not initialized:
            return "Pending"
        if any(r.alive() for r in self.runners):
            return "Running"
        if all(r.terminated is not None for r in self.runners):
            ok = all(r.terminated and r.terminated.get("exitCode") == 0 for r in self.runners)
            return "Succeeded" if ok else "Failed"
        # Between restarts, or still starting.
        return (
            "Running" if any(r.restart_count or r.started_at for r in self.runners) else "Pending"
        )

    def _condition(self, kind: str, ok: bool) -> JSON:
        status = "True" if ok else "False"
        previous = self._transition_times.get(kind)
        if previous is None or previous[0] != status:
            self._transition_times[kind] = (status, utc_now())
        return {
            "type": kind,
            "status": status,
            "lastTransitionTime": self._transition_times[kind][1],
        }

    def _report_status(self, pod: JSON, initialized: bool) -> None:
        phase = self._phase(initialized)
        containers_ready = initialized and all(r.ready and r.alive() for r in self.runners)
        status: JSON = {
            "phase": phase,
            "hostIP": LOOPBACK,
            "podIP": LOOPBACK,
            "podIPs": [{"ip": LOOPBACK}],
            "startTime": self.start_time,
            "conditions": [
                self._condition("PodScheduled", True),
                self._condition("Initialized", initialized),
                self._condition("ContainersReady", containers_ready),
                self._condition("Ready", containers_ready),
            ],
            "containerStatuses": [r.status() for r in self.runners],
        }
        if self.init_runners:
            status["initContainerStatuses"] = [r.status() for r in self.init_runners]
        if status == self._last_status:
            return
        try:
            self.agent.core.patch_namespaced_pod_status(
                self.pod_name, self.namespace, {"status": status}, _content_type=STRATEGIC_MERGE
            )
        except ApiException as exc:
            if exc.status == 404:
                self.mark_gone()
                return
            self.agent.log.warning(
                "status patch of %s/%s failed: %s", self.namespace, self.pod_name, exc
            )
            return
        self._last_status = status

    def _log_path(self, container: str) -> Path:
        return self.agent.log_path(self.namespace, self.pod_name, container)


class NodeAgent:
    """Plays kubelet for one Node: runs its Pods as local processes.

    Usable from synchronous code: `start()` spawns background threads and
    returns; `stop()` kills every process it started.
    """

    def __init__(
        self,
        kubeconfig: Path | str,
        node_name: str = DEFAULT_NODE_NAME,
        log_dir: Path | None = None,
        pod_env: Mapping[str, str] | None = None,
    ) -> None:
        """`pod_env` is added to every container's environment, below what the Pod declares."""
        self.kubeconfig = Path(kubeconfig)
        self.node_name = node_name
        self.pod_env = dict(pod_env or {})
        self._own_dirs = log_dir is None
        base = Path(tempfile.mkdtemp(prefix="dpserve-node-")) if log_dir is None else Path(log_dir)
        self.log_dir = base
        self.work_dir = base / "work"
        self.stopping = threading.Event()
        self.errors: list[str] = []
        self._workers: dict[str, PodWorker] = {}
        self._workers_lock = threading.Lock()
        self._watch_thread: threading.Thread | None = None
        self._api_client: Any = None
        self.core: k8s.CoreV1Api
        self.log = logging.getLogger(f"dpserve.node_agent.{node_name}")
        self._log_handler: logging.Handler | None = None

    def __enter__(self) -> NodeAgent:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        from kubernetes import config

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(self.log_dir / "agent.log")
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(threadName)s %(message)s")
        )
        self.log.addHandler(handler)
        self.log.setLevel(logging.INFO)
        self._log_handler = handler
        configuration = k8s.Configuration()
        config.load_kube_config(
            config_file=str(self.kubeconfig), client_configuration=configuration
        )
        self._api_client = k8s.ApiClient(configuration)
        self.core = k8s.CoreV1Api(self._api_client)
        ready = threading.Event()
        self._watch_thread = threading.Thread(
            target=self._watch_loop, args=(ready,), name="node-agent-watch", daemon=True
        )
        self._watch_thread.start()
        if not ready.wait(30):
            self.stop()
            raise RuntimeError(f"node agent could not list Pods; see {self.log_dir / 'agent.log'}")

    def stop(self) -> None:
        """Kill every process this agent started and stop its threads."""
        self.stopping.set()
        with self._workers_lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.wake()
        for worker in workers:
            worker.finished.wait(FORCED_KILL_GRACE_SECONDS + 10)
            # Belt and braces if the worker thread is stuck in an API call.
            worker.kill_all(0)
        if self._watch_thread is not None:
            self._watch_thread.join(timeout=15)
        if self._api_client is not None:
            self._api_client.close()
            self._api_client = None
        if self._log_handler is not None:
            self.log.removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None
        if self._own_dirs and not os.environ.get("DPSERVE_E2E_KEEP"):
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def record_error(self, message: str) -> None:
        self.errors.append(message)

    # -- watch -------------------------------------------------------------------

    def _watch_loop(self, ready: threading.Event) -> None:
        selector = f"spec.nodeName={self.node_name}"
        while not self.stopping.is_set():
            try:
                response = self.core.list_pod_for_all_namespaces(
                    field_selector=selector, _preload_content=False, _request_timeout=30
                )
                listing = json.loads(response.data)
                self._sync(listing.get("items") or [])
                ready.set()
                version = listing["metadata"]["resourceVersion"]
                while not self.stopping.is_set():
                    version = self._watch_once(selector, version)
            except _RelistNeeded:
                continue
            except Exception as exc:
                if self.stopping.is_set():
                    return
                self.log.warning("pod watch failed (%s); relisting", exc)
                time.sleep(1)

    def _watch_once(self, selector: str, version: str) -> str:
        # A short server-side timeout bounds how long stop() waits for this thread.
        response = self.core.list_pod_for_all_namespaces(
            field_selector=selector,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=5,
            _preload_content=False,
            _request_timeout=(10, 30),
        )
        try:
            for line in response:
                if self.stopping.is_set():
                    break
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    # Usually 410 Gone: our resourceVersion is too old.
                    raise _RelistNeeded(str(obj.get("message")))
                version = obj.get("metadata", {}).get("resourceVersion", version)
                if kind == "BOOKMARK":
                    continue
                if kind == "DELETED":
                    self._forget(obj)
                else:
                    self._dispatch(obj)
        finally:
            response.release_conn()
        return version

    def _sync(self, pods: list[JSON]) -> None:
        seen = {pod["metadata"]["uid"] for pod in pods}
        with self._workers_lock:
            stale = [w for uid, w in self._workers.items() if uid not in seen]
        for worker in stale:
            worker.mark_gone()
        for pod in pods:
            self._dispatch(pod)

    def _dispatch(self, pod: JSON) -> None:
        uid = pod["metadata"]["uid"]
        with self._workers_lock:
            if self.stopping.is_set():
                return
            worker = self._workers.get(uid)
            if worker is None:
                worker = PodWorker(self, pod)
                self._workers[uid] = worker
                worker.start()
                return
        worker.update(pod)

    def _forget(self, pod: JSON) -> None:
        with self._workers_lock:
            worker = self._workers.get(pod["metadata"]["uid"])
            # Drop workers that are done so the table does not grow all session.
            for uid in [uid for uid, w in self._workers.items() if w.finished.is_set()]:
                del self._workers[uid]
        if worker is not None:
            worker.mark_gone()

    # -- container configuration -----------------------------------------------------

    def build_process_config(
        self, pod: JSON, container: JSON
    ) -> tuple[list[str], dict[str, str], dict[str, str], Callable[[str], str]]:
        """argv, full environment and Pod-declared environment of a container, made local,
        and the function that made paths and Service names local (exec probes use it too)."""
        command = list(container.get("command") or [])
        if not command:
            raise ContainerConfigError(
                f"container {container['name']!r} has no command; the node agent cannot run "
                "an image's entrypoint"
            )
        declared = self._container_env(pod, container)
        argv = [expand_vars(arg, declared) for arg in [*command, *(container.get("args") or [])]]
        services = self._service_rewriter(pod["metadata"]["namespace"])
        mounts = self._secret_mounts(pod, container)
        scratch = self._empty_dir_mounts(pod, container)

        def rewrite(text: str) -> str:
            for mount_path, local in [*mounts.items(), *scratch.items()]:
                if text == mount_path or text.startswith(mount_path + "/"):
                    # A path that exists here under an emptyDir's mount path (/tmp) is the
                    # test's own file (the tiny model), not the pod's scratch space.
                    if mount_path in scratch and os.path.exists(text):
                        continue
                    text = str(local) + text[len(mount_path) :]
                    break
            return services(text)

        argv = [rewrite(arg) for arg in argv]
        # pytest's per-test variables would leak one test's name into another's Pods.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        venv_bin = os.path.dirname(sys.executable)
        env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", os.defpath)])
        env.update(self.pod_env)
        env["HOSTNAME"] = str(pod["spec"].get("hostname") or pod["metadata"]["name"])
        declared = {name: rewrite(value) for name, value in declared.items()}
        env.update(declared)
        return argv, env, declared, rewrite

    def _empty_dir_mounts(self, pod: JSON, container: JSON) -> dict[str, Path]:
        """A local directory per ``emptyDir`` volume, kept across container restarts."""
        meta = pod["metadata"]
        volumes = {v["name"] for v in pod["spec"].get("volumes") or [] if "emptyDir" in v}
        base = self.work_dir / "volumes" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        mounts: dict[str, Path] = {}
        for mount in container.get("volumeMounts") or []:
            if mount["name"] in volumes:
                local = base / "emptydir" / mount["name"]
                local.mkdir(mode=0o700, parents=True, exist_ok=True)
                mounts[mount["mountPath"].rstrip("/")] = local
        return mounts

    def _secret_mounts(self, pod: JSON, container: JSON) -> dict[str, Path]:
        """Write the container's ``secret`` volumes to local directories: mountPath → dir."""
        meta = pod["metadata"]
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or [] if "secret" in v}
        base = self.work_dir / "volumes" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        mounts: dict[str, Path] = {}
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"])
            if volume is None:
                continue
            source = volume["secret"]
            optional = bool(source.get("optional"))
            data = self._secret_data(meta["namespace"], source["secretName"], optional) or {}
            items = source.get("items") or [{"key": key, "path": key} for key in data]
            local = base / container["name"] / mount["name"]
            shutil.rmtree(local, ignore_errors=True)
            local.mkdir(mode=0o700, parents=True)
            for item in items:
                if item["key"] not in data:
                    if optional:
                        continue
                    raise ContainerConfigError(
                        f"couldn't find key {item['key']} in Secret "
                        f"{meta['namespace']}/{source['secretName']}"
                    )
                target = local / item["path"]
                target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                target.write_text(data[item["key"]])
                target.chmod(int(item.get("mode", source.get("defaultMode", 0o644))))
            mounts[mount["mountPath"].rstrip("/")] = local
        return mounts

    def _container_env(self, pod: JSON, container: JSON) -> dict[str, str]:
        namespace = pod["metadata"]["namespace"]
        env: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix") or ""
            if "configMapRef" in source:
                ref = source["configMapRef"]
                data = self._config_map_data(namespace, ref["name"], bool(ref.get("optional")))
            else:
                ref = source["secretRef"]
                data = self._secret_data(namespace, ref["name"], bool(ref.get("optional")))
            env.update({prefix + key: value for key, value in (data or {}).items()})
        for var in container.get("env") or []:
            name = var["name"]
            if "valueFrom" in var:
                value = self._value_from(pod, var["valueFrom"], name)
                if value is None:
                    continue
                env[name] = value
            else:
                env[name] = expand_vars(str(var.get("value") or ""), env)
        return env

    def _value_from(self, pod: JSON, source: JSON, name: str) -> str | None:
        namespace = pod["metadata"]["namespace"]
        if "fieldRef" in source:
            return self._field_ref(pod, source["fieldRef"]["fieldPath"])
        if "resourceFieldRef" in source:
            return self._resource_field_ref(pod, source["resourceFieldRef"])
        for kind in ("secretKeyRef", "configMapKeyRef"):
            if kind in source:
                ref = source[kind]
                optional = bool(ref.get("optional"))
                data = (
                    self._secret_data(namespace, ref["name"], optional)
                    if kind == "secretKeyRef"
                    else self._config_map_data(namespace, ref["name"], optional)
                )
                if data is None:
                    return None
                if ref["key"] not in data:
                    if optional:
                        return None
                    raise ContainerConfigError(
                        f"couldn't find key {ref['key']} in {kind[:-6]} {namespace}/{ref['name']}"
                    )
                return data[ref["key"]]
        raise ContainerConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")

    @staticmethod
    def _resource_field_ref(pod: JSON, ref: JSON) -> str:
        """``limits.cpu`` in whole CPUs, rounded up (the node's CPUs without a limit)."""
        if ref.get("resource") != "limits.cpu" or str(ref.get("divisor", "1")) != "1":
            raise ContainerConfigError(f"unsupported resourceFieldRef {ref}")
        (container,) = [c for c in pod["spec"]["containers"] if c["name"] == ref["containerName"]]
        limit = ((container.get("resources") or {}).get("limits") or {}).get("cpu")
        if limit is None:
            return str(os.cpu_count() or 1)
        return str(math.ceil(parse_quantity(str(limit))))

    @staticmethod
    def _field_ref(pod: JSON, path: str) -> str:
        meta, spec = pod["metadata"], pod["spec"]
        simple = {
            "metadata.name": meta["name"],
            "metadata.namespace": meta["namespace"],
            "metadata.uid": meta["uid"],
            "spec.nodeName": spec.get("nodeName", ""),
            "spec.serviceAccountName": spec.get("serviceAccountName", ""),
            "status.podIP": LOOPBACK,
            "status.podIPs": LOOPBACK,
            "status.hostIP": LOOPBACK,
        }
        if path in simple:
            return str(simple[path])
        match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if match:
            return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
        raise ContainerConfigError(f"unsupported fieldRef {path!r}")

    def _config_map_data(self, namespace: str, name: str, optional: bool) -> dict[str, str] | None:
        try:
            response = self.core.read_namespaced_config_map(name, namespace, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404 and optional:
                return None
            raise ContainerConfigError(f"configmap {namespace}/{name}: {exc.reason}") from exc
        return dict(json.loads(response.data).get("data") or {})

    def _secret_data(self, namespace: str, name: str, optional: bool) -> dict[str, str] | None:
        try:
            response = self.core.read_namespaced_secret(name, namespace, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404 and optional:
                return None
            raise ContainerConfigError(f"secret {namespace}/{name}: {exc.reason}") from exc
        data = json.loads(response.data).get("data") or {}
        return {
            key: base64.b64decode(value).decode("utf-8", "replace") for key, value in data.items()
        }

    def _service_rewriter(self, namespace: str) -> ServiceNameRewriter:
        response = self.core.list_service_for_all_namespaces(_preload_content=False)
        items = json.loads(response.data).get("items") or []
        services = [(s["metadata"]["name"], s["metadata"]["namespace"]) for s in items]
        return ServiceNameRewriter(services, namespace)

    # -- handlers (probes and preStop) ---------------------------------------------------

    def run_handler(self, handler: JSON, runner: ContainerRunner, timeout: float) -> bool:
        """Run an exec/httpGet/tcpSocket handler against the container; True on success."""
        try:
            if "exec" in handler:
                return self._run_exec(handler["exec"].get("command") or [], runner, timeout)
            if "httpGet" in handler:
                return self._run_http_get(handler["httpGet"], runner, timeout)
            if "tcpSocket" in handler:
                port = self._resolve_port(handler["tcpSocket"]["port"], runner)
                with socket.create_connection((LOOPBACK, port), timeout=timeout):
                    return True
        except (OSError, http.client.HTTPException, subprocess.SubprocessError, ValueError):
            return False
        self.log.warning("unsupported handler %s on %s", sorted(handler), runner.name)
        return False

    def _run_exec(self, command: list[str], runner: ContainerRunner, timeout: float) -> bool:
        if not command:
            return False
        argv = [runner.rewrite(expand_vars(part, runner.declared_env)) for part in command]
        with runner.log_path.open("ab") as log:
            process = subprocess.Popen(
                [*parent_death_prefix(), *argv],
                env=runner.env or None,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                return process.wait(timeout=timeout) == 0
            except subprocess.TimeoutExpired:
                return False
            finally:
                kill_process_group(process, grace_seconds=0)

    def _run_http_get(self, probe: JSON, runner: ContainerRunner, timeout: float) -> bool:
        # The probe's `host` is ignored on purpose: every Pod lives on 127.0.0.1
        # and nothing may be sent off this machine.
        port = self._resolve_port(probe["port"], runner)
        scheme = str(probe.get("scheme") or "HTTP").upper()
        connection: http.client.HTTPConnection
        if scheme == "HTTPS":
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            connection = http.client.HTTPSConnection(
                LOOPBACK, port, timeout=timeout, context=context
            )
        else:
            connection = http.client.HTTPConnection(LOOPBACK, port, timeout=timeout)
        headers = {h["name"]: h["value"] for h in probe.get("httpHeaders") or []}
        headers.setdefault("User-Agent", "kube-probe/1.20")
        try:
            connection.request("GET", str(probe.get("path") or "/"), headers=headers)
            status = connection.getresponse().status
        finally:
            connection.close()
        return 200 <= status < 400

    @staticmethod
    def _resolve_port(port: int | str, runner: ContainerRunner) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for declared in runner.spec.get("ports") or []:
            if declared.get("name") == port:
                return int(declared["containerPort"])
        raise ValueError(f"container {runner.name} has no port named {port!r}")

    # -- logs and introspection ------------------------------------------------------------

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        return self.log_dir / f"{namespace}_{pod}_{container}.log"

    def read_log(self, namespace: str, pod: str, container: str | None = None) -> str:
        """A container's combined stdout/stderr (all containers of the Pod if None).

        Logs survive Pod deletion and restarts; a Pod recreated under the same
        name (StatefulSet) appends to the same file.
        """
        if container is not None:
            paths = [self.log_path(namespace, pod, container)]
        else:
            paths = sorted(self.log_dir.glob(f"{glob_escape(namespace)}_{glob_escape(pod)}_*.log"))
        chunks = []
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                chunks.append(path.read_text(errors="replace"))
        return "".join(chunks)

    def wait_for_log(
        self,
        namespace: str,
        pod: str,
        pattern: str,
        timeout: float = 30.0,
        container: str | None = None,
    ) -> re.Match[str]:
        """Wait until the Pod's log matches the regex; raise with the log tail if not."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            text = self.read_log(namespace, pod, container)
            match = regex.search(text)
            if match:
                return match
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"log of {namespace}/{pod} did not match {pattern!r} within {timeout:.0f} s; "
                    f"tail:\n{text[-3000:]}"
                )
            time.sleep(0.2)

    def pids(self, namespace: str, pod: str) -> dict[str, int | None]:
        """PIDs of the Pod's running containers (None for a container not running)."""
        with self._workers_lock:
            workers = [
                w
                for w in self._workers.values()
                if (w.namespace, w.pod_name) == (namespace, pod) and not w.finished.is_set()
            ]
        result: dict[str, int | None] = {}
        for worker in workers:
            for runner in worker.runners:
                result[runner.name] = (
                    runner.process.pid if runner.alive() and runner.process else None
                )
        return result

    def agent_log(self) -> str:
        with contextlib.suppress(FileNotFoundError):
            return (self.log_dir / "agent.log").read_text(errors="replace")
        return ""


class _RelistNeeded(Exception):
    pass


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)
