"""The LoRA shrink/expand kernels (``kernels.triton_lora``) equal the torch path of
``lora.delta`` they replace on CUDA and a plain per-row reference (CPU, Triton's interpreter):
rows of three adapters of ranks 8, 16 and 32 mixed with base-model rows, one row, widths that
are not multiples of the kernels' blocks, an input split into slices, a projection missing from
one adapter; fp32, fp16 and bf16. Rows of the base model and padding rows keep their exact bits.

As in ``test_triton_moe``: the kernel cases run in a child process with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import pytest
import torch

from dpserve.engine.kernels import triton_layer_ops, triton_lora
from dpserve.engine.lora import delta
from dpserve.engine.lora.delta import StepAdapters
from dpserve.engine.lora.weights import AdapterWeights, ModuleDelta
from tests.triton_interpreter import TRITON_MISSING, interpreter_case, interpreter_run

pytest.importorskip("triton", reason=TRITON_MISSING)
test_the_lora_kernel_cases_pass_in_the_interpreter = interpreter_run(__file__)

RANKS = (8, 16, 32)
# Values of about one (inputs and weights scaled so). fp32 agrees to rounding; fp16/bf16 round
# the shrunk rows to the dtype (as the torch path does) and the output once, so a shrunk value
# one unit apart moves the output by a unit or two of its dtype. Triton's interpreter (3.9)
# truncates fp32 to bf16 instead of rounding to nearest (CUDA rounds): about twice the torch
# path's error here, hence bf16's margin (tests/gpu/test_lora_gpu.py checks CUDA's).
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # rtol = atol


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


def adapter(
    seed: int,
    rank: int,
    shapes: dict[str, tuple[int, int]],
    dtype: torch.dtype,
    device: str = "cpu",
) -> AdapterWeights:
    """One layer's random deltas, ``shapes``: module -> (out, in), scaled so that the shrunk
    rows and the delta are of about one."""
    generator = torch.Generator().manual_seed(seed)
    modules = {}
    for module, (out_features, in_features) in shapes.items():
        a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
        b = torch.randn(out_features, rank, generator=generator) / rank**0.5
        modules[module] = ModuleDelta(a.to(device, dtype), b.to(device, dtype))
    return AdapterWeights(f"adapter-{seed}", "", rank, [modules])


def by_rows(
    adapters: list[AdapterWeights], row_slots: list[int], module: str, x: torch.Tensor
) -> torch.Tensor:
    """The plain reference in fp64: each row's ``(x @ A^T) @ B^T`` of its own adapter alone."""
    update = torch.zeros(x.shape[0], adapters[0].layers[0][module].b.shape[0], dtype=torch.float64)
    for row, slot in enumerate(row_slots):
        if slot >= 0 and module in adapters[slot].layers[0]:
            weights = adapters[slot].layers[0][module]
            update[row] = (x[row].double() @ weights.a.double().T) @ weights.b.double().T
    return update


def stacked_step(
    adapters: list[AdapterWeights], row_slots: list[int], device: str = "cpu"
) -> StepAdapters:
    """The stacked form of the step, all of ``adapters`` in the stack (``row_slots`` index
    them), as ``group_rows`` builds it (which would group one adapter's single row instead)."""
    stack = delta._combination(delta._Stack, tuple(adapters))
    return StepAdapters(stack=stack, row_adapter=torch.tensor(row_slots, device=device))


def test_the_stack_gives_each_adapter_its_columns_and_rank() -> None:
    shapes = {"qkv": (48, 32), "o_proj": (32, 24)}
    adapters = [
        adapter(1, 8, shapes, torch.float32),
        adapter(2, 16, {"qkv": shapes["qkv"]}, torch.float32),  # no o_proj
        adapter(3, 32, shapes, torch.float32),
    ]
    stack = stacked_step(adapters, [0, 1, 2, -1]).stack  # the engine's form on CUDA
    assert stack is not None
    qkv, o_proj = stack.layers[0]["qkv"], stack.layers[0]["o_proj"]
    assert qkv.starts.tolist() == [0, 8, 24] and qkv.ranks.tolist() == [8, 16, 32]
    assert qkv.max_rank == 32 and qkv.starts.dtype == torch.int32
    # Adapter 1 lacks the projection: rank 0, and the others' columns close up.
    assert o_proj.starts.tolist() == [0, 0, 8] and o_proj.ranks.tolist() == [8, 0, 32]
    assert o_proj.a.shape == (40, 24) and o_proj.b.shape == (32, 40)


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_lora.add_delta(
            torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(8, 4), torch.zeros(4, 8),
            torch.zeros(1, dtype=torch.long), one * 0, one * 8, 8,
        )  # fmt: skip


def test_the_cpu_path_stays_torch() -> None:
    # The kernels are for CUDA only: on CPU the stacked delta is the torch path, interpreter
    # or not.
    assert not delta._kernels_on(torch.device("cpu"))


