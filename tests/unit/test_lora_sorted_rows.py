"""The LoRA delta of a step mixing adapters on CPU (``lora.sorted_rows``): the C++ kernel and the
``bmm`` path give every row exactly its own adapter's delta, as the stacked form and a per-row
float64 reference do, and leave the base model's rows untouched."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dpserve.engine.kernels import cpu_kernels
from dpserve.engine.lora import delta as lora_delta
from dpserve.engine.lora.delta import StepAdapters, group_rows
from dpserve.engine.lora.sorted_rows import PaddedAdapters, nonzero_spans
from dpserve.engine.lora.weights import AdapterWeights, ModuleDelta

HIDDEN, Q, KV, INNER = 40, 48, 24, 70  # widths off the kernel's 16 and 64 on purpose
# Output widths of each fused projection's parts (B is block-diagonal over them).
PARTS = {"qkv": (Q, KV, KV), "o_proj": (HIDDEN,), "gate_up": (INNER, INNER), "down_proj": (HIDDEN,)}
IN = {"qkv": HIDDEN, "o_proj": Q, "gate_up": HIDDEN, "down_proj": INNER}


def adapter(seed: int, rank: int, modules: tuple[str, ...] = tuple(PARTS)) -> AdapterWeights:
    """Random weights shaped as ``lora.adapter`` builds them: A ``[parts * r, in]``, B
    block-diagonal ``[out, parts * r]``, over two layers."""
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(2):
        layer = {}
        for module in modules:
            parts = PARTS[module]
            a = torch.randn(len(parts) * rank, IN[module], generator=generator)
            b = torch.zeros(sum(parts), len(parts) * rank)
            row = 0
            for index, width in enumerate(parts):
                block = torch.randn(width, rank, generator=generator) / rank
                b[row : row + width, index * rank : (index + 1) * rank] = block
                row += width
            layer[module] = ModuleDelta(a, b)
        layers.append(layer)
    return AdapterWeights(f"a{seed}", "", rank, layers)


WEIGHTS = {
    0: adapter(1, 8),
    2: adapter(2, 16, ("qkv", "gate_up", "down_proj")),  # no o_proj
    5: adapter(3, 32),
}
# Uneven runs: slot 0 has six rows (two units of four in the kernel), slot 2 one, slot 5 three.
ROW_SLOTS = [0, -1, 5, 0, 2, 0, -1, 5, 0, 0, 5, 0]
PADDED_ROWS = 3  # decode steps may be padded past their rows: those must stay untouched


def reference(module: str, layer: int, x: torch.Tensor) -> torch.Tensor:
    """Each row's delta alone, in float64."""
    out = torch.zeros(x.shape[0], sum(PARTS[module]), dtype=torch.float64)
    for row, slot in enumerate(ROW_SLOTS):
        delta = WEIGHTS[slot].layers[layer].get(module) if slot >= 0 else None
        if delta is not None:
            out[row] = x[row].double() @ delta.a.double().t() @ delta.b.double().t()
    return out


def run(step: StepAdapters, module: str, layer: int, x: torch.Tensor) -> torch.Tensor:
    out = torch.randn(x.shape[0], sum(PARTS[module]))
    before = out.clone()
    step.add(layer, module, x, out)
    base_rows = [row for row, slot in enumerate(ROW_SLOTS) if slot < 0]
    base_rows += list(range(len(ROW_SLOTS), x.shape[0]))
    assert torch.equal(out[base_rows], before[base_rows]), "a base or padding row changed"
    return (out - before).double()


def inputs(module: str) -> torch.Tensor:
    """Rows of a wider tensor, so that the kernel reads strided rows."""
    wide = torch.randn(len(ROW_SLOTS) + PADDED_ROWS, IN[module] + 5)
    return wide[:, 2 : 2 + IN[module]]


@pytest.mark.parametrize("module", list(PARTS))
def test_every_row_gets_its_own_adapters_delta_on_each_path(module: str) -> None:
    step = group_rows(ROW_SLOTS, WEIGHTS, torch.device("cpu"))
    assert step is not None and step.sorted_rows is not None
    assert step.sorted_rows.kernel == cpu_kernels.available()
    bmm = StepAdapters(sorted_rows=dataclasses.replace(step.sorted_rows, kernel=False))
    slots = sorted(WEIGHTS)
    stacked = StepAdapters(
        stack=lora_delta._combination(lora_delta._Stack, tuple(WEIGHTS[s] for s in slots)),
        row_adapter=torch.tensor([slots.index(s) if s >= 0 else -1 for s in ROW_SLOTS]),
    )
    for layer in (0, 1):
        x = inputs(module)
        expected = reference(module, layer, x)
        for form in (step, bmm, stacked):
            got = run(form, module, layer, x)[: len(ROW_SLOTS)]
            assert torch.allclose(got, expected[: len(ROW_SLOTS)], atol=1e-5, rtol=1e-4)


def test_one_adapter_on_every_row_runs_the_kernel_or_grouped_without_a_gather() -> None:
    only = group_rows([5, 5], WEIGHTS, torch.device("cpu"))
    assert only is not None
    if cpu_kernels.available():
        assert only.sorted_rows is not None and only.sorted_rows.kernel
    else:
        assert only.sorted_rows is None and only.groups[0][1] is None
    assert group_rows([-1, -1], WEIGHTS, torch.device("cpu")) is None


def test_ranks_are_padded_to_the_kernels_lanes_and_absent_modules_are_zero() -> None:
    padded = PaddedAdapters(tuple(WEIGHTS[slot] for slot in sorted(WEIGHTS)))
    qkv, o_proj = padded.layers[0]["qkv"], padded.layers[0]["o_proj"]
    assert qkv.a.shape == (3, HIDDEN, 96) and qkv.b.shape == (3, 96, Q + 2 * KV)
    assert o_proj.a.shape[2] == 32 and not o_proj.a[1].any() and not o_proj.b[1].any()
    assert o_proj.spans[1].eq(0).all()  # nothing to expand for the adapter without it


def test_nonzero_spans_find_each_column_blocks_rank_rows() -> None:
    b = torch.zeros(1, 32, 150)  # blocks of 64 columns: [0, 64), [64, 128), [128, 150)
    b[0, 0:8, 0:70] = 1.0  # rows 0-7 reach into the second block
    b[0, 16:24, 70:150] = 1.0
    assert nonzero_spans(b, 64).tolist() == [[[0, 8], [0, 24], [16, 24]]]
    assert nonzero_spans(torch.zeros(2, 16, 10), 64).tolist() == [[[0, 0]], [[0, 0]]]


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ CPU kernels are not built here")
def test_the_kernel_refuses_what_would_read_out_of_bounds() -> None:
    x, out = torch.randn(4, 16), torch.zeros(4, 64)
    a, b = torch.randn(1, 16, 16), torch.randn(1, 16, 64)
    spans = torch.tensor([[[0, 16]]])
    starts = torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match="row out of range"):
        cpu_kernels.lora_delta(x, out, a, b, spans, torch.tensor([0, 4]), starts)
    with pytest.raises(RuntimeError, match="rank span out of range"):
        cpu_kernels.lora_delta(
            x, out, a, b, torch.tensor([[[0, 17]]]), torch.tensor([0, 1]), starts
        )
    with pytest.raises(RuntimeError):  # a rank that is not a multiple of 16
        cpu_kernels.lora_delta(x, out, a[:, :, :8], b[:, :8], spans, torch.tensor([0, 1]), starts)
