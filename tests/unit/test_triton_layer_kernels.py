"""The Triton layer kernels (``triton_layer_ops``, ``triton_prefill``) equal the torch code they
replace on CUDA (CPU, Triton's interpreter).

As in ``test_triton_decode``: ``TRITON_INTERPRET=1`` must be set before triton is first imported
and must not leak into a process that runs GPU tests, so the cases run in a child process.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional

from dpserve.engine.kernels import triton_layer_ops, triton_prefill
from dpserve.engine.layers.attention import prefill_attention
from dpserve.engine.layers.norm import head_norm_
from dpserve.engine.layers.rotary import rotate_in_place
from tests.tiny_model import build_variant_model
from tests.triton_interpreter import TRITON_MISSING, interpreter_case, interpreter_run

pytest.importorskip("triton", reason=TRITON_MISSING)
test_the_layer_kernel_cases_pass_in_the_interpreter = interpreter_run(__file__)


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_layer_ops.available(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_layer_ops.silu_times_up(torch.zeros(2, 8))


def _rotation(positions: int, half: int, seed: int) -> torch.Tensor:
    angles = torch.rand(positions, half, generator=torch.Generator().manual_seed(seed)) * 6.3
    return torch.polar(torch.ones_like(angles), angles).unsqueeze(1)


def rotated_by_torch(
    qkv: torch.Tensor,
    rotation: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    kv_pair: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of ``qkv`` and ``kv_pair`` after the torch path's RoPE and KV write
    (``rotary.rotate_in_place`` and ``index_put_``): what ``rotate_and_write_kv`` must make of
    them."""
    tokens, head_dim = qkv.shape[0], kv_pair.shape[-1]
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    expected_qkv, expected_kv = qkv.clone(), kv_pair.clone()
    rotate_in_place(
        expected_qkv[:, : q_size + kv_size].view(tokens, heads + kv_heads, -1, 2),
        rotation.index_select(0, positions),
    )
    flat = expected_kv.view(2, -1, kv_heads, head_dim)
    flat[:, slots] = expected_qkv[:, q_size:].view(tokens, 2, kv_heads, head_dim).transpose(0, 1)
    return expected_qkv, expected_kv