def _run_kernels(
    adapters: list[AdapterWeights],
    row_slots: list[int],
    module: str,
    x: torch.Tensor,
    out: torch.Tensor,
) -> None:
    stacked = stacked_step(adapters, row_slots)
    assert stacked.stack is not None and stacked.row_adapter is not None
    weights = stacked.stack.layers[0][module]
    triton_lora.add_delta(
        x,
        out,
        weights.a,
        weights.b,
        stacked.row_adapter,
        weights.starts,
        weights.ranks,
        weights.max_rank,
    )


@interpreter_case
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("row_slots", "padding", "in_features", "out_features"),
    [
        # Mixed rows of three adapters and the base model, ragged widths, padding rows after.
        ([0, -1, 2, 1, 1, -1, 0, 2, 2, -1, 1], 3, 100, 150),
        # One row (a decode step of one request), of the largest rank.
        ([2], 0, 72, 40),
        # More rows than one block (16), the input split into slices (1500 > 2 x 512).
        ([(row * 7) % 4 - 1 for row in range(37)], 2, 1500, 200),
    ],
)
def test_the_kernels_equal_the_torch_path_and_each_rows_own_product(
    dtype: torch.dtype,
    row_slots: list[int],
    padding: int,
    in_features: int,
    out_features: int,
) -> None:
    shapes = {"qkv": (out_features, in_features)}
    adapters = [adapter(seed, rank, shapes, dtype) for seed, rank in enumerate(RANKS)]
    rows = len(row_slots)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows + padding, in_features, generator=generator).to(dtype)
    base = torch.randn(rows + padding, out_features, generator=generator).to(dtype)

    by_kernels = base.clone()
    _run_kernels(adapters, row_slots, "qkv", x, by_kernels)
    by_torch = base.clone()
    stacked_step(adapters, row_slots).add(0, "qkv", x, by_torch)  # on CPU: the torch path
    expected = base.double()
    expected[:rows] += by_rows(adapters, row_slots, "qkv", x[:rows])

    untouched = [row for row, slot in enumerate(row_slots) if slot < 0]
    untouched += list(range(rows, rows + padding))
    assert torch.equal(by_kernels[untouched], base[untouched])  # the same bits
    adapted = [row for row, slot in enumerate(row_slots) if slot >= 0]
    assert not torch.equal(by_kernels[adapted], base[adapted])
    assert_close(by_kernels.double(), expected, dtype)
    assert_close(by_kernels, by_torch, dtype)


@interpreter_case
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_adapters_run_the_kernels_for_fused_widths_and_a_missing_projection(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine's dispatch (CUDA only) taken on CPU in the interpreter: q/k/v fused
    # (32 + 2 * 8 wide from 40), an o_proj the second adapter does not have (rank 0 there).
    shapes = {"qkv": (48, 40), "o_proj": (40, 32)}
    adapters = [
        adapter(10, 8, shapes, dtype),
        adapter(11, 16, {"qkv": shapes["qkv"]}, dtype),
        adapter(12, 32, shapes, dtype),
    ]
    row_slots = [1, 0, -1, 2, 1, 1]
    generator = torch.Generator().manual_seed(5)
    inputs = {
        "qkv": torch.randn(8, 40, generator=generator).to(dtype),
        "o_proj": torch.randn(8, 32, generator=generator).to(dtype),
    }
    outputs = {
        module: torch.randn(8, shapes[module][0], generator=generator).to(dtype)
        for module in shapes
    }
    by_torch = {module: out.clone() for module, out in outputs.items()}
    torch_step = stacked_step(adapters, row_slots)
    for module in shapes:
        torch_step.add(0, module, inputs[module], by_torch[module])

    calls: list[int] = []
    add_delta = triton_lora.add_delta

    def counted(*args: object, **kwargs: object) -> None:
        calls.append(1)
        add_delta(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(delta, "_kernels_on", triton_layer_ops.available)
    monkeypatch.setattr(triton_lora, "add_delta", counted)
    by_kernels = {module: out.clone() for module, out in outputs.items()}
    kernel_step = stacked_step(adapters, row_slots)
    for module in shapes:
        kernel_step.for_layer(0)(module, inputs[module], by_kernels[module])
    assert len(calls) == 2
    for module in shapes:
        assert_close(by_kernels[module], by_torch[module], dtype)
    # The base row, the padding rows, and o_proj's rows of the adapter without it: unchanged.
    assert torch.equal(by_kernels["qkv"][[2, 6, 7]], outputs["qkv"][[2, 6, 7]])
    assert torch.equal(
        by_kernels["o_proj"][[0, 2, 4, 5, 6, 7]], outputs["o_proj"][[0, 2, 4, 5, 6, 7]]
    )
