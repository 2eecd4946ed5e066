"""``dpserve serve`` starts one engine per NUMA node by default, each pinned to its node's
cores; any other engine count is not pinned. Its supervision restarts a child that died after
a backoff, leaves a crash-looping one down, and one that failed before it ever came up at once,
and ends when nothing could serve."""

from __future__ import annotations

import itertools
import logging
import os
import signal

import pytest

from dpserve import flags, local
from dpserve.cli import build_parser
from dpserve.engine import cpus
from dpserve.limits import RequestLimits
from dpserve.local import Child, DeploymentEnded, LocalDeployment

NODES = [frozenset({0, 1}), frozenset({2, 3})]


def deployment(engines: int) -> LocalDeployment:
    return LocalDeployment(model_path="m", data_parallel_size=engines, port=5555, http_port=None)


def test_one_engine_per_node_is_pinned_to_its_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "numa_core_sets", lambda: NODES)
    assert deployment(2).engine_cores() == NODES
    assert deployment(3).engine_cores() == [None, None, None]
    assert deployment(1).engine_cores() == [None]


def test_one_node_means_no_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "numa_core_sets", lambda: [frozenset({0, 1})])
    assert deployment(1).engine_cores() == [None]


def test_serve_refuses_a_data_parallel_size_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "--fake", "--data-parallel-size", "0"])
    assert args.func(args) == 2
    assert "--data-parallel-size must be at least 1" in capsys.readouterr().err


def status(*ranks: int) -> dict[str, object]:
    """The part of the coordinator's STATUS report ``note_came_up`` reads: who registered."""
    return {"engines": len(ranks), "engine_list": [{"rank": rank} for rank in ranks]}


class StubProcess:
    """What ``supervise`` and ``stop`` ask of a child's process."""

    pids = itertools.count(1000)

    def __init__(self) -> None:
        self.pid = next(self.pids)
        self.returncode: int | None = None
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)
        self.returncode = -signum

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


class Supervised:
    """A fake-engine deployment whose children are ``StubProcess``es, on a clock of its own.
    With ``came_up``, the coordinator answered and listed every engine (``note_came_up`` with
    a STATUS report's ``engine_list``), as once ``serve`` is serving."""

    def __init__(self, engines: int = 2, came_up: bool = True) -> None:
        self.now = 0.0
        self.deployment = LocalDeployment(
            model_path="fake", data_parallel_size=engines, port=5555, http_port=None, fake=True
        )
        self.starts: list[str] = []

        def start(child: Child) -> None:
            child.process = StubProcess()  # type: ignore[assignment]
            child.started_at = self.now
            self.starts.append(child.name)

        self.deployment._start = start  # type: ignore[method-assign]
        self.deployment.start_processes()
        self.starts.clear()
        if came_up:
            self.deployment.note_came_up(status(*range(engines)))

    def process(self, name: str) -> StubProcess:
        child = next(c for c in self.deployment.children if c.name == name)
        return child.process  # type: ignore[return-value]

    def at(self, now: float) -> None:
        self.now = now
        self.deployment.supervise(now)


def test_a_killed_engine_is_started_again_with_its_rank_after_the_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = Supervised()
    first = run.process("engine 1")
    args = next(c for c in run.deployment.children if c.name == "engine 1").args
    assert args[args.index("--rank") + 1] == "1"
    first.returncode = -9
    with caplog.at_level(logging.WARNING, "dpserve.serve"):
        run.at(12.0)
        assert run.starts == []
        run.at(12.5)
        assert run.starts == []
        run.at(13.0)
    assert run.starts == ["engine 1"]
    assert run.process("engine 1") is not first
    assert [c.args for c in run.deployment.children if c.name == "engine 1"] == [args]
    assert caplog.messages == [
        f"engine 1 (pid {first.pid}) was killed by SIGKILL after 12.0 s; restarting it in 1 s "
        "(death 1 within 300 s; the 5th leaves it down)",
        f"engine 1 started again (pid {run.process('engine 1').pid})",
    ]


