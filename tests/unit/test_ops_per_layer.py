"""Issue 16: a decode step costs at most 12 torch operations per decoder layer (36 before the
fused forward), counted with the torch profiler on CPU by ``bench/ops_per_layer.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.ops_per_layer import count_decode_ops_per_layer
from dpserve.cpu_settings import FUSED_DECODE_ENV, SMALL_BATCH_ROWS_ENV
from dpserve.engine.kernels import cpu_kernels

MAX_OPS_PER_LAYER = 12

# What each path's attention and cache write are called: torch's, and the C++ kernels'.
_ATTENTION_AND_WRITE = {
    False: ("aten::scaled_dot_product_attention", "aten::index_put_"),
    True: ("dpserve_cpu::decode_attention", "dpserve_cpu::rotate_and_write_kv"),
}


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "cpu-kernels"])
def test_a_decode_step_costs_at_most_12_operations_per_layer(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: bool
) -> None:
    if kernels and not cpu_kernels.available():
        pytest.skip("the CPU kernels did not build here (no C++ compiler)")
    monkeypatch.setattr(cpu_kernels, "usable", lambda tensor: kernels)
    # Which path a small decode step's linears take is otherwise measured once per process
    # (``linear.small_batch_rows``): where that probe picks the small-batch path and the kernels
    # are off, the dense ``F.linear`` runs with no fused epilogue. Pinned: torch's path is
    # oneDNN's fused primitives, the kernels' path is the decode kernel.
    monkeypatch.setenv(SMALL_BATCH_ROWS_ENV, "8" if kernels else "0")
    # The layers one torch operation at a time, as a step with a prompt chunk runs them: in
    # one C++ call (``layers.cpu_decode_layers``) the profiler sees no operation of a layer.
    monkeypatch.setenv(FUSED_DECODE_ENV, "0")
    count = count_decode_ops_per_layer(tiny_model_path, batch=4, context=21)
    assert 0 < count.compute <= MAX_OPS_PER_LAYER, str(count)
    # The counter sees the real work: projections, attention and the cache write are there.
    for name in _ATTENTION_AND_WRITE[kernels]:
        assert count.names.get(name, 0) == 1, str(count)
    assert count.total >= count.compute
