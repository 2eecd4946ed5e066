"""Runs the device part of a step (forward + sampling) so that the host can prepare the next
step meanwhile: the overlap of the paged backend.

``DeviceQueue.submit`` takes a job that only touches tensors (the host has already read
everything it needs from the sequences) and returns a ``Launched`` handle at once; ``wait``
gives the sampled tokens as Python lists. Jobs run in submission order, one at a time, on one
worker thread: on CUDA the worker only enqueues kernels (the copy of the sampled ids to pinned
host memory is enqueued behind them with an event, so waiting for step N never waits for step
N+1); on CPU the worker computes, while torch's ops release the GIL for the host thread.
Without overlap, ``submit`` runs the job inline and the step is strictly sequential.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from dpserve.engine.sample.sampler import HostSample, SampleOutput


@dataclass(slots=True)
class _Copied:
    """Sampled ids (and logprobs) on their way to the host."""

    output: SampleOutput
    host: SampleOutput  # the same tensors in host memory (pinned on CUDA); complete after event
    event: torch.cuda.Event | None


class Launched:
    """One submitted step: its sampled tokens on the device, and on the host once waited for."""

    def __init__(self, job: Future[_Copied] | _Copied) -> None:
        self._job = job  # a _Copied when it ran inline (no overlap): no future to make

    def _copied(self) -> _Copied:
        job = self._job
        return job.result() if isinstance(job, Future) else job

    def device_tokens(self) -> torch.Tensor:
        """The sampled ids where they were sampled (blocks until the job was enqueued)."""
        return self._copied().output.tokens

    def wait(self) -> HostSample:
        copied = self._copied()
        if copied.event is not None:
            copied.event.synchronize()
        return copied.host.to_host()


class DeviceQueue:
    def __init__(self, device: torch.device, overlap: bool) -> None:
        self.device = device
        self.overlap = overlap
        self._worker: ThreadPoolExecutor | None = None
        self._last: Future[_Copied] | None = None
        if overlap:
            self._worker = ThreadPoolExecutor(1, "dpserve-device", initializer=self._enter)

    def _enter(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def submit(self, job: Callable[[], SampleOutput]) -> Launched:
        if self._worker is None:
            return Launched(self._run(job))
        self._last = self._worker.submit(self._run, job)
        return Launched(self._last)

    def drain(self) -> None:
        """Wait until every submitted job ran (before the model or the cache go away)."""
        if self._last is not None:
            self._last.result()
            self._last = None

    def _run(self, job: Callable[[], SampleOutput]) -> _Copied:
        # inference_mode is per thread: the worker enters it for every job.
        with torch.inference_mode():
            output = job()
            if self.device.type != "cuda":
                return _Copied(output, output, None)
            host = SampleOutput(
                _pinned_copy(output.tokens),
                None if output.logprobs is None else _pinned_copy(output.logprobs),
                None if output.top_ids is None else _pinned_copy(output.top_ids),
                None if output.top_logprobs is None else _pinned_copy(output.top_logprobs),
                output.top_counts,
            )
            event = torch.cuda.Event()
            event.record()
            return _Copied(output, host, event)

    def close(self) -> None:
        self.drain()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