def test_a_crash_looping_engine_is_left_down_and_the_rest_serves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = Supervised()
    now = 0.0
    for backoff in (1, 2, 4, 8):
        run.process("engine 1").returncode = 1
        run.at(now)
        now += backoff
        run.at(now)
    assert run.starts == ["engine 1"] * 4
    run.process("engine 1").returncode = 1
    with caplog.at_level(logging.ERROR, "dpserve.serve"):
        run.at(now)
    assert "it died 5 times within 300 s, a crash loop: it is left down" in caplog.text
    assert "(engines left: 1 of 2)" in caplog.text
    assert run.deployment.engines_not_down() == 1
    run.at(now + 3600)
    assert run.starts == ["engine 1"] * 4, "left down means not started again"
    assert "1 of 2 engine(s) (engine 1 left down" in local.banner(run.deployment)


def test_no_engine_left_ends_the_deployment_with_an_error() -> None:
    run = Supervised(engines=1)
    now = 0.0
    for backoff in (1, 2, 4, 8):
        run.process("engine 0").returncode = 3
        run.at(now)
        now += backoff
        run.at(now)
    run.process("engine 0").returncode = 3
    with pytest.raises(DeploymentEnded, match="no engine is left") as ended:
        run.at(now)
    assert ended.value.exit_code == 1


def test_a_crash_looping_coordinator_ends_the_deployment() -> None:
    run = Supervised()
    now = 0.0
    for backoff in (1, 2, 4, 8):
        run.process("coordinator").returncode = -11
        run.at(now)
        now += backoff
        run.at(now)
    assert run.starts == ["coordinator"] * 4
    run.process("coordinator").returncode = -11
    with pytest.raises(DeploymentEnded, match="coordinator is left down") as ended:
        run.at(now)
    assert ended.value.exit_code == 1


