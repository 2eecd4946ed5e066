"""What the piecewise graphs of steps with prompt chunks compute, checked on CPU with pieces
that replay by running again (``piecewise_graphs.eager``): the static, padded buffers and the
cut at attention give every row the eager forward's logits, a step's pieces read nothing but
those buffers, and the backend hands them exactly the steps that carry prompt chunks. The
captured graphs themselves are compared with eager steps on a GPU (test_gpu_engine.py)."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dpserve.engine.kernels import cpu_kernels
from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.models.base import ForwardBatch
from dpserve.engine.paged.backend import PagedBackend
from dpserve.engine.paged.piecewise_graphs import (
    MAX_GRAPH_TOKENS,
    TOKEN_BUCKETS,
    PiecewiseGraphs,
    eager,
    token_buckets,
)
from dpserve.engine.runner import RunnerRequest
from dpserve.sampling import SamplingParams


def test_buckets_cover_every_token_count_up_to_512() -> None:
    assert token_buckets(1) == [16]
    assert token_buckets(100) == [16, 32, 48, 64, 80, 96, 112]
    steps = [b - a for a, b in itertools.pairwise(TOKEN_BUCKETS)]
    assert TOKEN_BUCKETS[-1] == MAX_GRAPH_TOKENS and max(steps) == 32
    assert token_buckets(8192) == list(TOKEN_BUCKETS)  # larger steps run eagerly


def paged_backend(runner: ModelRunner) -> PagedBackend:
    assert isinstance(runner.backend, PagedBackend)
    return runner.backend


def runner_on(glue: str, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    """A runner whose model uses ``glue``: the C++ kernels ("cpu") or torch's operations."""
    if glue == "cpu" and not cpu_kernels.usable(torch.zeros(1)):
        pytest.skip("the CPU kernels did not build here (no C++ compiler, or disabled)")
    with monkeypatch.context() as patch:
        patch.setattr(cpu_kernels, "usable", lambda tensor: glue == "cpu")
        runner = ModelRunner(
            str(tiny_model_path), max_num_seqs=16, block_size=4, max_num_batched_tokens=64
        )
    model = paged_backend(runner).model
    assert model is not None and model.glue == glue
    return runner


@pytest.mark.parametrize("glue", ["torch", "cpu"])
def test_a_step_through_the_pieces_gives_the_eager_logits(
    glue: str, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paged = paged_backend(runner_on(glue, tiny_model_path, monkeypatch))
    assert paged.model is not None and paged.cache is not None
    with torch.inference_mode():
        graphs = PiecewiseGraphs(paged.model, paged.cache, 64, capture=eager)
        assert graphs.sizes == [16, 32, 48, 64]
        assert graphs.verify()  # three decode rows and two chunks: 64 tokens


def test_pieces_that_do_not_replay_fail_the_check(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capture whose replay computes nothing (as a piece that read a tensor of the capture
    instead of a static buffer would compute the capture's step) is refused."""

    def run_once(body: Callable[[], None]) -> Callable[[], None]:
        body()
        return lambda: None

    paged = paged_backend(runner_on("torch", tiny_model_path, monkeypatch))
    assert paged.model is not None and paged.cache is not None
    with torch.inference_mode():
        assert not PiecewiseGraphs(paged.model, paged.cache, 64, capture=run_once).verify()


class _CountedPieces(PiecewiseGraphs):
    def __init__(self, paged: PagedBackend) -> None:
        assert paged.model is not None and paged.cache is not None
        super().__init__(paged.model, paged.cache, paged.max_num_batched_tokens, capture=eager)
        self.steps: list[int] = []  # the tokens of each step run through the pieces

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        self.steps.append(batch.input_ids.shape[0])
        return super().run(batch)


def drive(runner: ModelRunner, requests: list[RunnerRequest]) -> dict[int, tuple[list, list]]:
    for request in requests:
        runner.add(request)
    out: dict[int, tuple[list, list]] = {request.request_id: ([], []) for request in requests}
    while runner.has_work():
        for update in runner.step():
            out[update.request_id][0].extend(update.tokens)
            out[update.request_id][1].extend(update.logprobs or [])
    return out


@pytest.mark.parametrize("glue", ["torch", "cpu"])
def test_the_backend_runs_steps_with_prompt_chunks_through_the_pieces(
    glue: str, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of 1-90 tokens arriving beside decoding sequences (chunks of up to 64 tokens a
    step), with log-probs: the same tokens, and log-probs within float error, as without."""
    rng = random.Random(5)
    requests = [
        RunnerRequest(
            index,
            [rng.randrange(5, 380) for _ in range(rng.randint(1, 90))],
            SamplingParams(
                temperature=0.0, num_tokens_to_generate=rng.randint(1, 20), return_log_probs=True
            ),
        )
        for index in range(12)
    ]
    eager = runner_on(glue, tiny_model_path, monkeypatch)
    eager.eos_token_ids = frozenset()
    want = drive(eager, [dataclasses.replace(r) for r in requests])

    runner = runner_on(glue, tiny_model_path, monkeypatch)
    runner.eos_token_ids = frozenset()
    paged = paged_backend(runner)
    with torch.inference_mode():
        pieces = paged.piecewise = _CountedPieces(paged)
    model = paged.model
    assert model is not None
    eager_steps: list[ForwardBatch] = []
    forward = model.forward
    monkeypatch.setattr(
        model, "forward", lambda batch, cache: eager_steps.append(batch) or forward(batch, cache)
    )
    got = drive(runner, [dataclasses.replace(r) for r in requests])

    # Every step with prompt chunks went through the pieces, padded into several buckets; the
    # model's own forward ran only decode steps.
    assert pieces.steps and eager_steps and not any(batch.prefills for batch in eager_steps)
    assert len({next(s for s in pieces.sizes if s >= n) for n in pieces.steps}) > 1
    assert got.keys() == want.keys()
    for request_id, (tokens, logprobs) in got.items():
        assert tokens == want[request_id][0], f"request {request_id}"
        assert logprobs == pytest.approx(want[request_id][1], abs=1e-4)


def test_a_failed_capture_or_check_leaves_prompt_steps_eager(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from dpserve.engine.paged import backend as module

    paged = paged_backend(runner_on("torch", tiny_model_path, monkeypatch))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # no device here
    captured = {"capture": eager}

    class Pieces(PiecewiseGraphs):
        def __init__(self, model: object, cache: object, max_tokens: int) -> None:
            super().__init__(model, cache, max_tokens, **captured)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "PiecewiseGraphs", Pieces)
    assert paged._capture_piecewise() is not None

    def broken(body: Callable[[], None]) -> Callable[[], None]:
        raise RuntimeError("operation not permitted when stream is capturing")

    captured["capture"] = broken
    assert paged._capture_piecewise() is None
    assert "operation not permitted" in caplog.text

    monkeypatch.setattr(Pieces, "verify", lambda self: False)
    captured["capture"] = eager
    assert paged._capture_piecewise() is None
