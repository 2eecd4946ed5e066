"""LoRA adapters through the paged engine (``engine.lora``) against transformers + peft: each
adapter's greedy tokens equal ``generate`` of the model with that adapter merged in, a step
mixing adapters and the base model gives every row its alone output, adapters never share
prefix-cache blocks, and ``--max-loras`` slots are reused least recently used first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dpserve.engine.lora.serving import AdapterError
from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import RequestRejected, RunnerRequest, TokenUpdate
from dpserve.sampling import SamplingParams
from tests.lora_adapters import (
    ATTENTION_MODULES,
    make_adapter,
    merged_model,
    reference_greedy,
    reference_logprobs,
)
from tests.tiny_model import build_variant_model

PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 60, 70], [1, 99, 98, 97, 96, 95, 94, 93, 92, 91]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three adapters of different ranks, scalings and modules."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(tiny_model_path, root / "a", seed=1),
        "b": make_adapter(tiny_model_path, root / "b", seed=2, rank=4, alpha=8, rslora=True),
        "c": make_adapter(
            tiny_model_path, root / "c", seed=3, rank=16, modules=("q_proj", "k_proj", "down_proj")
        ),
    }


@pytest.fixture(scope="module")
def runner(tiny_model_path: Path, adapters: dict[str, Path]) -> ModelRunner:
    return ModelRunner(
        str(tiny_model_path), lora_modules={name: str(path) for name, path in adapters.items()}
    )


def params(name: str | None, **extra: Any) -> SamplingParams:
    return SamplingParams(
        temperature=0,
        num_tokens_to_generate=NEW_TOKENS,
        ignore_eos=True,
        lora_name=name,
        **extra,
    )


def run(
    runner: ModelRunner, jobs: list[tuple[list[int], str | None]], **extra: Any
) -> list[TokenUpdate]:
    """Each (prompt, adapter) submitted together, run to the end: one merged update each."""
    for index, (prompt, name) in enumerate(jobs):
        runner.add(RunnerRequest(index, prompt, params(name, **extra)))
    merged = {index: TokenUpdate(index, [], logprobs=[]) for index in range(len(jobs))}
    while runner.has_work():
        for update in runner.step():
            assert update.error is None, update.error
            into = merged[update.request_id]
            into.tokens += update.tokens
            if update.logprobs is not None and into.logprobs is not None:
                into.logprobs += update.logprobs
            if update.cached_tokens is not None:
                into.cached_tokens = update.cached_tokens
    return [merged[index] for index in range(len(jobs))]


def tokens(runner: ModelRunner, jobs: list[tuple[list[int], str | None]]) -> list[list[int]]:
    return [update.tokens for update in run(runner, jobs)]


def test_each_adapter_matches_peft_merged_generate(
    runner: ModelRunner, tiny_model_path: Path, adapters: dict[str, Path]
) -> None:
    outputs = {}
    for name in [None, *adapters]:
        reference = merged_model(tiny_model_path, None if name is None else adapters[name])
        expected = [reference_greedy(reference, prompt, NEW_TOKENS) for prompt in PROMPTS]
        outputs[name] = tokens(runner, [(prompt, name) for prompt in PROMPTS])
        assert outputs[name] == expected, name
    assert len({str(output) for output in outputs.values()}) == 4  # every adapter changes it


def test_a_step_mixing_adapters_and_the_base_gives_each_row_its_alone_output(
    runner: ModelRunner, tiny_model_path: Path, adapters: dict[str, Path]
) -> None:
    names: list[str | None] = [None, "a", "b", "c"]
    jobs = [(prompt, name) for prompt in PROMPTS for name in names]
    alone = [run(runner, [job], return_log_probs=True)[0] for job in jobs]
    together = run(runner, jobs, return_log_probs=True)
    for job, one, mixed in zip(jobs, alone, together, strict=True):
        assert mixed.tokens == one.tokens, job
        assert one.logprobs is not None and mixed.logprobs is not None
        assert max(abs(x - y) for x, y in zip(one.logprobs, mixed.logprobs, strict=True)) < 1e-4
    # The log-probs are those of the merged model, token by token (CPU fp32).
    for (prompt, name), one in zip(jobs, alone, strict=True):
        reference = merged_model(tiny_model_path, None if name is None else adapters[name])
        expected = reference_logprobs(reference, prompt, one.tokens)
        assert one.logprobs is not None
        assert max(abs(x - y) for x, y in zip(one.logprobs, expected, strict=True)) < 1e-4


def test_adapters_never_share_prefix_cache_blocks(runner: ModelRunner) -> None:
    prompt = [1, *range(100, 160)]  # several full blocks
    first = {name: run(runner, [(prompt, name)])[0] for name in ("a", "b", None)}
    assert all(update.cached_tokens == 0 for update in first.values()), first
    again = {name: run(runner, [(prompt, name)])[0] for name in ("a", "b", None)}
    for name, update in again.items():  # each finds its own blocks, and its own tokens
        assert update.cached_tokens and update.cached_tokens > 0, name
        assert update.tokens == first[name].tokens, name
    assert len({str(update.tokens) for update in again.values()}) == 3


def test_two_slots_three_adapters_least_recently_used_is_evicted(
    tiny_model_path: Path, adapters: dict[str, Path]
) -> None:
    slots = ModelRunner(
        str(tiny_model_path),
        max_loras=2,
        lora_modules={name: str(path) for name, path in adapters.items()},
    )
    lora = slots.adapters
    assert lora is not None
    # Registering the third took the slot of the first (idle, least recently used).
    assert lora.loaded() == ["b", "c"] and lora.evictions == 1
    expected = {name: tokens(slots, [(PROMPTS[0], name)])[0] for name in ("b", "c")}
    loads = lora.loads
    expected["a"] = tokens(slots, [(PROMPTS[0], "a")])[0]  # loaded again, into b's slot
    assert lora.loaded() == ["a", "c"] and lora.loads == loads + 1 and lora.evictions == 2
    # Three adapters at once on two slots: the third waits for a slot, every output is right.
    jobs: list[tuple[list[int], str | None]] = [(PROMPTS[0], name) for name in ("a", "b", "c")]
    for index, (prompt, name) in enumerate(jobs):
        slots.add(RunnerRequest(index, prompt, params(name)))
    assert slots.stats()["lora_awaiting_slot"] == 1
    report = slots.adapter_report()
    assert report is not None and report.max_loras == 2
    assert sum(waiting for _, _, waiting in report.adapters.values()) == 3  # none ran yet
    out: dict[int, list[int]] = {0: [], 1: [], 2: []}
    while slots.has_work():
        for update in slots.step():
            assert update.error is None
            out[update.request_id] += update.tokens
    assert [out[index] for index in range(3)] == [expected[name] for _, name in jobs]
    assert slots.stats()["lora_awaiting_slot"] == 0


def test_unknown_unloaded_and_replaced_adapters(
    tiny_model_path: Path, adapters: dict[str, Path]
) -> None:
    runner = ModelRunner(str(tiny_model_path), enable_lora=True)
    with pytest.raises(RequestRejected, match="unknown LoRA adapter 'a'"):
        runner.add(RunnerRequest(0, PROMPTS[0], params("a")))
    runner.load_adapter("a", str(adapters["a"]))
    prompt = [1, *range(100, 160)]
    with_a = tokens(runner, [(prompt, "a")])[0]
    # Replaced under the same name: the blocks cached with the old weights are not found.
    runner.load_adapter("a", str(adapters["b"]))
    replaced = run(runner, [(prompt, "a")])[0]
    assert replaced.cached_tokens == 0 and replaced.tokens != with_a
    runner.unload_adapter("a")
    with pytest.raises(RequestRejected, match="unknown LoRA adapter"):
        runner.add(RunnerRequest(1, PROMPTS[0], params("a")))
    with pytest.raises(KeyError):
        runner.unload_adapter("a")
    with pytest.raises(AdapterError, match="is not a directory"):
        runner.load_adapter("z", str(tiny_model_path / "nowhere"))


def test_an_adapter_in_use_is_not_unloaded(runner: ModelRunner) -> None:
    runner.add(RunnerRequest(0, PROMPTS[0], params("b")))
    with pytest.raises(AdapterError, match="in use by 1 request"):
        runner.unload_adapter("b")
    runner.cancel(0)  # gives its slot back
    assert runner.adapters is not None and runner.adapters.users()["b"] == 0


def test_engines_without_lora_refuse_adapter_requests(tiny_model_path: Path) -> None:
    plain = ModelRunner(str(tiny_model_path))
    with pytest.raises(RequestRejected, match="--enable-lora"):
        plain.add(RunnerRequest(0, PROMPTS[0], params("a")))
    fallback = ModelRunner(str(tiny_model_path), backend="transformers")
    with pytest.raises(RequestRejected, match="transformers fallback"):
        fallback.add(RunnerRequest(0, PROMPTS[0], params("a")))
    with pytest.raises(ValueError, match="LoRA adapters need the paged backend"):
        ModelRunner(str(tiny_model_path), backend="transformers", enable_lora=True)


# (kind, the modules its adapter adapts): a mixture of experts takes attention adapters.
VARIANTS = [("qwen3", None), ("qwen3-moe", ATTENTION_MODULES), ("mixtral", ATTENTION_MODULES)]


@pytest.mark.parametrize(("kind", "modules"), VARIANTS)
def test_variants_with_an_adapter_match_peft_merged_generate(
    kind: str, modules: tuple[str, ...] | None, tiny_model_path: Path, tmp_path: Path
) -> None:
    base = tmp_path / kind
    build_variant_model(kind, tiny_model_path, base)
    adapter = (
        make_adapter(base, tmp_path / "adapter", seed=4)
        if modules is None
        else make_adapter(base, tmp_path / "adapter", seed=4, modules=modules)
    )
    reference = merged_model(base, adapter)
    expected = [reference_greedy(reference, prompt, NEW_TOKENS) for prompt in PROMPTS]
    engine = ModelRunner(str(base), lora_modules={"x": str(adapter)})
    assert tokens(engine, [(prompt, "x") for prompt in PROMPTS]) == expected
    assert tokens(engine, [(PROMPTS[0], None)]) != expected[:1]


def test_an_adapter_of_the_experts_is_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    """PEFT adapts a mixture of experts' MLP through its stacked expert parameters
    (``target_parameters``): refused, saying so."""
    base = tmp_path / "qwen3-moe"
    build_variant_model("qwen3-moe", tiny_model_path, base)
    adapter = make_adapter(base, tmp_path / "adapter", seed=5)
    with pytest.raises(AdapterError, match=r"target_parameters, e\.g\. MoE experts"):
        ModelRunner(str(base), lora_modules={"x": str(adapter)})


def test_a_dense_mlp_adapter_on_expert_layers_is_refused(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """Mixtral's every layer is a mixture of experts: a (hand-written) adapter of its
    ``gate_proj`` has no dense projection to run on, and is refused, naming it."""
    from safetensors.torch import save_file

    base = tmp_path / "mixtral"
    build_variant_model("mixtral", tiny_model_path, base)
    adapter = make_adapter(base, tmp_path / "adapter", seed=5, modules=ATTENTION_MODULES)
    weights_file = adapter / "adapter_model.safetensors"
    from safetensors.torch import load_file

    weights = load_file(weights_file)
    prefix = "base_model.model.model.layers.0.mlp.gate_proj"
    weights[f"{prefix}.lora_A.weight"] = torch.zeros(8, 64)
    weights[f"{prefix}.lora_B.weight"] = torch.zeros(96, 8)
    save_file(weights, weights_file)
    with pytest.raises(AdapterError, match=r"layers\.0\.gate_proj.*mixture-of-experts"):
        ModelRunner(str(base), lora_modules={"x": str(adapter)})


def test_an_evicted_adapter_whose_directory_went_away_fails_its_request_alone(
    tiny_model_path: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    import shutil

    copy = tmp_path / "a"
    shutil.copytree(adapters["a"], copy)
    one_slot = ModelRunner(
        str(tiny_model_path), max_loras=1, lora_modules={"a": str(copy), "b": str(adapters["b"])}
    )
    shutil.rmtree(copy)  # "a" was evicted by "b": it must be read again, and cannot be
    one_slot.add(RunnerRequest(0, PROMPTS[0], params("a")))
    one_slot.add(RunnerRequest(1, PROMPTS[0], params(None)))
    updates: dict[int, list[TokenUpdate]] = {0: [], 1: []}
    while one_slot.has_work():
        for update in one_slot.step():
            updates[update.request_id].append(update)
    (failed,) = updates[0]
    assert failed.error is not None and "is not a directory" in failed.error
    assert sum(len(update.tokens) for update in updates[1]) == NEW_TOKENS
