"""Embedded local mode (``dpserve serve``): a coordinator, N engines and the HTTP front on this
machine, supervised by one process that leaves nothing behind when it stops.

Supervision: a child that exits is started again with the same command line (an engine keeps
its rank) after a backoff, while the others keep serving; one that keeps dying is left down
(``dpserve.restarts`` decides both). A child that fails before it ever came up (the coordinator
before it answered, an engine before it registered) is left down at once: it failed on what it
was given (a model that cannot load, a flag its backend refuses, too little memory, a port in
use), and each further try would load the model again to fail the same way. An engine that
exits with code 0 left on purpose (it was told to drain, or the coordinator was stopped) and
is not restarted. ``serve`` ends when the coordinator is left down or no engine is left, since
nothing could answer then.

Without flags the deployment still uses CURVE: ``serve`` generates throw-away keys in a private
directory, hands the directory to its children and removes it on exit. ``dpserve generate`` and
``dpserve http`` find those keys by port (``throwaway.find_local_credentials``), so the first
run needs no key handling at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, TypeVar

from dpserve.client import ClientError, InferenceClient
from dpserve.engine.cpus import (
    VLLM_THREADS_BIND_ENV,
    numa_core_sets,
    shared_core_bindings,
    usable_cores,
)
from dpserve.flags import CONSTRAINT_LIMITS, request_limit_flag
from dpserve.limits import DEFAULT_HTTP_LIMITS, DEFAULT_REQUEST_LIMITS, HttpLimits, RequestLimits
from dpserve.reply_formats import ReplyParsers
from dpserve.restarts import Deaths, RestartPolicy, describe_exit
from dpserve.security import api_tokens, key_files, throwaway

log = logging.getLogger("dpserve.serve")

_PR_SET_PDEATHSIG = 1
SUPERVISE_INTERVAL_S = 0.5  # how often the children are looked at: a death is noticed within it
# The coordinator's --heartbeat-timeout here (its default, 5 s, is for engines across a
# network). Requests sent to an engine while the kernel tears it down (it frees the memory
# before it closes the socket: ~0.4 s for SmolLM2 with its 1 GiB KV cache on CPU) are lost
# with it, and move to another engine only once the coordinator finds it silent for this long
# and probes it. Engines heartbeat every second, and a probe is harmless to a busy one (its
# libzmq thread answers the connection's heartbeats while Python steps), so 2 s keeps those
# requests' extra wait at ~1-2 s where 5 s made it ~5 s (measured: test_serve_supervision).
LOCAL_HEARTBEAT_TIMEOUT_S = 2.0

T = TypeVar("T")


def _die_with_parent() -> None:
    """Runs in each child before exec: the kernel sends it SIGTERM if ``dpserve serve`` dies,
    even by SIGKILL, so no engine or coordinator is ever orphaned."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class DeploymentEnded(Exception):
    """Nothing can serve any more (the coordinator or every engine is down for good); ``serve``
    stops everything and exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Child:
    """One process of the deployment, as ``LocalDeployment.supervise`` keeps it running."""

    name: str  # "coordinator", "engine 0", ...
    args: tuple[str, ...]  # its command line after ``python -m dpserve.cli``: the same each start
    cores: frozenset[int] | None
    deaths: Deaths
    python: str = sys.executable  # the interpreter it runs in (vLLM's own install for its engines)
    environment: dict[str, str] = field(default_factory=dict)  # set for it, over serve's own
    process: subprocess.Popen[bytes] | None = None  # the latest start's
    started_at: float = 0.0  # time.monotonic() of the latest start
    restart_at: float | None = None  # while it waits out its backoff
    # It served once: the coordinator answered ``serve``'s client, an engine registered. Until
    # then a death is a start-up failure, which is not retried.
    came_up: bool = False
    down: Literal["crash loop", "left", "never came up"] | None = None  # why, for good

    @property
    def is_engine(self) -> bool:
        return self.name != "coordinator"


@dataclass
class LocalDeployment:
    model_path: str
    data_parallel_size: int
    port: int
    http_port: int | None
    host: str = "127.0.0.1"
    max_num_seqs: int | None = None
    torch_threads: int | None = None  # per engine; None: this machine's cores split among them
    fake: bool = False  # fake engines: the whole stack without a model (tests, demos)
    kv_cache_args: tuple[str, ...] = ()  # the engines' KV-cache flags, as given to serve
    lora_args: tuple[str, ...] = ()  # the engines' LoRA flags (flags.lora_args)
    # The engines' --cpu-weights (engine.layers.weight_format.flag_args; dpserve's engine only).
    cpu_weights_args: tuple[str, ...] = ()
    routing: str | None = None  # the coordinator's --routing (None: its default)
    credentials: str | None = None  # CURVE keys directory for every process; None: plain ZMQ
    api_keys: api_tokens.ApiKeys | None = field(default=None, repr=False)  # HTTP bearer tokens
    throwaway_keys: bool = False  # credentials were generated for this run (banner)
    limits: RequestLimits = DEFAULT_REQUEST_LIMITS  # the coordinator's and the HTTP edge's
    http_limits: HttpLimits = DEFAULT_HTTP_LIMITS
    # --chat-template's text, for the coordinator and the HTTP front; None: the model's own.
    chat_template: str | None = None
    # The HTTP front's readers of chat replies (--tool-call-parser, --reasoning-parser).
    reply_parsers: ReplyParsers = field(default_factory=ReplyParsers)
    step_delay: float = 0.0  # seconds per fake engine step (``fake`` only)
    # The engines' compute: "dpserve" or "vllm" (dpserve.engine.vllm), with vLLM's tensor
    # parallelism and its own engine flags passed through; ``engine_python`` runs them (vLLM
    # has an install of its own).
    backend: str = "dpserve"
    tensor_parallel_size: int = 1
    vllm_args: tuple[str, ...] = ()
    engine_python: str = sys.executable
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)

    def __post_init__(self) -> None:
        self.children: list[Child] = []

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _spawn(
        self,
        name: str,
        *args: str,
        cores: frozenset[int] | None = None,
        python: str = sys.executable,
        environment: dict[str, str] | None = None,
    ) -> None:
        child = Child(name, args, cores, Deaths(self.restart_policy), python, environment or {})
        self.children.append(child)
        self._start(child)

    def _start(self, child: Child) -> None:
        """Start ``child``'s process. Only ever from the thread that runs the event loop: the
        kernel sends PR_SET_PDEATHSIG when the thread that forked the child ends, so a child
        started from a short-lived worker thread would be killed with it."""
        command = [child.python, "-m", "dpserve.cli", *child.args]
        cores = child.cores

        def before_exec() -> None:
            _die_with_parent()
            if cores:
                os.sched_setaffinity(0, cores)

        # A session of their own: Ctrl-C in the terminal reaches only `dpserve serve`, which
        # then stops the children in order (engines drain while the coordinator still runs).
        child.process = subprocess.Popen(
            command,
            preexec_fn=before_exec,
            start_new_session=True,
            env=child_environment() | child.environment,
        )
        child.started_at = time.monotonic()

    @property
    def engines(self) -> list[Child]:
        return [child for child in self.children if child.is_engine]

    def engines_not_down(self) -> int:
        """Engines running or waiting to be restarted: those ``serve`` still expects."""
        return sum(1 for child in self.engines if child.down is None)

    def engine_cores(self) -> list[frozenset[int] | None]:
        """Each engine's cores: its NUMA node's when there is one engine per node (the
        default), else no pinning."""
        nodes = numa_core_sets()
        if len(nodes) > 1 and len(nodes) == self.data_parallel_size:
            return list(nodes)
        return [None] * self.data_parallel_size

    def vllm_thread_bindings(self) -> list[str | None]:
        """Each vLLM engine's ``VLLM_THREADS_BIND_ENV`` where several share this process's
        cores (``cpus.shared_core_bindings``: a slice each); None where vLLM binds by itself:
        one engine, engines pinned one per NUMA node, the variable set for ``serve``, or too
        few cores for a slice each."""
        engines = self.data_parallel_size
        if (
            self.backend != "vllm"
            or self.fake
            or engines == 1
            or VLLM_THREADS_BIND_ENV in os.environ
            or any(self.engine_cores())
        ):
            return [None] * engines
        bindings = shared_core_bindings(
            sorted(os.sched_getaffinity(0)), engines, self.tensor_parallel_size, self.torch_threads
        )
        if bindings is None:
            log.warning(
                "%d vLLM engines of %d rank(s) each share %d cores, too few for cores of their "
                "own: vLLM binds each engine's workers itself, and they may share cores",
                engines,
                self.tensor_parallel_size,
                len(os.sched_getaffinity(0)),
            )
            return [None] * engines
        return list(bindings)

    def client_keys(self) -> key_files.PeerKeys | None:
        return None if self.credentials is None else key_files.load_peer_keys(self.credentials)

    def start_processes(self) -> None:
        tokenizer = ["--tokenizer", self.model_path] if not self.fake else []
        # The directory's path, never a key, goes on the command lines.
        keys = ["--credentials", self.credentials] if self.credentials else []
        self._spawn(
            "coordinator",
            "coordinator",
            "--host",
            self.host,
            "--port",
            str(self.port),
            *tokenizer,
            *keys,
            "--heartbeat-timeout",
            str(LOCAL_HEARTBEAT_TIMEOUT_S),
            *_coordinator_limit_flags(self.limits),
            *(["--routing", self.routing] if self.routing else []),
            *(["--chat-template", self.chat_template] if self.chat_template else []),
        )
        bindings = self.vllm_thread_bindings()
        for rank, cores in enumerate(self.engine_cores()):
            engine = ["--fake"] if self.fake else ["--model", self.model_path]
            environment = {}
            if self.fake and self.step_delay:
                engine += ["--step-delay", str(self.step_delay)]
            if not self.fake and self.backend == "vllm":
                binding = bindings[rank]
                engine += self._vllm_engine_flags(threads=binding is None)
                engine += self.lora_args
                if binding is not None:
                    environment[VLLM_THREADS_BIND_ENV] = binding
            elif not self.fake:
                threads = self.threads_per_engine()
                if cores and self.torch_threads is None:
                    threads = min(threads, len(cores))
                engine += ["--torch-threads", str(threads)]
                engine += self.kv_cache_args
                engine += self.lora_args
                engine += self.cpu_weights_args
                engine += _engine_limit_flags(self.limits)
            if self.max_num_seqs:
                engine += ["--max-num-seqs", str(self.max_num_seqs)]
            self._spawn(
                f"engine {rank}",
                "engine",
                "--coordinator",
                self.address,
                "--rank",
                str(rank),
                *engine,
                *keys,
                cores=cores,
                python=self.engine_python if self.backend == "vllm" else sys.executable,
                environment=environment,
            )

    def _vllm_engine_flags(self, threads: bool = True) -> list[str]:
        """A vLLM engine's flags: its backend's, and its compute threads only when asked for
        (vLLM binds its workers' threads itself, leaving a core to the engine process) and
        ``threads`` (not where the engine's binding, which says them, is set for it)."""
        engine = ["--backend", "vllm", "--tensor-parallel-size", str(self.tensor_parallel_size)]
        engine += [f"--vllm-arg={arg}" for arg in self.vllm_args]
        if threads and self.torch_threads is not None:
            engine += ["--torch-threads", str(self.torch_threads)]
        return [*engine, *self.kv_cache_args, *_engine_limit_flags(self.limits)]

    def threads_per_engine(self) -> int:
        """Engines that share this machine's cores must not each use all of them."""
        if self.torch_threads is not None:
            return self.torch_threads
        return max(1, usable_cores() // self.data_parallel_size)

    def supervise(self, now: float) -> None:
        """Look at every child once: note the deaths (each logged with how and when it is
        restarted), start again those whose backoff is over. Raises ``DeploymentEnded`` when
        nothing can serve any more."""
        for child in self.children:
            if child.down is not None or child.process is None:
                continue
            if child.restart_at is None:
                returncode = child.process.poll()
                if returncode is not None:
                    self._died(child, returncode, now)
            elif now >= child.restart_at:
                child.restart_at = None
                self._start(child)
                assert child.process is not None
                log.warning("%s started again (pid %d)", child.name, child.process.pid)
        coordinator = next(c for c in self.children if not c.is_engine)
        if coordinator.down is not None:
            raise DeploymentEnded(
                "the coordinator is left down: nothing can serve without it; stopping", 1
            )
        if self.engines and self.engines_not_down() == 0:
            if all(engine.down == "left" for engine in self.engines):
                raise DeploymentEnded("every engine has left (exit code 0): stopping", 0)
            raise DeploymentEnded(
                "no engine is left to serve (each was left down: see the log above); stopping", 1
            )

    def _died(self, child: Child, returncode: int, now: float) -> None:
        assert child.process is not None
        what = f"{child.name} (pid {child.process.pid}) {describe_exit(returncode)}"
        ran = f"after {now - child.started_at:.1f} s"
        if child.is_engine and returncode == 0:
            # Only a drain (SIGTERM) or the coordinator's STOP ends an engine with 0: someone
            # asked it to go, and starting it again would undo that.
            child.down = "left"
            log.warning(
                "%s %s: it left on purpose, so it is not restarted; %d engine(s) remain",
                what,
                ran,
                self.engines_not_down(),
            )
            return
        if not child.came_up:
            child.down = "never came up"
            log.error(
                "%s %s, before it ever came up: it is not restarted, as it would fail the same "
                "way (its error is above: a model that cannot load, a flag refused, too little "
                "memory, a port in use) (%s)",
                what,
                ran,
                self._what_is_left(child),
            )
            return
        delay = child.deaths.record(now)
        policy = child.deaths.policy
        if delay is None:
            child.down = "crash loop"
            log.error(
                "%s %s; it died %d times within %g s, a crash loop: it is left down until "
                "dpserve serve is restarted (%s)",
                what,
                ran,
                child.deaths.recent,
                policy.crash_loop_window,
                self._what_is_left(child),
            )
            return
        child.restart_at = now + delay
        log.warning(
            "%s %s; restarting it in %g s (death %d within %g s; the %s leaves it down)",
            what,
            ran,
            delay,
            child.deaths.recent,
            policy.crash_loop_window,
            _ordinal(policy.crash_loop_deaths),
        )

    def _what_is_left(self, child: Child) -> str:
        """What serves without ``child``, now left down."""
        if child.is_engine:
            return f"engines left: {self.engines_not_down()} of {len(self.engines)}"
        return "nothing can serve without it"

    def note_came_up(self, status: dict[str, Any]) -> None:
        """The coordinator answered with ``status`` (its STATUS report): it came up, and so did
        each engine whose rank it lists."""
        ranks = {int(engine["rank"]) for engine in status.get("engine_list", ())}
        for child in self.children:
            if not child.is_engine or _rank_of(child) in ranks:
                child.came_up = True

    async def keep_running(self, interval: float = SUPERVISE_INTERVAL_S) -> NoReturn:
        """``supervise`` for ever (until cancelled, or ``DeploymentEnded``)."""
        while True:
            self.supervise(time.monotonic())
            await asyncio.sleep(interval)

    async def wait_until_ready(self, client: InferenceClient, within: float = 600) -> None:
        """Report progress until every engine not left down registered (model loading takes a
        while). Children that die meanwhile are ``keep_running``'s: a rank that crash-loops is
        left down and no longer waited for."""
        deadline = time.monotonic() + within
        shown: int | None = None
        while True:
            try:
                status = await asyncio.wait_for(client.get_status(), 5)
            except (TimeoutError, ClientError):  # the coordinator is restarting: ask again
                status = None
            if status is not None:
                self.note_came_up(status)
                registered = int(status["engines"])
                if registered != shown:
                    shown = registered
                    print(
                        f"dpserve: {shown}/{self.data_parallel_size} engine(s) registered",
                        file=sys.stderr,
                        flush=True,
                    )
                expected = self.engines_not_down()
                if expected and registered >= expected:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"engines not ready after {within:g} s")
            await asyncio.sleep(0.5)

    def stop(self, grace: float = 30.0) -> None:
        """Engines first (SIGTERM drains them), then the coordinator; SIGKILL stragglers."""
        started = [(c.name, c.process) for c in self.children if c.process is not None]
        engines = [(n, p) for n, p in started if n != "coordinator"]
        coordinator = [(n, p) for n, p in started if n == "coordinator"]
        for group in (engines, coordinator):
            for _, process in group:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for name, process in group:
                try:
                    process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %g s: killing it", name, grace)
                    process.kill()
                    process.wait()


def _rank_of(engine: Child) -> int:
    return int(engine.args[engine.args.index("--rank") + 1])


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _coordinator_limit_flags(limits: RequestLimits) -> list[str]:
    """What the coordinator checks itself (also for clients that speak ZMQ directly)."""
    return [
        "--max-body-bytes",
        str(limits.max_body_bytes),
        "--max-prompt-tokens",
        str(limits.max_prompt_tokens),
    ]


def _engine_limit_flags(limits: RequestLimits) -> list[str]:
    """What an engine checks itself: it compiles the structured-output constraints."""
    return [
        part
        for name in CONSTRAINT_LIMITS
        for part in (request_limit_flag(name), str(getattr(limits, name)))
    ]


def banner(deployment: LocalDeployment) -> str:
    # Throw-away keys are found by port; keys the user gave must be named again.
    given = (
        f" --credentials {deployment.credentials}"
        if deployment.credentials and not deployment.throwaway_keys
        else ""
    )
    if deployment.credentials is None:
        keys = "none: plain ZMQ on loopback (--insecure)"
    elif deployment.throwaway_keys:
        keys = f"CURVE, throw-away keys in {deployment.credentials} (removed on exit)"
    else:
        keys = f"CURVE, keys from {deployment.credentials}"
    engines = f"{deployment.data_parallel_size} engine(s)"
    down = [child.name for child in deployment.engines if child.down is not None]
    if down:
        engines = (
            f"{deployment.engines_not_down()} of {engines} "
            f"({', '.join(down)} left down: see the log above)"
        )
    lines = [
        "",
        f"dpserve is serving {deployment.model_path} with {engines}.",
        f"  ZMQ:  {deployment.address}",
        f"  keys: {keys}",
        f'  try:  dpserve generate "Tell me a joke" --chat --address {deployment.address}{given}',
    ]
    if deployment.http_port:
        base = f"http://{deployment.host}:{deployment.http_port}"
        bearer = " -H 'Authorization: Bearer <your API key>'" if deployment.api_keys else ""
        lines += [
            f"  HTTP: {base}  (OpenAI-compatible: /v1/completions, /v1/chat/completions)",
            f"  try:  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{bearer} "
            '-d \'{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}\'',
        ]
    lines += ["Press Ctrl-C to stop.", ""]
    return "\n".join(lines)


def serve(deployment: LocalDeployment, model_name: str, *, throwaway_keys: bool) -> int:
    """``dpserve serve``: run the deployment until SIGINT/SIGTERM. With ``throwaway_keys``,
    fresh CURVE keys are generated first and their directory removed after everything
    stopped."""
    with contextlib.ExitStack() as cleanup:
        if throwaway_keys:
            try:
                directory = cleanup.enter_context(throwaway.throwaway_credentials(deployment.port))
            except (key_files.CredentialsError, OSError) as exc:
                print(f"dpserve: cannot create throw-away keys: {exc}", file=sys.stderr)
                return 1
            deployment.credentials = str(directory)
            deployment.throwaway_keys = True
        return asyncio.run(run_local(deployment, model_name))


def child_environment() -> dict[str, str]:
    """The environment ``dpserve serve`` starts its children in: its own, with
    PYTHONSAFEPATH set (Python 3.11+; older ones ignore it). ``python -m`` otherwise puts the
    working directory first on the child's ``sys.path``, and processes the child starts with
    that path inherit it: started from this repository's root, whose ``operator/`` shadows the
    standard library's module, torch inductor's check of the CPU's vector instructions (a fresh
    interpreter on the engine's path, in vLLM's sampler) could not import torch, so inductor
    compiled kernels cached by an engine started elsewhere without their instruction set, and
    every compile failed ("'at::vec' has not been declared"), killing vLLM's worker."""
    return {**os.environ, "PYTHONSAFEPATH": "1"}


def bind_http_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening), for the HTTP front to listen
    on once the engines serve. ``dpserve serve`` binds it before it starts anything: a port in
    use is then refused at once, and no process can take the port while the engines start
    (tests' free ports were taken so, by vLLM's own sockets, in the half minute vLLM starts).
    OSError where the address cannot be bound."""
    family, kind, protocol, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    bound = socket.socket(family, kind, protocol)
    try:
        # SO_REUSEADDR for the bind only (a restart may find the last run's connections in
        # TIME_WAIT), then cleared: a socket bound but not listening, with it set, lets another
        # one that sets it too (ZMQ's, for one) bind the same port, and the front's listen would
        # fail only once the engines had loaded.
        bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        bound.bind(address)
        bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    except OSError:
        bound.close()
        raise
    return bound


def check_zmq_port(host: str, port: int) -> None:
    """Raise OSError where the coordinator could not bind ``host:port`` (taken by another
    process): ``dpserve serve`` asks before it starts anything, so that a port in use is one
    line at once, not a coordinator that fails to start. libzmq binds with SO_REUSEADDR, so
    this does too (the last run's connections in TIME_WAIT do not count)."""
    family, kind, protocol, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, kind, protocol) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)


