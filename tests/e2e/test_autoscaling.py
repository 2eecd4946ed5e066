"""Issue 17 on the one-node cluster (real kubelet, containerd, our images): the built-in
autoscaler sizes the engines to the demand, from zero and back.

One operator (Helm chart) and one InferenceDeployment with ``minReplicas: 0``, in file order:

1. idle, there is no engine pod; a burst arrives: it is held, an engine starts, the held
   requests complete (time to first token ~ the engine pod's start-up), nothing failed;
4. the same burst holds one more request than ``maxQueuedRequests``: that one gets 503 with
   ``Retry-After`` at once;
2. a bounded load generator: the engines scale up to ``maxReplicas``;
3. 32 greedy streams, once uninterrupted on two engines, then again, each restarted as it
   ends, while the autoscaler's bound drops to one engine and until the leaving pod is gone:
   the highest ordinal leaves and hands its streams to the other
   engine (the coordinator's log counts them), every stream is identical to its uninterrupted
   run, none fails, and
   the leaving pod is gone in seconds (its grace period is 120 s);
2. the load stops: after the idle time the last engine goes, a scale-down window after the
   previous step (back to zero);
5. each decision is an Event with its reason and figures, and ``kubectl get infd`` shows the
   count and the last decision.

The timings are printed in the terminal summary (and recorded in docs/kubernetes.md).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import helm_python
import pytest
import yaml

from tests.e2e import manifests
from tests.e2e.cluster import Kubectl, wait_for
from tests.e2e.local_node import TIMINGS, LocalNode, PortForward, cluster_opt_in
from tests.e2e.test_operator import (
    CRD_NAME,
    NAME,
    OPERATOR_NS,
    RELEASE,
    fetch_client_credentials,
)

pytestmark = [pytest.mark.e2e, cluster_opt_in, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "dpserve-operator"
NAMESPACE = "autoscale"
TINY_IMAGE = "localhost/dpserve/runtime-tiny:0.1.0"
TINY_MODEL = "/opt/models/tiny"
HTTP_PORT = 8000
BATCH = 1  # spec.engine.maxBatchSize: 32 streams take 16 turns per engine (seconds, not ms)
TARGET = 1  # queued per engine: an engine takes BATCH + TARGET requests
HOLD_BOUND = 2  # spec.coordinator.limits.maxQueuedRequests (one engine's worth: 0 -> 1)
LOAD = 6  # concurrent requests of the load generator: 3 engines' worth, capped at 2
SCALE_DOWN_WINDOW = 10
IDLE_BEFORE_ZERO = 20
GRACE_SECONDS = 120
STREAMS = 32
STREAM_TOKENS = 200  # the tiny model's context is 256 positions
START_TIMEOUT = 300.0  # an engine pod importing torch on a shared 2-core machine
JSON = dict[str, Any]

SPEC: JSON = {
    "model": TINY_MODEL,
    "image": TINY_IMAGE,
    "imagePullPolicy": "IfNotPresent",
    "dataParallelSize": 0,
    "autoscaling": {
        "minReplicas": 0,
        "maxReplicas": 2,
        "metric": "QueuedRequestsPerEngine",
        "target": TARGET,
        "scaleUpWindowSeconds": 0,
        "scaleDownWindowSeconds": SCALE_DOWN_WINDOW,
        "idleBeforeZeroSeconds": IDLE_BEFORE_ZERO,
    },
    "engine": {
        "maxBatchSize": BATCH,
        "dtype": "float32",
        "device": "cpu",
        "terminationGracePeriodSeconds": GRACE_SECONDS,
        "resources": {
            "requests": {"cpu": "100m", "memory": "512Mi"},
            "limits": {"cpu": "1", "memory": "2Gi"},
        },
    },
    "coordinator": {
        "limits": {"maxQueuedRequests": HOLD_BOUND, "queueTimeout": START_TIMEOUT},
        "resources": {"requests": {"cpu": "100m", "memory": "768Mi"}, "limits": {"memory": "1Gi"}},
    },
}


@dataclass
class Scaling:
    kubectl: Kubectl
    node: LocalNode
    workdir: Path
    token: str = ""
    http_port: int = 0
    forward: PortForward | None = None
    # (seconds since the module started, engines asked for) whenever the count changed.
    counts: list[tuple[float, int]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    streams: dict[str, str] = field(default_factory=dict)

    def get(self, *args: str) -> Any:
        return self.kubectl.json(*args, "-n", NAMESPACE)

    def infd(self) -> JSON:
        return dict(self.get("get", "infd", NAME))

    def desired(self) -> int:
        return int(self.infd()["spec"].get("dataParallelSize") or 0)

    def engine_pods(self) -> list[JSON]:
        pods = self.get("get", "pods", "-l", "app.kubernetes.io/component=engine")["items"]
        return list(pods)

    def registered(self) -> int:
        return int(self.infd().get("status", {}).get("registeredEngines") or 0)

    def events(self) -> list[JSON]:
        listing = self.get("get", "events", "--field-selector", f"involvedObject.name={NAME}")
        return sorted(listing["items"], key=lambda e: e.get("firstTimestamp") or "")

    def patch_autoscaling(self, **fields: int) -> None:
        body = json.dumps({"spec": {"autoscaling": fields}})
        self.kubectl("patch", "infd", NAME, "-n", NAMESPACE, "--type=merge", "-p", body)

    def diagnostics(self) -> str:
        pods = self.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
        described = self.kubectl("describe", "infd", NAME, "-n", NAMESPACE, check=False).stdout
        logs = self.kubectl(
            "logs", "-n", OPERATOR_NS, f"deployment/{RELEASE}", "--tail=40", check=False
        ).stdout
        return f"{pods}\n{described}\n{logs}\n{self.node.log_tail('kubelet', 20)}"

    def wait(self, check: Any, timeout: float, what: str) -> Any:
        return wait_for(check, timeout, what, interval=0.25, diagnostics=self.diagnostics)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture(scope="module")
def scaling(
    local_node: LocalNode, node_kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Scaling]:
    flow = Scaling(node_kubectl, local_node, tmp_path_factory.mktemp("autoscale"))

    def helm() -> helm_python.Config:  # one per `with`: a closed Config cannot be reused
        return helm_python.Config(
            kubeconfig_path=str(node_kubectl.kubeconfig), namespace=OPERATOR_NS
        )

    with helm() as config:
        config.install(
            str(CHART), RELEASE, namespace=OPERATOR_NS, create_namespace=True, timeout=300
        )
    try:
        yield flow
    finally:
        if flow.forward is not None:
            flow.forward.__exit__(None, None, None)
        node_kubectl(
            "delete", "namespace", NAMESPACE, "--timeout=180s", check=False, timeout=200
        )  # fmt: skip
        with helm() as config:
            config.uninstall(RELEASE, timeout=120)
        node_kubectl("delete", "crd", CRD_NAME, "--timeout=60s", check=False)


# --------------------------------------------------------------------------- HTTP


async def complete(
    session: aiohttp.ClientSession, flow: Scaling, prompt: str, max_tokens: int
) -> tuple[int, float | None, str, dict[str, str]]:
    """A streamed completion: (status, seconds to the first token, text or error, headers)."""
    started = time.monotonic()
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    async with session.post(flow.url("/v1/completions"), json=body) as reply:
        if reply.status != 200:
            return reply.status, None, await reply.text(), dict(reply.headers)
        first: float | None = None
        text = []
        async for line in reply.content:
            payload = line.decode().strip()
            if not payload.startswith("data: {"):
                continue
            chunk = json.loads(payload[len("data: ") :])
            assert "error" not in chunk, chunk
            if chunk["choices"] and chunk["choices"][0]["text"]:
                first = first or time.monotonic() - started
                text.append(chunk["choices"][0]["text"])
        return 200, first, "".join(text), dict(reply.headers)


def session_for(flow: Scaling) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=START_TIMEOUT + 120)
    connector = aiohttp.TCPConnector(limit=0)
    return aiohttp.ClientSession(headers=flow.headers(), timeout=timeout, connector=connector)


def stream_prompt(index: int) -> str:
    return f"Stream number {index} says"


# --------------------------------------------------------------------------- the flow


def test_idle_at_zero_no_engine_pod_and_the_coordinator_ready_to_hold(scaling: Scaling) -> None:
    scaling.kubectl.create_namespace(NAMESPACE)
    manifest = scaling.workdir / "autoscaled.yaml"
    manifest.write_text(yaml.safe_dump(manifests.inference_deployment(NAME, SPEC)))
    scaling.kubectl("apply", "-f", str(manifest), "-n", NAMESPACE)

    def coordinator_ready() -> bool:
        found = scaling.kubectl(
            "get", "deployment", f"{NAME}-coordinator", "-n", NAMESPACE, "-o", "json", check=False
        )  # absent until the operator created it
        return found.returncode == 0 and bool(
            json.loads(found.stdout).get("status", {}).get("readyReplicas")
        )

    # /ready is 200 ("holding") with no engine at all: the pod is ready to take requests.
    scaling.wait(coordinator_ready, START_TIMEOUT, "the coordinator pod Ready with no engine")
    time.sleep(3)  # several autoscaler ticks: idle stays at zero
    assert scaling.desired() == 0 and not scaling.engine_pods()
    credentials = fetch_client_credentials(scaling.kubectl, NAMESPACE, scaling.workdir)
    scaling.token = (credentials / "http-api-token").read_text().strip()
    scaling.forward = PortForward(
        scaling.kubectl, NAMESPACE, f"svc/{NAME}-coordinator", [HTTP_PORT]
    ).__enter__()
    scaling.http_port = scaling.forward.local_ports[HTTP_PORT]


def test_held_requests_start_an_engine_and_complete_and_one_too_many_is_refused_fast(
    scaling: Scaling,
) -> None:
    async def burst() -> list[tuple[int, float | None, str, dict[str, str]]]:
        async with session_for(scaling) as session:
            held = [
                asyncio.create_task(complete(session, scaling, f"Held request {i}", 16))
                for i in range(HOLD_BOUND)
            ]
            await asyncio.sleep(1.0)  # all held before the one too many
            refused_at = time.monotonic()
            refused = await complete(session, scaling, "One too many", 16)
            TIMINGS["one beyond the hold bound -> 503"] = time.monotonic() - refused_at
            return [refused, *await asyncio.gather(*held)]

    started = time.monotonic()
    refused, *held = asyncio.run(burst())
    assert refused[0] == 503 and int(refused[3]["Retry-After"]) >= 1, refused
    assert "--max-queued-requests" in refused[2], refused
    assert TIMINGS["one beyond the hold bound -> 503"] < 1.0
    assert [status for status, *_ in held] == [200] * HOLD_BOUND, held
    ttfts = [ttft for _, ttft, _, _ in held if ttft is not None]
    assert len(ttfts) == HOLD_BOUND, held
    TIMINGS["scale from zero: held burst -> all completed"] = time.monotonic() - started
    TIMINGS["scale from zero: time to first token (slowest held request)"] = max(ttfts)
    assert len(scaling.engine_pods()) == 1
    reasons = [event["reason"] for event in scaling.events()]
    assert "ScaledFromZero" in reasons, reasons
    scaling.counts.append((time.monotonic() - scaling.started, scaling.desired()))


def test_load_scales_up_to_the_cap(scaling: Scaling) -> None:
    async def generate_until_two_engines() -> int:
        done = asyncio.Event()
        sent = 0

        async def worker(index: int) -> None:
            nonlocal sent
            while not done.is_set():
                status, *_ = await complete(session, scaling, f"Load {index} {sent}", 8)
                assert status == 200
                sent += 1

        async with session_for(scaling) as session:
            workers = [asyncio.create_task(worker(i)) for i in range(LOAD)]
            await asyncio.to_thread(
                scaling.wait, lambda: scaling.registered() == 2, START_TIMEOUT,
                "two engines registered under load",
            )  # fmt: skip
            done.set()
            await asyncio.gather(*workers)
        return sent

    started = time.monotonic()
    sent = asyncio.run(generate_until_two_engines())
    TIMINGS[f"load ({LOAD} concurrent) -> 2 engines registered (the cap)"] = (
        time.monotonic() - started
    )
    assert sent > 0 and scaling.desired() == 2
    events = scaling.events()
    scaled_up = [e for e in events if e["reason"] == "ScaledUp"]
    assert scaled_up and "engines 1 → 2" in scaled_up[-1]["message"], events
    assert "max 2" in scaled_up[-1]["message"]


def test_reference_streams_on_two_engines(scaling: Scaling) -> None:
    """The 32 greedy streams, uninterrupted (two engines, nothing moves): what each stream
    must be when the next test moves half of them across a scale-down."""

    async def reference() -> list[Any]:
        async with session_for(scaling) as session:
            return await asyncio.gather(
                *(complete(session, scaling, stream_prompt(i), STREAM_TOKENS)
                  for i in range(STREAMS))
            )  # fmt: skip

    started = time.monotonic()
    results = asyncio.run(reference())
    TIMINGS["32 greedy streams on 2 engines, uninterrupted"] = time.monotonic() - started
    assert [status for status, *_ in results] == [200] * STREAMS, results
    scaling.streams = {stream_prompt(i): text for i, (_, _, text, _) in enumerate(results)}
    assert all(scaling.streams.values())
    assert scaling.desired() == 2


def test_scale_down_moves_32_streams_and_the_leaving_pod_is_gone_in_seconds(
    scaling: Scaling,
) -> None:
    leaving = f"{NAME}-engine-1"

    async def streams_across_a_scale_down() -> tuple[list[tuple[str, Any]], float]:
        # Each of the 32 streams starts again as soon as it ends, until the leaving pod is
        # gone: the 32 take ~1.5 s on this machine, less than the operator and the kubelet
        # take to signal the engine, so a single round could end before the engine leaves,
        # with nothing to hand over (one CI run: "handing 0 request(s)").
        results: list[tuple[str, Any]] = []
        pod_gone = asyncio.Event()

        async def stream_until_gone(prompt: str) -> None:
            while True:
                results.append((prompt, await complete(session, scaling, prompt, STREAM_TOKENS)))
                if pod_gone.is_set():
                    return

        async with session_for(scaling) as session:
            tasks = [
                asyncio.create_task(stream_until_gone(stream_prompt(i))) for i in range(STREAMS)
            ]
            await asyncio.sleep(0.5)  # every stream dispatched, on both engines
            decided = time.monotonic()
            await asyncio.to_thread(scaling.patch_autoscaling, maxReplicas=1)
            await asyncio.to_thread(
                scaling.wait,
                lambda: not any(p["metadata"]["name"] == leaving for p in scaling.engine_pods()),
                GRACE_SECONDS + 60,
                f"{leaving} gone",
            )
            gone = time.monotonic() - decided
            pod_gone.set()
            await asyncio.gather(*tasks)
            print(f"\n{len(results)} streams ran until {leaving} was gone and the last ended")
            return results, gone

    results, gone = asyncio.run(streams_across_a_scale_down())
    TIMINGS["bound 2 -> 1 with 32 streams in flight: leaving pod gone"] = gone
    assert len(results) >= STREAMS
    assert [status for _, (status, *_) in results] == [200] * len(results), results
    # The leaving engine handed its requests over (the coordinator says how many) ...
    log = scaling.kubectl(
        "logs", f"deployment/{NAME}-coordinator", "-n", NAMESPACE, "--tail=-1"
    ).stdout
    handed = re.findall(r"engine rank 1 left, handing (\d+) request\(s\) to the others", log)
    assert handed and int(handed[-1]) > 0, log[-3000:]
    print(f"{leaving} handed {handed[-1]} request(s) to the other engine")
    # ... and every stream, moved or not, is byte-identical to its uninterrupted run.
    different = [(prompt, text) for prompt, (_, _, text, _) in results
                 if text != scaling.streams[prompt]]  # fmt: skip
    assert not different, [(p, text, scaling.streams[p]) for p, text in different[:3]]
    # Handing requests over (above) is what shows it did not wait out its streams. This
    # bound is about leaving on its own, before the grace period ends and the kubelet kills
    # it (which takes GRACE_SECONDS at least): the pod's removal itself took 5-32 s on these
    # machines, and once 65.5 s in a clean-clone CI run (a half-grace bound failed it, with the
    # hand-off and every stream right).
    assert gone < GRACE_SECONDS, "the leaving engine was not gone before its grace period ended"
    into_bounds = [e for e in scaling.events() if e["reason"] == "ScaledIntoBounds"]
    assert into_bounds and "engines 2 → 1" in into_bounds[-1]["message"]


def test_idle_goes_back_to_zero_and_each_decision_is_an_event(scaling: Scaling) -> None:
    scaling.patch_autoscaling(maxReplicas=2)

    async def one_short_request() -> tuple[int, float | None, str, dict[str, str]]:
        async with session_for(scaling) as session:
            return await complete(session, scaling, "Idle from here", 2)

    # The idle time counts from the last request, which must be this one (the previous
    # test's streams ended while it waited for the leaving pod); it comes and goes within
    # one autoscaler reading, so only the coordinator's finished-request count shows it.
    status, _, text, _ = asyncio.run(one_short_request())
    assert status == 200, text
    idle_from = time.monotonic()
    scaling.wait(lambda: scaling.desired() == 0, IDLE_BEFORE_ZERO + 120, "scaled to zero")
    TIMINGS["last request -> scaled to zero (idle time 20 s)"] = time.monotonic() - idle_from
    assert time.monotonic() - idle_from >= IDLE_BEFORE_ZERO - 1
    scaling.wait(lambda: not scaling.engine_pods(), GRACE_SECONDS + 60, "no engine pod")

    events = scaling.events()
    decisions = [e for e in events if e["reason"].startswith("Scaled")]
    reasons = [e["reason"] for e in decisions]
    assert reasons[0] == "ScaledFromZero" and reasons[-1] == "ScaledToZero", reasons
    for event in decisions:
        # Reason and figures: "engines 1 → 2: queued per engine ... (min 0, max 2)".
        assert "engines " in event["message"] and "→" in event["message"], event
        assert "demand" in event["message"] and "min 0" in event["message"], event
    assert "idle for" in decisions[-1]["message"]

    # kubectl get infd: the count the autoscaler set and its last decision.
    header, row = scaling.kubectl("get", "infd", "-n", NAMESPACE).stdout.splitlines()[:2]
    columns = dict(zip(header.split(), row.split(), strict=False))
    assert columns["DESIRED"] == "0" and columns["AUTOSCALER"] == "ScaledToZero", row
    status = scaling.infd()["status"]["autoscaling"]
    assert status["desiredReplicas"] == 0 and status["reason"] == "ScaledToZero"
    print("\n" + "\n".join(f"{e['reason']}: {e['message']}" for e in decisions))
