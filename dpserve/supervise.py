"""``dpserve coordinator --http-port``: the coordinator in a spawned child process, the HTTP
front in this one, and the log format every dpserve process uses.

The HTTP package (``dpserve.openai``) never starts processes; this module and ``local`` do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import signal
import sys
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Final

from dpserve.client import ClientError

if TYPE_CHECKING:
    from dpserve.openai.server import FrontConfig

log = logging.getLogger("dpserve.openai")

LOG_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


def configure_logging(level: int) -> None:
    """Every dpserve process logs to stderr in ``LOG_FORMAT`` (a spawned child starts with
    logging unconfigured)."""
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)


def run_http_with_coordinator(
    zmq_port: int, deterministic: bool, options: Mapping[str, Any], front: FrontConfig
) -> int:
    """``dpserve coordinator --http-port``: the coordinator in a child process (bound to
    ``front.host:zmq_port``, tokenizing with ``front.tokenizer_spec``; ``options`` are its
    keyword arguments), the HTTP front in this one (``front.address`` is filled in). SIGTERM
    and SIGINT stop the front, then the child; the exit code is 0 unless the coordinator failed
    to start or died while serving."""
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    # Ctrl-C reaches the whole process group. The coordinator must outlive the front's
    # graceful shutdown, so it ignores SIGINT (the disposition survives spawn's exec) and
    # leaves when this process closes the pipe, or dies.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        process = context.Process(
            target=_coordinator_process,
            # data_parallel_size=0: the child must not wait for engines before answering.
            args=(
                logging.getLogger().getEffectiveLevel(),
                child_end,
                0,
                front.tokenizer_spec,
                zmq_port,
                deterministic,
            ),
            kwargs=dict(options),
            name="dpserve-coordinator",
            daemon=True,
        )
        process.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    child_end.close()
    try:
        port = _wait_for_port(process, parent_end, timeout=120.0)
        if port is None:
            log.error("the coordinator process exited before it was ready")
            return 1
        front = dataclasses.replace(front, address=f"tcp://{_connect_host(front.host)}:{port}")
        try:
            return asyncio.run(_serve_beside(process, front))
        except OSError as exc:  # typically: the HTTP port is taken
            log.error("cannot serve HTTP on %s:%s: %s", front.host, front.port, exc)
            return 1
        except ClientError as exc:  # the handshake with our own coordinator failed
            log.error("cannot reach the coordinator at %s: %s", front.address, exc)
            return 1
    finally:
        _stop_child(process, parent_end)


async def _serve_beside(process: BaseProcess, front: FrontConfig) -> int:
    from dpserve.openai import run_http_front

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    child_died = False

    def on_child_exit() -> None:
        nonlocal child_died
        child_died = True
        loop.remove_reader(process.sentinel)  # level-triggered: it would fire forever
        stop.set()

    signals = (signal.SIGTERM, signal.SIGINT)
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    # Without its coordinator the front could only answer 503: exit so it gets restarted.
    loop.add_reader(process.sentinel, on_child_exit)
    try:
        await run_http_front(front, stop)
    finally:
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(process.sentinel)
        for signum in signals:
            loop.remove_signal_handler(signum)
    if child_died:
        log.error("the coordinator process exited (code %s) while serving", process.exitcode)
        return 1
    log.info("HTTP front stopped")
    return 0


def _coordinator_process(
    log_level: int,
    pipe: Connection,
    data_parallel_size: int,
    tokenizer_spec: str | None,
    port: int,
    deterministic: bool,
    **options: Any,
) -> None:
    """The child's entry point: a spawned process starts without logging configured."""
    from dpserve.coordinator import DataParallelInferenceCoordinator

    configure_logging(log_level)
    DataParallelInferenceCoordinator.entrypoint(
        pipe, None, data_parallel_size, tokenizer_spec, port, deterministic, **options
    )


def _wait_for_port(process: BaseProcess, connection: Connection, timeout: float) -> int | None:
    """The port the child bound (it sends it once its socket is up), or None if it died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if connection.poll(0.1):
            try:
                return int(connection.recv())
            except (EOFError, OSError):
                return None
        if not process.is_alive():
            return None
    return None


def _stop_child(process: BaseProcess, connection: Connection) -> None:
    """Ask the coordinator to stop (closing the pipe would do too), then make sure it did."""
    with contextlib.suppress(OSError, ValueError):
        connection.send("stop")
    connection.close()
    process.join(10)
    if process.is_alive():
        log.warning("the coordinator did not stop within 10 s: terminating it")
        process.terminate()
        process.join(5)
    if process.is_alive():
        process.kill()
        process.join()


def _connect_host(bind_host: str) -> str:
    """Where this process reaches a coordinator bound to ``bind_host``."""
    return "127.0.0.1" if bind_host in ("", "*", "0.0.0.0") else bind_host