@interpreter_case
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype"),
    [
        (4, 2, 16, torch.float32),
        (8, 2, 32, torch.bfloat16),
        (6, 3, 8, torch.float32),  # head counts that are no powers of two
    ],
)
def test_rotate_and_write_equals_the_torch_rotation_and_index_put(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(heads + head_dim)
    tokens, block_size, blocks = 7, 4, 6
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size).to(dtype)
    rotation = _rotation(32, head_dim // 2, seed=head_dim)
    positions = torch.randint(0, 32, (tokens,))
    slots = torch.randperm(blocks * block_size)[:tokens]
    kv_pair = torch.randn(2, blocks, block_size, kv_heads, head_dim).to(dtype)

    expected_qkv, expected_kv = rotated_by_torch(
        qkv, rotation, positions, slots, kv_pair, heads, kv_heads
    )
    triton_layer_ops.rotate_and_write_kv(
        qkv, rotation, positions, slots, kv_pair, heads, kv_heads, head_dim
    )
    # bf16: within one unit of the last place (Triton's interpreter truncates where the GPU
    # rounds to nearest).
    exact = {"rtol": 1e-6 if dtype == torch.float32 else 2**-7, "atol": 1e-6}
    torch.testing.assert_close(qkv[:, :q_size], expected_qkv[:, :q_size], **exact)
    # Everything else in the pool is untouched; the written slots hold the rotated keys.
    torch.testing.assert_close(kv_pair, expected_kv, **exact)


@interpreter_case
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype"),
    [(4, 2, 16, torch.float32), (8, 2, 32, torch.bfloat16), (6, 1, 16, torch.float32)],
)
def test_rotate_and_write_with_the_head_norm_equals_the_norm_then_the_rotation(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Qwen3's q/k RMSNorm fused into the RoPE kernel: the same queries and cache as
    ``head_norm_`` on the query and key heads, then the torch rotation and write."""
    torch.manual_seed(heads * head_dim)
    tokens, block_size, blocks = 5, 4, 4
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = (torch.randn(tokens, q_size + 2 * kv_size) * 3).to(dtype)
    query_norm = torch.rand(head_dim).add(0.5).to(dtype)
    key_norm = torch.rand(head_dim).add(0.5).to(dtype)
    rotation = _rotation(16, head_dim // 2, seed=head_dim)
    positions = torch.randint(0, 16, (tokens,))
    slots = torch.randperm(blocks * block_size)[:tokens]
    kv_pair = torch.randn(2, blocks, block_size, kv_heads, head_dim).to(dtype)

    normed = qkv.clone()
    head_norm_(normed[:, :q_size].view(tokens, heads, head_dim), query_norm, 1e-6)
    head_norm_(
        normed[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim), key_norm, 1e-6
    )
    expected_qkv, expected_kv = rotated_by_torch(
        normed, rotation, positions, slots, kv_pair, heads, kv_heads
    )
    triton_layer_ops.rotate_and_write_kv(
        qkv,
        rotation,
        positions,
        slots,
        kv_pair,
        heads,
        kv_heads,
        head_dim,
        (query_norm, key_norm, 1e-6),
    )
    # bf16 rounds three times (the norm, its weight, the rotation) and Triton's interpreter
    # truncates where the GPU rounds to nearest: within two units of the last place of values
    # up to ~4 (a weight read from the wrong heads is off by far more).
    exact = (
        {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-6, "atol": 2**-4}
    )
    torch.testing.assert_close(qkv[:, :q_size], expected_qkv[:, :q_size], **exact)
    torch.testing.assert_close(kv_pair, expected_kv, **exact)


def test_the_head_norm_is_fused_for_power_of_two_head_sizes_only() -> None:
    assert triton_layer_ops.fuses_head_norm(128) and triton_layer_ops.fuses_head_norm(64)
    assert not triton_layer_ops.fuses_head_norm(96)
    assert not triton_layer_ops.fuses_head_norm(0)


@interpreter_case
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [24, 1500])  # one program's block, and several
def test_silu_times_up_equals_silu_then_mul(dtype: torch.dtype, width: int) -> None:
    gate_up = (torch.randn(5, 2 * width, generator=torch.Generator().manual_seed(width)) * 4).to(
        dtype
    )
    gate, up = gate_up.chunk(2, dim=-1)
    expected = functional.silu(gate).mul_(up)
    got = triton_layer_ops.silu_times_up(gate_up)
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(got, expected, **tolerance)


# (cached, length) per chunk: fresh prompts, chunks after cached tokens, block boundaries, a
# one-token chunk, and chunks longer than a tile of query rows.
PREFILL_STEPS = [
    [(0, 9)],
    [(5, 1), (0, 3), (8, 4)],
    [(11, 6), (0, 16), (3, 13), (16, 1)],
    [(0, 37), (20, 25)],
]


@interpreter_case
@pytest.mark.parametrize("chunks", PREFILL_STEPS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (6, 2), (4, 4)])
def test_varlen_prefill_kernel_equals_the_reference_chunk_by_chunk(
    chunks: list[tuple[int, int]], heads: int, kv_heads: int
) -> None:
    head_dim, block_size = 16, 4
    seed = sum(cached * 7 + length for cached, length in chunks) + heads
    torch.manual_seed(seed)
    rng = random.Random(seed)
    contexts = [cached + length for cached, length in chunks]
    num_blocks = sum(-(-c // block_size) for c in contexts) + 4
    kv_pair = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)  # noise everywhere
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    queries, slots, cached_blocks, sequences = [], [], [], []
    for cached, length in chunks:
        blocks = [free.pop() for _ in range(-(-(cached + length) // block_size))]
        table = torch.tensor(blocks)
        keys = torch.randn(cached + length, kv_heads, head_dim)
        values = torch.randn(cached + length, kv_heads, head_dim)
        for position in range(cached + length):
            block, offset = blocks[position // block_size], position % block_size
            kv_pair[0, block, offset], kv_pair[1, block, offset] = keys[position], values[position]
        slots += [
            blocks[p // block_size] * block_size + p % block_size
            for p in range(cached, cached + length)
        ]
        cached_blocks.append(table if cached else None)
        sequences.append((keys, values))
        queries.append(torch.randn(length, heads, head_dim))
    layout = triton_prefill.varlen_layout(
        lengths=[n for _, n in chunks],
        cached=[c for c, _ in chunks],
        cached_blocks=cached_blocks,
        slot_mapping=torch.tensor(slots),
        block_size=block_size,
    )
    # The query rows as the model hands them: a strided view of a wider projection.
    wide = torch.randn(sum(n for _, n in chunks), heads * head_dim + 8)
    query = wide[:, : heads * head_dim].view(-1, heads, head_dim)
    query.copy_(torch.cat(queries))
    scale = head_dim**-0.5
    out = triton_prefill.varlen_prefill_attention_triton(query, kv_pair, layout, scale)
    assert out.shape == (sum(n for _, n in chunks), heads * head_dim)
    offset = 0
    for (keys, values), (_, length), chunk_queries in zip(sequences, chunks, queries, strict=True):
        expected = prefill_attention(chunk_queries, keys, values, scale)
        rows = out[offset : offset + length].view(-1, heads, head_dim)
        torch.testing.assert_close(rows, expected, rtol=1e-5, atol=1e-5)
        offset += length


def small_steps_runner(tiny_model_path: Path) -> Any:
    """A CPU runner of the tiny model in fp32, in steps of at most 24 tokens (prompts split
    into chunks, beside decoding sequences), EOS ignored."""
    from dpserve.engine.model_runner import ModelRunner

    runner = ModelRunner(
        str(tiny_model_path), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=24
    )
    runner.eos_token_ids = frozenset()
    return runner


@interpreter_case
@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3-moe", "mixtral"])
def test_the_model_gives_the_same_tokens_with_the_triton_layers(
    kind: str, tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole engine on CPU with the CUDA path's kernels (interpreted) against torch's:
    prefill chunks after cached prefixes, mixed steps, decodes; same tokens and log-probs.
    Qwen3's q/k norm runs fused into the RoPE kernel there, and the experts of Qwen3-MoE and
    Mixtral in the fused MoE kernel."""
    from dpserve.engine.layers import kernel_choice
    from dpserve.engine.runner import RunnerRequest
    from dpserve.sampling import SamplingParams

    model_path = tiny_model_path
    if kind != "llama":
        build_variant_model(kind, tiny_model_path, tmp_path)
        model_path = tmp_path
    rng = random.Random(5)
    shared = [rng.randrange(5, 380) for _ in range(9)]  # a cached prefix for the later ones
    prompts = [
        shared + [rng.randrange(5, 380) for _ in range(rng.randint(1, 14))] for _ in range(5)
    ]
    outcomes = []
    for triton_layers in (False, True):
        monkeypatch.setattr(
            kernel_choice, "uses_triton_layers", lambda _device, on=triton_layers: on
        )
        runner = small_steps_runner(model_path)
        assert runner.backend.model.triton_layers is triton_layers
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=6, return_log_probs=True)
        for request_id, prompt in enumerate(prompts):
            runner.add(RunnerRequest(request_id, prompt, params))
        got: dict[int, tuple[list[int], list[float]]] = {i: ([], []) for i in range(len(prompts))}
        while runner.has_work():
            for update in runner.step():
                got[update.request_id][0].extend(update.tokens)
                got[update.request_id][1].extend(update.logprobs or [])
        assert runner.stats()["prefix_cache_hits"] > 0
        outcomes.append(got)
    torch_run, triton_run = outcomes
    for request_id in torch_run:
        assert triton_run[request_id][0] == torch_run[request_id][0]
        assert triton_run[request_id][1] == pytest.approx(torch_run[request_id][1], abs=1e-4)