async def _start_http(
    deployment: LocalDeployment,
    model_name: str,
    client: InferenceClient,
    stop: asyncio.Event,
    bound: socket.socket,
) -> asyncio.Task[None]:
    """The HTTP front on ``bound`` as a task, once its port accepts connections (the banner
    promises a working URL)."""
    from dpserve.openai.server import FrontConfig, run_http_front

    front = FrontConfig(
        deployment.address,
        None if deployment.fake else deployment.model_path,
        deployment.host,
        deployment.http_port or 0,
        model_name,
        credentials=client.keys,
        api_keys=deployment.api_keys,
        limits=deployment.limits,
        http_limits=deployment.http_limits,
        reply_parsers=deployment.reply_parsers,
        chat_template=deployment.chat_template,
        bound_socket=bound,
    )
    listening = asyncio.Event()
    http_task = asyncio.create_task(run_http_front(front, stop, listening=listening))
    started = asyncio.create_task(listening.wait())
    await asyncio.wait({started, http_task}, return_when=asyncio.FIRST_COMPLETED)
    started.cancel()
    if http_task.done():
        http_task.result()
        raise RuntimeError("the HTTP front stopped before it started")
    return http_task


async def _unless_ended(
    work: Awaitable[T], stop: asyncio.Event, supervisor: asyncio.Task[NoReturn]
) -> T | None:
    """``work``'s result; None if ``stop`` is set first; what ``supervisor`` raises if it ends
    first (``DeploymentEnded``). ``work`` is cancelled when it does not finish."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopped, supervisor}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if supervisor.done():
        supervisor.result()
    return None


async def run_local(deployment: LocalDeployment, model_name: str) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        check_zmq_port(deployment.host, deployment.port)
    except OSError as exc:
        print(
            f"dpserve: cannot bind the ZMQ port {deployment.host}:{deployment.port}: {exc} "
            "(--port names another)",
            file=sys.stderr,
        )
        return 1
    bound: socket.socket | None = None
    if deployment.http_port:
        try:
            bound = bind_http_port(deployment.host, deployment.http_port)
        except OSError as exc:
            print(
                f"dpserve: cannot serve HTTP on {deployment.host}:{deployment.http_port}: {exc}",
                file=sys.stderr,
            )
            return 1
    deployment.start_processes()
    # From here until everything stops, children that die are started again (or left down),
    # during start-up as while serving.
    supervisor = asyncio.create_task(deployment.keep_running(), name="dpserve-supervisor")
    client = InferenceClient(
        deployment.port, handshake_timeout=60, credentials=deployment.client_keys()
    )
    http_task: asyncio.Task[None] | None = None
    try:
        if not await _unless_ended(_started(client), stop, supervisor):
            return 0
        if not await _unless_ended(_ready(deployment, client), stop, supervisor):
            return 0
        if bound is not None:
            http_task = await _start_http(deployment, model_name, client, stop, bound)
        print(banner(deployment), file=sys.stderr, flush=True)
        waiting: set[asyncio.Future[Any]] = {supervisor, asyncio.create_task(stop.wait())}
        if http_task is not None:
            waiting.add(http_task)
        done, pending = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        for task in pending - {supervisor, http_task}:
            task.cancel()
        if supervisor in done:
            supervisor.result()  # raises why nothing can serve any more
        if http_task is not None and http_task in done:
            http_task.result()  # surface why the HTTP front ended
        return 0
    except DeploymentEnded as ended:
        print(f"dpserve: {ended}", file=sys.stderr)
        return ended.exit_code
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"dpserve: {exc}", file=sys.stderr)
        return 1
    finally:
        # No restart may race the stop below, also one whose backoff is still running.
        supervisor.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await supervisor
        stop.set()
        if http_task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(http_task, 10)
        client.stop()
        if bound is not None:
            bound.close()  # where the front never took it (closing twice is harmless)
        print("dpserve: stopping engines and coordinator...", file=sys.stderr, flush=True)
        await asyncio.to_thread(deployment.stop)


async def _started(client: InferenceClient) -> bool:
    await client.start()
    return True


async def _ready(deployment: LocalDeployment, client: InferenceClient) -> bool:
    await deployment.wait_until_ready(client)
    return True
