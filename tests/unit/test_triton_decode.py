"""The Triton paged decode-attention kernel equals the plain-torch reference (CPU, interpreter).

Triton's interpreter runs the same kernel source in numpy, so CI checks the indexing, masking,
online softmax and split merging without a GPU; tests/gpu/ runs the compiled kernel in bf16,
fp16 and fp32 on the device.

``TRITON_INTERPRET=1`` only works if it is set before triton is first imported (triton's own
``tl.max``/``tl.sum`` are decorated at import), and it must never leak into a process that runs
the GPU tests. So ``test_the_kernel_cases_pass_in_the_interpreter`` runs this file again in a
child process with the variable set; the cases themselves run only there.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from dpserve.engine.kernels import triton_decode
from dpserve.engine.kernels.triton_decode import TritonUnavailable, paged_decode_attention_triton
from dpserve.engine.layers.attention import paged_decode_attention_reference
from tests.paged_cases import make_paged_case, random_lengths
from tests.triton_interpreter import TRITON_MISSING, interpreter_case, interpreter_run

pytest.importorskip("triton", reason=TRITON_MISSING)
test_the_kernel_cases_pass_in_the_interpreter = interpreter_run(__file__)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (4, 4, 32, 16),  # multi-head: a group of one
        (8, 2, 64, 16),  # grouped-query, 4 query heads per KV head
        (8, 1, 32, 8),  # multi-query; blocks smaller than a tile
        (12, 4, 40, 5),  # a group of 3 and a head dim that are no powers of two; odd blocks
        (32, 8, 64, 32),  # the Llama-3 ratio
    ],
)
@pytest.mark.parametrize("num_splits", [None, 1, 3, 64])
@interpreter_case
def test_kernel_matches_reference_on_random_block_tables(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, num_splits: int | None
) -> None:
    lengths = random_lengths(7, block_size, longest=90, seed=num_heads * block_size)
    case = make_paged_case(
        lengths,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        seed=head_dim,
    )
    expected = paged_decode_attention_reference(*case.args())
    # 64 splits leave most of them empty: they must merge as nothing. min_split_tokens 1 lets
    # every sequence use as many splits as its own length allows (on the device).
    got = paged_decode_attention_triton(*case.args(), num_splits=num_splits, min_split_tokens=1)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@interpreter_case
@pytest.mark.parametrize("seed", range(6))
def test_kernel_matches_reference_on_random_shapes(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    num_kv_heads = int(torch.randint(1, 4, (1,), generator=generator))
    group = int(torch.randint(1, 6, (1,), generator=generator))
    block_size = int(torch.randint(1, 33, (1,), generator=generator))
    batch = int(torch.randint(1, 9, (1,), generator=generator))
    lengths = torch.randint(1, 120, (batch,), generator=generator).tolist()
    case = make_paged_case(
        lengths,
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        block_size=block_size,
        seed=seed,
    )
    splits = int(torch.randint(1, 9, (1,), generator=generator))
    torch.testing.assert_close(
        paged_decode_attention_triton(*case.args(), num_splits=splits, min_split_tokens=seed + 1),
        paged_decode_attention_reference(*case.args()),
        rtol=1e-5,
        atol=1e-5,
    )


@interpreter_case
def test_a_padding_row_without_tokens_gets_zeros() -> None:
    case = make_paged_case([5, 20], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    seq_lens = case.seq_lens.clone()
    seq_lens[0] = 0
    out = paged_decode_attention_triton(
        case.query, case.k_cache, case.v_cache, case.block_tables, seq_lens, case.scale
    )
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1:], paged_decode_attention_reference(*case.args())[1:])


def test_default_splits_depend_on_shapes_only() -> None:
    cpu = torch.device("cpu")
    assert triton_decode.default_num_splits(1, 8, 4096, cpu) == 1  # one "SM": no split needed
    assert triton_decode.default_num_splits(1, 1, 100, cpu) == 1


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = make_paged_case([3], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4)
    with pytest.raises(TritonUnavailable, match="TRITON_INTERPRET=1"):
        paged_decode_attention_triton(*case.args())


def test_mismatched_heads_are_refused() -> None:
    case = make_paged_case([3], num_heads=3, num_kv_heads=2, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="do not fit"):
        paged_decode_attention_triton(*case.args())


def test_module_imports_without_triton_and_the_call_explains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A fresh copy of the module, loaded while "import triton" fails.
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("_decode_without_triton", triton_decode.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    case = make_paged_case([3], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4)
    with pytest.raises(module.TritonUnavailable, match="needs the triton package"):
        module.paged_decode_attention_triton(*case.args())


@interpreter_case
def test_each_sequence_splits_its_own_length() -> None:
    """A grid sized for the longest row: a short row uses one split (the others empty), a long
    one several, and both equal the reference whatever the split floor."""
    case = make_paged_case([3, 150], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    expected = paged_decode_attention_reference(*case.args())
    for floor in (1, 16, 40, 1000):
        got = paged_decode_attention_triton(*case.args(), num_splits=8, min_split_tokens=floor)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@interpreter_case
def test_warm_up_runs_every_width_class_and_batch() -> None:
    ran = triton_decode.warm_up(
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_batch=3,
        max_blocks_per_sequence=20,
    )
    # Widths 1, 2, 16, 17 and the maximum: each Triton specialization class of the row stride.
    assert {width for width, _ in ran} == {1, 2, 16, 17, 20}