@interpreter_case
def test_prompt_steps_through_the_piecewise_pieces_give_the_same_tokens(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The piecewise graphs' pieces with the CUDA path's kernels (interpreted), replayed by
    running again: their start check passes, and prompts arriving beside decoding sequences
    get the eager forward's tokens and log-probs (with the same kernels) through them."""
    from dpserve.engine.layers import kernel_choice
    from dpserve.engine.paged.piecewise_graphs import PiecewiseGraphs, eager
    from dpserve.engine.runner import RunnerRequest
    from dpserve.sampling import SamplingParams

    monkeypatch.setattr(kernel_choice, "uses_triton_layers", lambda _device: True)
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 380) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    outcomes, piecewise_steps = [], []
    for pieces in (False, True):
        runner = small_steps_runner(tiny_model_path)
        paged: Any = runner.backend
        assert paged.model.glue == "triton"
        if pieces:
            with torch.inference_mode():
                graphs = PiecewiseGraphs(paged.model, paged.cache, 24, capture=eager)
                assert graphs.verify()
            monkeypatch.setattr(
                graphs,
                "run",
                lambda batch, run=graphs.run: piecewise_steps.append(batch) or run(batch),
            )
            paged.piecewise = graphs
        params = SamplingParams(temperature=0.0, num_tokens_to_generate=8, return_log_probs=True)
        got: dict[int, tuple[list[int], list[float]]] = {i: ([], []) for i in range(len(prompts))}
        for request_id, prompt in enumerate(prompts):
            runner.add(RunnerRequest(request_id, prompt, params))
            # Each prompt arrives while the earlier ones decode; the last step drains them.
            while runner.has_work() and (request_id == len(prompts) - 1 or not got[request_id][0]):
                for update in runner.step():
                    got[update.request_id][0].extend(update.tokens)
                    got[update.request_id][1].extend(update.logprobs or [])
        outcomes.append(got)
    assert any(batch.num_decodes and batch.prefills for batch in piecewise_steps)
    eager_run, piecewise_run = outcomes
    for request_id in eager_run:
        assert piecewise_run[request_id][0] == eager_run[request_id][0]
        assert piecewise_run[request_id][1] == pytest.approx(eager_run[request_id][1], abs=1e-4)
