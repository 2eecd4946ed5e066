"""What a captured decode step computes, checked eagerly on CPU: the static, padded inputs the
CUDA graphs replay over give every real row exactly its unpadded logits (the graphs themselves
are compared with eager decoding on a GPU in test_gpu_engine.py)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import torch

from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.models.base import ForwardBatch
from dpserve.engine.paged.backend import PagedBackend
from dpserve.engine.paged.cuda_graphs import StaticDecodeInputs, graph_batch_sizes
from dpserve.engine.runner import RunnerRequest
from dpserve.engine.sample import sampler
from dpserve.sampling import SamplingParams


def test_buckets_cover_every_batch_size() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(22) == [1, 2, 4, 8, 16, 24]
    assert graph_batch_sizes(129)[-3:] == [112, 128, 144]  # not 256: at most 15 padding rows
    steps = [b - a for a, b in itertools.pairwise(graph_batch_sizes(256))]
    assert graph_batch_sizes(256)[-1] == 256 and max(steps) == 16
    assert graph_batch_sizes(1000) == graph_batch_sizes(256)


def decoding_runner(tiny_model_path: Path, count: int) -> ModelRunner:
    """A runner whose ``count`` sequences have been prefilled and are decoding."""
    runner = ModelRunner(str(tiny_model_path), max_num_seqs=16, block_size=4)
    rng = random.Random(count)
    for i in range(count):
        prompt = [rng.randrange(5, 380) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=50)
        runner.add(RunnerRequest(i, prompt, params))
    while runner.stats()["running"] < count or any(
        s.context_length() - s.num_cached != 1 for s in backend(runner).scheduler.running
    ):
        runner.step()
    return runner


def backend(runner: ModelRunner) -> PagedBackend:
    assert isinstance(runner.backend, PagedBackend)
    return runner.backend


def test_padded_static_inputs_give_each_row_its_own_logits(tiny_model_path: Path) -> None:
    inputs = None
    for count in (13, 5, 1):  # each fill leaves stale rows and columns for the next one
        paged = backend(decoding_runner(tiny_model_path, count))
        assert paged.model is not None and paged.cache is not None
        plan = paged.scheduler.schedule()
        assert len(plan.decodes) == count and not plan.prefills
        assert paged.inputs is not None
        batch = paged.inputs.build(plan)[0].batch
        if inputs is None:
            inputs = StaticDecodeInputs(16, max_blocks_per_sequence=64, device=paged.device)
        with torch.inference_mode():
            eager = paged.model.forward(batch, paged.cache)
            size = inputs.fill(batch)
            padded = paged.model.forward(inputs.batch(size), paged.cache)
        assert size == inputs.bucket(count) and size >= count
        torch.testing.assert_close(padded[:count], eager, rtol=1e-5, atol=1e-5)


class _EagerGraphs:
    """Stands in for ``DecodeGraphs`` on CPU (the same two entry points, computed eagerly), to
    see which steps the backend hands to which."""

    def __init__(self, paged: PagedBackend) -> None:
        self.paged = paged
        self.calls: list[str] = []

    def can_run(self, batch: ForwardBatch) -> bool:
        return not batch.prefills

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        assert self.paged.model is not None and self.paged.cache is not None
        return self.paged.model.forward(batch, self.paged.cache)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        self.calls.append("logits")
        return self._forward(batch)

    def run_greedy(self, batch: ForwardBatch) -> torch.Tensor:
        self.calls.append("greedy")
        return sampler.greedy(self._forward(batch))


def test_only_bare_greedy_decode_steps_take_the_graphs_tokens(tiny_model_path: Path) -> None:
    cases = {
        "bare": ({}, "greedy"),
        "log-probs": ({"return_log_probs": True}, "logits"),
        "sampled": ({"temperature": 0.8, "seed": 3}, "logits"),
        "penalty": ({"presence_penalty": 0.5}, "logits"),
    }
    for name, (params, expected) in cases.items():
        runner = decoding_runner(tiny_model_path, 3)
        paged = backend(runner)
        reference = decoding_runner(tiny_model_path, 3)
        for one in (runner, reference):  # both continue with new requests of those params
            for i in range(2):
                sampling = SamplingParams(
                    **{"temperature": 0.0, "num_tokens_to_generate": 6, **params}
                )
                one.add(RunnerRequest(10 + i, [7, 8, 9 + i], sampling))
            while backend(one).scheduler.waiting or any(
                s.context_length() - s.num_cached != 1 for s in backend(one).scheduler.running
            ):
                one.step()
        graphs = _EagerGraphs(paged)
        paged.graphs = graphs  # type: ignore[assignment]
        got = [u.tokens for _ in range(4) for u in runner.step()]
        want = [u.tokens for _ in range(4) for u in reference.step()]
        assert graphs.calls and set(graphs.calls) == {expected}, name
        assert got == want, name