def test_an_engine_that_fails_before_it_registers_is_left_down_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A rank that dies while loading (its model cannot load, too little memory) is not
    started again: it would fail the same way; the other, which registered, is restarted."""
    run = Supervised(came_up=False)
    run.deployment.note_came_up(status(0))
    failed = run.process("engine 1")
    failed.returncode = 1
    with caplog.at_level(logging.ERROR, "dpserve.serve"):
        run.at(15.0)
    assert caplog.messages == [
        f"engine 1 (pid {failed.pid}) exited with code 1 after 15.0 s, before it ever came up: "
        "it is not restarted, as it would fail the same way (its error is above: a model that "
        "cannot load, a flag refused, too little memory, a port in use) (engines left: 1 of 2)"
    ]
    run.at(3600.0)
    assert run.starts == []
    assert "1 of 2 engine(s) (engine 1 left down" in local.banner(run.deployment)
    run.process("engine 0").returncode = -9
    run.at(3601.0)
    run.at(3602.0)
    assert run.starts == ["engine 0"], "a rank that registered is restarted"


def test_no_engine_that_can_start_ends_the_deployment_at_the_first_failures() -> None:
    run = Supervised(came_up=False)
    run.deployment.note_came_up({"engines": 0, "engine_list": []})  # the coordinator answered
    run.process("engine 0").returncode = 1
    run.at(20.0)
    run.process("engine 1").returncode = 1
    with pytest.raises(DeploymentEnded, match="no engine is left") as ended:
        run.at(21.0)
    assert ended.value.exit_code == 1
    assert run.starts == []


def test_a_coordinator_that_fails_before_it_answers_ends_the_deployment() -> None:
    run = Supervised(came_up=False)
    run.process("coordinator").returncode = 1
    with pytest.raises(DeploymentEnded, match="coordinator is left down") as ended:
        run.at(0.5)
    assert ended.value.exit_code == 1
    assert run.starts == []


def test_an_engine_that_came_up_and_then_fails_to_start_again_is_tried_as_a_crash_loop() -> None:
    """Coming up once is for good: a later start that fails is retried (the GPU may come
    back), until the crash-loop rule leaves it down."""
    run = Supervised()
    run.process("engine 1").returncode = -9
    run.at(0.0)
    run.at(1.0)
    assert run.starts == ["engine 1"]
    run.process("engine 1").returncode = 1  # the new start fails while loading
    run.at(10.0)
    run.at(12.0)
    assert run.starts == ["engine 1", "engine 1"]


def test_an_engine_that_exits_zero_left_on_purpose_and_is_not_restarted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = Supervised()
    run.process("engine 0").returncode = 0
    with caplog.at_level(logging.WARNING, "dpserve.serve"):
        run.at(5.0)
    assert "it left on purpose, so it is not restarted; 1 engine(s) remain" in caplog.text
    run.at(100.0)
    assert run.starts == []
    run.process("engine 1").returncode = 0  # e.g. the coordinator's STOP reached both
    with pytest.raises(DeploymentEnded, match="every engine has left") as ended:
        run.at(101.0)
    assert ended.value.exit_code == 0


def test_the_coordinator_is_restarted_whatever_its_exit_code() -> None:
    run = Supervised()
    run.process("coordinator").returncode = 0
    run.at(1.0)
    run.at(2.0)
    assert run.starts == ["coordinator"]


def test_stop_signals_the_current_processes_also_of_a_child_waiting_to_restart() -> None:
    """Ctrl-C during a backoff: the dead process is not signalled, nor started again; the
    others get SIGTERM."""
    run = Supervised()
    dead = run.process("engine 1")
    dead.returncode = -9
    run.at(0.0)  # engine 1 now waits out its backoff
    run.deployment.stop(grace=0.1)
    assert dead.signals == []
    assert run.process("engine 0").signals == [signal.SIGTERM]
    assert run.process("coordinator").signals == [signal.SIGTERM]
    assert run.starts == []


def test_serve_refuses_a_step_delay_without_fake_engines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["serve", "--step-delay", "0.1"])
    assert args.func(args) == 2
    assert "--step-delay is for fake engines" in capsys.readouterr().err


def test_fake_engines_get_the_step_delay() -> None:
    run = Supervised()
    run.deployment.step_delay = 0.25
    run.deployment.children.clear()
    run.deployment.start_processes()
    engine = next(c for c in run.deployment.children if c.name == "engine 0")
    assert engine.args[engine.args.index("--step-delay") + 1] == "0.25"


def test_the_local_coordinator_probes_a_silent_engine_after_two_seconds() -> None:
    run = Supervised()
    coordinator = next(c for c in run.deployment.children if c.name == "coordinator")
    flag = coordinator.args.index("--heartbeat-timeout")
    assert coordinator.args[flag + 1] == str(local.LOCAL_HEARTBEAT_TIMEOUT_S) == "2.0"


def test_engines_get_the_structured_output_limits_serve_was_given() -> None:
    # The engines compile the constraints: they enforce what `dpserve serve --max-constraint-
    # bytes ...` set, as the front does.
    run = Supervised()
    run.deployment.fake = False
    run.deployment.limits = RequestLimits(max_constraint_bytes=1234, constraint_compile_timeout=2.5)
    run.deployment.children.clear()
    run.deployment.start_processes()
    engine = next(c for c in run.deployment.children if c.name == "engine 0")
    args = build_parser().parse_args(engine.args[engine.args.index("engine") :])
    assert flags.constraint_limits(args).max_constraint_bytes == 1234
    assert flags.constraint_limits(args).constraint_compile_timeout == 2.5


@pytest.mark.parametrize("backend", ["dpserve", "vllm"])
def test_engines_of_either_backend_get_the_lora_flags_serve_was_given(backend: str) -> None:
    run = Supervised()
    run.deployment.fake = False
    run.deployment.backend = backend
    run.deployment.lora_args = ("--enable-lora", "--max-loras", "2", "--lora-modules", "a=/x")
    run.deployment.children.clear()
    run.deployment.start_processes()
    engine = next(c for c in run.deployment.children if c.name == "engine 0")
    args = build_parser().parse_args(engine.args[engine.args.index("engine") :])
    assert (args.backend, args.enable_lora, args.max_loras) == (backend, True, 2)
    assert flags.lora_modules(args) == {"a": "/x"}


def test_the_bound_http_port_cannot_be_bound_by_a_zmq_socket_meanwhile() -> None:
    """The HTTP port ``dpserve serve`` holds while its engines start is refused to another
    socket that asks to reuse addresses, as ZMQ's do (with SO_REUSEADDR left on, the coordinator
    could bind it and the front failed only after the engines had loaded)."""
    import zmq

    bound = local.bind_http_port("127.0.0.1", 0)
    port = bound.getsockname()[1]
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    try:
        with pytest.raises(zmq.ZMQError, match="Address already in use"):
            router.bind(f"tcp://*:{port}")
        bound.listen()  # and the front can still listen on it
    finally:
        router.close(linger=0)
        context.term()
        bound.close()


def test_serve_refuses_one_port_for_http_and_zmq(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "--fake", "--port", "8123", "--http-port", "8123"])
    assert args.func(args) == 2
    assert "give --http-port and --port different ports" in capsys.readouterr().err


def test_serve_refuses_a_zmq_port_in_use_before_it_starts_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One line at once, where the coordinator used to fail to bind it five times over."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = build_parser().parse_args(["serve", "--fake", "--port", str(port)])
        args.http_port = 0
        assert args.func(args) == 1
    assert capsys.readouterr().err.strip() == (
        f"dpserve: cannot bind the ZMQ port 127.0.0.1:{port}: [Errno 98] Address already in "
        "use (--port names another)"
    )
    local.check_zmq_port("127.0.0.1", port)  # free again: no error


def vllm_engines(
    monkeypatch: pytest.MonkeyPatch, engines: int, cores: set[int], torch_threads: int | None
) -> list[Child]:
    """The engine children of a vLLM deployment of ``engines`` on ``cores`` (one NUMA node)."""
    monkeypatch.setattr(local, "numa_core_sets", lambda: [frozenset(cores)])
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: cores)
    monkeypatch.delenv(cpus.VLLM_THREADS_BIND_ENV, raising=False)
    run = Supervised(engines)
    run.deployment.fake = False
    run.deployment.backend = "vllm"
    run.deployment.torch_threads = torch_threads
    run.deployment.children.clear()
    run.deployment.start_processes()
    return run.deployment.engines


def test_vllm_engines_sharing_the_cores_bind_their_workers_to_cores_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Left to vLLM, both engines' workers bound to core 0 (prefill at half speed).
    children = vllm_engines(monkeypatch, 2, {0, 1}, None)
    assert [c.environment.get(cpus.VLLM_THREADS_BIND_ENV) for c in children] == ["0", "1"]
    assert all("--torch-threads" not in c.args for c in children)  # the binding says them
    children = vllm_engines(monkeypatch, 2, set(range(8)), 2)
    assert [c.environment[cpus.VLLM_THREADS_BIND_ENV] for c in children] == ["0,1", "4,5"]


def test_one_vllm_engine_or_too_few_cores_leave_the_binding_to_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (child,) = vllm_engines(monkeypatch, 1, {0, 1}, None)
    assert child.environment == {}
    children = vllm_engines(monkeypatch, 3, {0, 1}, None)
    assert all(c.environment == {} for c in children)
    children = vllm_engines(monkeypatch, 2, {0, 1}, 1)
    assert all(c.environment for c in children)  # a core each still fits one thread each
    monkeypatch.setenv(cpus.VLLM_THREADS_BIND_ENV, "0-1")  # the user's own binding stands
    monkeypatch.setattr(local, "numa_core_sets", lambda: [frozenset({0, 1})])
    run = Supervised(2)
    run.deployment.fake, run.deployment.backend = False, "vllm"
    assert run.deployment.vllm_thread_bindings() == [None, None]
