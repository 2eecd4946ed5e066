"""GPU checks of the kernels and the device sampler (skipped, with the reason, without CUDA).

Run on a machine with a GPU:  ``pytest tests/gpu -v``. The compiled Triton decode-attention
kernel must equal the plain-torch reference in fp32, bf16 and fp16 on Llama-like shapes, also
when replayed from a CUDA graph with new lengths and block tables; the sampler must give the
same seeded tokens on CUDA as on CPU and stay safe for every dtype.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpserve.engine.layers.attention import paged_decode_attention_reference
from dpserve.engine.sample.penalties import PenaltyTokens, TokenHistory
from dpserve.engine.sample.sampler import sample
from dpserve.sampling import SamplingParams
from tests.paged_cases import PagedCase, make_paged_case, random_lengths
from tests.unit.test_sampling_safety import ROW_KINDS, check_output, make_row, sampling_params

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: the compiled Triton kernel and the device sampler run there",
)

# bf16 keeps 8 bits of mantissa and the kernel rounds the softmax weights to the cache dtype
# before the P @ V product, as flash attention does.
TOLERANCES = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.float16: {"rtol": 1e-2, "atol": 5e-3},
    torch.bfloat16: {"rtol": 5e-2, "atol": 2e-2},
}


def llama_case(dtype: torch.dtype, head_dim: int, batch: int, longest: int, seed: int) -> PagedCase:
    lengths = random_lengths(batch, 16, longest=longest, seed=seed)
    case = make_paged_case(
        lengths,
        num_heads=32,
        num_kv_heads=8,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        seed=seed,
    )
    return case.to("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    ("batch", "longest", "num_splits"),
    [(64, 2048, None), (3, 4000, None), (16, 700, 7), (256, 600, None)],
)
def test_triton_kernel_matches_the_reference(
    dtype: torch.dtype, head_dim: int, batch: int, longest: int, num_splits: int | None
) -> None:
    from dpserve.engine.kernels.triton_decode import paged_decode_attention_triton

    case = llama_case(dtype, head_dim, batch, longest, seed=batch + head_dim)
    got = paged_decode_attention_triton(*case.args(), num_splits=num_splits)
    torch.testing.assert_close(
        got, paged_decode_attention_reference(*case.args()), **TOLERANCES[dtype]
    )


def test_triton_kernel_replays_in_a_cuda_graph_with_new_lengths() -> None:
    from dpserve.engine.kernels.triton_decode import paged_decode_attention_triton

    first = llama_case(torch.bfloat16, 64, 32, 1000, seed=1)
    second = llama_case(torch.bfloat16, 64, 32, 1000, seed=2)
    # The graph owns static inputs; the second case must fit in the first's buffers.
    blocks = max(first.k_cache.shape[0], second.k_cache.shape[0])
    width = max(first.block_tables.shape[1], second.block_tables.shape[1])

    def static(case: PagedCase) -> PagedCase:
        k_cache = torch.zeros(
            (blocks, *case.k_cache.shape[1:]), dtype=case.k_cache.dtype, device="cuda"
        )
        v_cache = torch.zeros_like(k_cache)
        k_cache[: case.k_cache.shape[0]] = case.k_cache.nan_to_num()
        v_cache[: case.v_cache.shape[0]] = case.v_cache.nan_to_num()
        tables = torch.zeros(case.block_tables.shape[0], width, dtype=torch.int32, device="cuda")
        tables[:, : case.block_tables.shape[1]] = case.block_tables
        return PagedCase(case.query, k_cache, v_cache, tables, case.seq_lens, case.scale)

    buffers = static(first)
    paged_decode_attention_triton(*buffers.args())  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention_triton(*buffers.args())
    for case in (first, second):
        new = static(case)
        for target, source in zip(buffers.args()[:5], new.args()[:5], strict=True):
            target.copy_(source)
        graph.replay()
        torch.testing.assert_close(
            out, paged_decode_attention_reference(*new.args()), **TOLERANCES[torch.bfloat16]
        )


def test_seeded_tokens_are_the_same_on_cuda_and_cpu() -> None:
    logits = torch.randn(64, 128_256, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        SamplingParams(temperature=t, top_p=p, top_k=k, seed=s)
        for t, p, k, s in [
            (1.0, 1.0, 0, 1),
            (0.7, 0.9, 0, 2**63 - 1),
            (1.3, 0.95, 50, 0),
            (2.0, 1.0, 1000, 7),
        ]
    ] * 16
    positions = list(range(100, 164))
    on_cpu = sample(logits, params, positions).tokens
    on_cuda = sample(logits.cuda(), params, positions).tokens.cpu()
    # The noise is bit-identical; the scores may differ in the last ulp between devices, which
    # can flip a near-tie: allow a handful of rows out of 64.
    assert (on_cpu == on_cuda).sum() >= 60


def test_bias_penalties_and_min_p_choose_the_same_tokens_on_cuda_as_on_cpu() -> None:
    """logit_bias, the three penalties (from list histories and from the counts a sequence
    keeps between steps, both host tensors moved to the logits' device) and min_p, greedy and
    seeded, on a Llama-3 vocabulary: CUDA picks CPU's tokens, and the bias and penalties do
    change the picks (each row's forced token wins)."""
    vocab = 128_256
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(32, vocab, generator=generator) * 3
    prompt = torch.randint(vocab, (300,), generator=generator).tolist()
    generated = torch.randint(vocab, (40,), generator=generator).tolist()
    top = logits.argmax(-1).tolist()
    kinds = [
        {"repetition_penalty": 1.3, "frequency_penalty": 0.4},
        {"presence_penalty": 0.5, "min_p": 0.05},
        {"frequency_penalty": -0.3, "repetition_penalty": 0.9},
        {"min_p": 0.2},
    ]
    params, histories = [], []
    for row in range(32):
        forced = (top[row] + 1 + row) % vocab
        params.append(
            SamplingParams(
                temperature=0.0 if row % 2 == 0 else 0.8,
                seed=None if row % 2 == 0 else row,
                logit_bias=((forced, 100.0), (top[row], -100.0)),
                **kinds[row % 4],
            )
        )
        kept = PenaltyTokens(prompt, params[-1].repetition_penalty != 1.0)
        histories.append(TokenHistory(prompt, generated) if row % 3 else kept.counts(generated))
    positions = list(range(400, 432))
    on_cpu = sample(logits, params, positions, histories).tokens
    on_cuda = sample(logits.cuda(), params, positions, histories).tokens.cpu()
    assert torch.equal(on_cpu, on_cuda)
    assert on_cuda.tolist() == [(top[row] + 1 + row) % vocab for row in range(32)]
    # Without the bias, the penalized greedy rows still agree between the devices.
    plain = [dataclasses.replace(p, logit_bias=()) for p in params]
    cpu_plain = sample(logits, plain, positions, histories).tokens
    cuda_plain = sample(logits.cuda(), plain, positions, histories).tokens.cpu()
    assert (cpu_plain == cuda_plain).sum() >= 30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_on_cuda_is_the_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(256, 128_256, device="cuda", dtype=dtype)
    params = [SamplingParams(temperature=0.0)] * 256
    assert torch.equal(sample(logits, params, range(256)).tokens, logits.float().argmax(-1))


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(
        st.tuples(sampling_params, st.sampled_from(ROW_KINDS), st.integers(0, 2**31)),
        min_size=1,
        max_size=8,
    ),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_sample_on_cuda_is_safe(
    rows: list[tuple[SamplingParams, str, int]], dtype: torch.dtype
) -> None:
    logits = torch.stack([make_row(kind, seed) for _, kind, seed in rows]).to(dtype).cuda()
    check_output(logits, [p for p, _, _ in rows], [seed for _, _, seed in rows])
