"""Embedded local mode (``dpserve serve``): a coordinator, N engines and the HTTP front on this
machine, supervised by one process that leaves nothing behind when it stops.

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
import subprocess
import sys
import time
from dataclasses import dataclass, field

from dpserve.client import InferenceClient
from dpserve.engine.cpus import numa_core_sets, usable_cores
from dpserve.limits import DEFAULT_HTTP_LIMITS, DEFAULT_REQUEST_LIMITS, HttpLimits, RequestLimits
from dpserve.security import key_files, throwaway

log = logging.getLogger("dpserve.serve")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in each child before exec: the kernel sends it SIGTERM if ``dpserve serve`` dies,
    even by SIGKILL, so no engine or coordinator is ever orphaned."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


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
    routing: str | None = None  # the coordinator's --routing (None: its default)
    credentials: str | None = None  # CURVE keys directory for every process; None: plain ZMQ
    api_keys: tuple[bytes, ...] | None = field(default=None, repr=False)  # HTTP bearer tokens
    throwaway_keys: bool = False  # credentials were generated for this run (banner)
    limits: RequestLimits = DEFAULT_REQUEST_LIMITS  # the coordinator's and the HTTP edge's
    http_limits: HttpLimits = DEFAULT_HTTP_LIMITS

    def __post_init__(self) -> None:
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _spawn(self, name: str, *args: str, cores: frozenset[int] | None = None) -> None:
        command = [sys.executable, "-m", "dpserve.cli", *args]

        def before_exec() -> None:
            _die_with_parent()
            if cores:
                os.sched_setaffinity(0, cores)

        # A session of their own: Ctrl-C in the terminal reaches only `dpserve serve`, which
        # then stops the children in order (engines drain while the coordinator still runs).
        process = subprocess.Popen(command, preexec_fn=before_exec, start_new_session=True)
        self.processes.append((name, process))

    def engine_cores(self) -> list[frozenset[int] | None]:
        """Each engine's cores: its NUMA node's when there is one engine per node (the
        default), else no pinning."""
        nodes = numa_core_sets()
        if len(nodes) > 1 and len(nodes) == self.data_parallel_size:
            return list(nodes)
        return [None] * self.data_parallel_size

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
            *_coordinator_limit_flags(self.limits),
            *(["--routing", self.routing] if self.routing else []),
        )
        for rank, cores in enumerate(self.engine_cores()):
            engine = ["--fake"] if self.fake else ["--model", self.model_path]
            if not self.fake:
                threads = self.threads_per_engine()
                if cores and self.torch_threads is None:
                    threads = min(threads, len(cores))
                engine += ["--torch-threads", str(threads)]
                engine += self.kv_cache_args
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
            )

    def threads_per_engine(self) -> int:
        """Engines that share this machine's cores must not each use all of them."""
        if self.torch_threads is not None:
            return self.torch_threads
        return max(1, usable_cores() // self.data_parallel_size)

    def check_alive(self) -> None:
        for name, process in self.processes:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with code {process.returncode}")

    async def wait_until_ready(self, client: InferenceClient, within: float = 600) -> None:
        """Report progress until every engine registered (model loading takes a while)."""
        deadline = time.monotonic() + within
        shown = -1
        while True:
            self.check_alive()
            status = await asyncio.wait_for(client.get_status(), 10)
            if status["engines"] != shown:
                shown = status["engines"]
                print(
                    f"dpserve: {shown}/{self.data_parallel_size} engine(s) registered",
                    file=sys.stderr,
                    flush=True,
                )
            if shown >= self.data_parallel_size:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"engines not ready after {within:g} s")
            await asyncio.sleep(0.5)

    def stop(self, grace: float = 30.0) -> None:
        """Engines first (SIGTERM drains them), then the coordinator; SIGKILL stragglers."""
        engines = [(n, p) for n, p in self.processes if n != "coordinator"]
        coordinator = [(n, p) for n, p in self.processes if n == "coordinator"]
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


def _coordinator_limit_flags(limits: RequestLimits) -> list[str]:
    """What the coordinator checks itself (also for clients that speak ZMQ directly)."""
    return [
        "--max-body-bytes",
        str(limits.max_body_bytes),
        "--max-prompt-tokens",
        str(limits.max_prompt_tokens),
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
    lines = [
        "",
        f"dpserve is serving {deployment.model_path} with "
        f"{deployment.data_parallel_size} engine(s).",
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


async def _start_http(
    deployment: LocalDeployment, model_name: str, client: InferenceClient, stop: asyncio.Event
) -> asyncio.Task[None]:
    """The HTTP front as a task, once its port accepts connections (the banner promises a
    working URL)."""
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


async def run_local(deployment: LocalDeployment, model_name: str) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    deployment.start_processes()
    client = InferenceClient(
        deployment.port, handshake_timeout=60, credentials=deployment.client_keys()
    )
    http_task: asyncio.Task[None] | None = None
    try:
        await client.start()
        ready = asyncio.create_task(deployment.wait_until_ready(client))
        stopped = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if stopped in done:
            ready.cancel()
            return 0
        stopped.cancel()
        ready.result()
        if deployment.http_port:
            http_task = await _start_http(deployment, model_name, client, stop)
        print(banner(deployment), file=sys.stderr, flush=True)
        while not stop.is_set():
            deployment.check_alive()
            if http_task is not None and http_task.done():
                http_task.result()  # surface why the HTTP front ended
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        return 0
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"dpserve: {exc}", file=sys.stderr)
        return 1
    finally:
        stop.set()
        if http_task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(http_task, 10)
        client.stop()
        print("dpserve: stopping engines and coordinator...", file=sys.stderr, flush=True)
        await asyncio.to_thread(deployment.stop)
