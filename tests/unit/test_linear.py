"""The model's linear layers: every fused variant equals the plain torch computation, on the
prepacked oneDNN path (fp32 on x86 CPUs), on the small-batch path (the C++ decode kernel where it
is built, else the dense ``F.linear``) and on the torch fallback (fp64: oneDNN refuses it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional

from dpserve.cpu_settings import BF16_DOTS_ENV, SMALL_BATCH_ROWS_ENV
from dpserve.engine.kernels import cpu_kernels
from dpserve.engine.layers import linear as linear_module
from dpserve.engine.layers.linear import (
    SMALL_BATCH_MAX_ROWS,
    Linear,
    small_batch_rows,
    uses_onednn,
)
from dpserve.engine.layers.weight_format import dequantize


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_variants_equal_torch(dtype: torch.dtype, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(int(with_bias))
    weight = torch.randn(24, 40, generator=generator, dtype=dtype)
    bias = torch.randn(24, generator=generator, dtype=dtype) if with_bias else None
    x = torch.randn(5, 40, generator=generator, dtype=dtype)
    other = torch.randn(5, 24, generator=generator, dtype=dtype)
    linear = Linear(weight.clone(), None if bias is None else bias.clone())
    if dtype == torch.float64:
        assert not linear.onednn
    plain = functional.linear(x, weight, bias)
    tolerance = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(linear(x), plain, **tolerance)
    torch.testing.assert_close(linear.silu(x), functional.silu(plain), **tolerance)
    torch.testing.assert_close(linear.times(x, other), plain * other, **tolerance)
    before = other.clone()
    torch.testing.assert_close(linear.plus(x, other), plain + other, **tolerance)
    assert torch.equal(other, before)  # the residual is not modified in place


def test_fp32_on_this_cpu_runs_prepacked() -> None:
    """The PyPI wheels this project installs have oneDNN: the fast path is the one in use."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        pytest.skip("this torch build has no oneDNN")
    assert uses_onednn(torch.ones(4, 4))
    assert Linear(torch.ones(4, 4)).weight.is_mkldnn


needs_onednn = pytest.mark.skipif(
    not uses_onednn(torch.ones(2, 2)), reason="this torch build has no oneDNN linears"
)


@needs_onednn
@pytest.mark.parametrize(
    ("setting", "rows"), [(3, 1), (3, 3), (3, 4), (8, 2), (8, 5), (8, 8), (8, 9)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_batches_take_the_dense_weight_and_equal_torch(
    setting: int, rows: int, with_bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to ``setting`` rows run the small-batch path (the decode kernel where the C++ kernels
    are built), more the packed oneDNN one; every variant equals torch either way, with
    activations and residuals whose rows are wider than they are (views of wider tensors)."""
    monkeypatch.setenv(SMALL_BATCH_ROWS_ENV, str(setting))
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(37, 45, generator=generator)
    bias = torch.randn(37, generator=generator) if with_bias else None
    x = torch.randn(rows, 50, generator=generator)[:, :45]
    other = torch.randn(rows, 40, generator=generator)[:, :37]
    linear = Linear(weight.clone(), bias)
    assert linear.small_rows == setting and linear.dense is not None and linear.weight.is_mkldnn
    assert linear.decode_kernel == cpu_kernels.available()
    calls: list[str] = []
    onednn, decode = linear._onednn, cpu_kernels.decode_matmul
    monkeypatch.setattr(linear, "_onednn", lambda *args: calls.append("onednn") or onednn(*args))
    monkeypatch.setattr(
        cpu_kernels, "decode_matmul", lambda *args: calls.append("kernel") or decode(*args)
    )
    plain = functional.linear(x, weight, bias)
    tolerance = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(linear(x), plain, **tolerance)
    torch.testing.assert_close(linear.silu(x), functional.silu(plain), **tolerance)
    torch.testing.assert_close(linear.times(x, other), plain * other, **tolerance)
    torch.testing.assert_close(linear.plus(x, other), plain + other, **tolerance)
    assert ("onednn" in calls) == (rows > setting)
    assert ("kernel" in calls) == (rows <= setting and cpu_kernels.available())


@needs_onednn
def test_without_small_batches_no_second_copy_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SMALL_BATCH_ROWS_ENV, "0")
    linear = Linear(torch.ones(8, 8))
    assert (linear.small_rows, linear.dense) == (0, None)
    assert torch.equal(linear(torch.ones(1, 8)), torch.full((1, 8), 8.0))


@needs_onednn
@pytest.mark.parametrize("setting", ["0", "3"])
def test_no_rows_give_no_rows(setting: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose prompt chunks need no logits yet sends no rows to the vocabulary
    projection; without a dense copy of the weight that once failed an assertion."""
    monkeypatch.setenv(SMALL_BATCH_ROWS_ENV, setting)
    linear = Linear(torch.ones(8, 6))
    empty, residual = torch.ones(0, 6), torch.ones(0, 8)
    for out in (linear(empty), linear.silu(empty), linear.times(empty, residual)):
        assert out.shape == (0, 8)
    assert linear.plus(empty, residual).shape == (0, 8)


@pytest.mark.parametrize("value", [str(SMALL_BATCH_MAX_ROWS + 1), "-1", "two", "", "1.5"])
def test_a_bad_small_batch_setting_is_refused_by_name(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SMALL_BATCH_ROWS_ENV, value)
    with pytest.raises(ValueError, match=SMALL_BATCH_ROWS_ENV):
        small_batch_rows(torch.float32)


def test_small_batches_are_measured_only_for_fp32_on_onednn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SMALL_BATCH_ROWS_ENV, raising=False)
    assert small_batch_rows(torch.float64) == 0
    assert small_batch_rows(torch.bfloat16) == 0


@needs_onednn
def test_the_measurement_picks_a_row_count_the_small_path_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SMALL_BATCH_ROWS_ENV, raising=False)
    measured = linear_module._measured_small_batch_rows.__wrapped__(
        # A row-major shape and a wide one (column-blocked for the kernel).
        torch.get_num_threads(),
        linear_module.probe_shapes([(960, 576), (576, 1536), (512, 2048)]),
    )
    assert 0 <= measured <= SMALL_BATCH_MAX_ROWS


def test_a_probe_pass_is_timed_by_its_calls_no_thread_was_preempted_in() -> None:
    """A pass's time from its calls one by one: calls that waited a scheduler slice for a
    preempted thread (a third of them here, 40x as long) leave the pass's time where the
    clean calls put it, and each shape counts as often as it was called."""
    clean = [((960, 576), 100e-6), ((1536, 576), 150e-6)] * 12
    assert linear_module.pass_seconds(clean) == pytest.approx(12 * 100e-6 + 12 * 150e-6)
    preempted = [
        (shape, seconds * 40 if index % 3 == 0 else seconds)
        for index, (shape, seconds) in enumerate(clean)
    ]
    assert linear_module.pass_seconds(preempted) == pytest.approx(linear_module.pass_seconds(clean))
    # A pass slow throughout (a slower path) reads slow.
    slower = [(shape, seconds * 1.5) for shape, seconds in clean]
    assert linear_module.pass_seconds(slower) == pytest.approx(
        1.5 * linear_module.pass_seconds(clean)
    )


def test_the_probe_measures_the_model_s_shapes_cut_to_size() -> None:
    """SmolLM2's layer as it is; an 8B model's MLP cut to its first rows, its row width kept;
    a tiny test model's few KB replaced by the stand-in."""
    smollm2 = [(960, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
    assert linear_module.probe_shapes(smollm2) == tuple(smollm2)
    cut = linear_module.probe_shapes([(14336, 4096), (4096, 14336)])
    assert [width for _, width in cut] == [4096, 14336]
    assert all(
        rows * width * 4 <= linear_module._PROBE_MAX_WEIGHT_BYTES < (rows + 1) * width * 4
        for rows, width in cut
    )
    assert linear_module.probe_shapes([(128, 64), (64, 64)]) == (linear_module._PROBE_SHAPE,)
    assert linear_module.probe_shapes([]) == (linear_module._PROBE_SHAPE,)


@pytest.mark.parametrize(
    ("limit", "limited"), [("max", False), (str(1 << 30), True), (str(1 << 62), False)]
)
def test_under_a_memory_limit_nothing_is_kept_twice(
    limit: str, limited: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container's limit was sized for one copy of the weights (cgroup v2's file here):
    nothing is measured there."""
    (tmp_path / "memory.max").write_text(limit + "\n")
    monkeypatch.setattr(linear_module, "_CGROUP_LIMIT_FILES", (tmp_path / "memory.max",))
    monkeypatch.delenv(SMALL_BATCH_ROWS_ENV, raising=False)
    monkeypatch.setattr(linear_module, "_measured_small_batch_rows", lambda threads, shapes: 2)
    linear_module._under_memory_limit.cache_clear()
    try:
        assert linear_module._under_memory_limit() == limited
        expected = 0 if limited or not uses_onednn(torch.ones(2, 2)) else 2
        assert small_batch_rows(torch.float32) == expected
        monkeypatch.setenv(SMALL_BATCH_ROWS_ENV, "1")  # the setting decides anywhere
        assert small_batch_rows(torch.float32) == 1
    finally:
        linear_module._under_memory_limit.cache_clear()


@needs_onednn
@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels did not build here")
def test_under_a_memory_limit_the_kernel_s_copy_is_the_only_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a limit, with the decode kernel built, a weight is held once: in the kernel's
    pages, which oneDNN runs from unpacked for larger batches; every variant at every row
    count still equals torch's."""
    (tmp_path / "memory.max").write_text(str(1 << 30) + "\n")
    monkeypatch.setattr(linear_module, "_CGROUP_LIMIT_FILES", (tmp_path / "memory.max",))
    monkeypatch.delenv(SMALL_BATCH_ROWS_ENV, raising=False)
    linear_module._under_memory_limit.cache_clear()
    try:
        generator = torch.Generator().manual_seed(7)
        weight = torch.randn(24, 40, generator=generator)
        bias = torch.randn(24, generator=generator)
        linear = Linear(weight.clone(), bias.clone())
        assert linear.one_copy and linear.decode_kernel
        assert linear.small_rows == SMALL_BATCH_MAX_ROWS
        assert linear.weight is linear.dense and not linear.weight.is_mkldnn
        tolerance = {"rtol": 1e-5, "atol": 1e-5}
        for rows in (0, 1, 3, SMALL_BATCH_MAX_ROWS, SMALL_BATCH_MAX_ROWS + 1, 37):
            x = torch.randn(rows, 40, generator=generator)
            other = torch.randn(rows, 24, generator=generator)
            plain = functional.linear(x, weight, bias)
            torch.testing.assert_close(linear(x), plain, **tolerance)
            torch.testing.assert_close(linear.silu(x), functional.silu(plain), **tolerance)
            torch.testing.assert_close(linear.times(x, other), plain * other, **tolerance)
            torch.testing.assert_close(linear.plus(x, other), plain + other, **tolerance)
        # The setting still decides, with both copies.
        monkeypatch.setenv(SMALL_BATCH_ROWS_ENV, "2")
        both = Linear(weight.clone(), bias.clone())
        assert not both.one_copy and both.small_rows == 2 and both.weight.is_mkldnn
    finally:
        linear_module._under_memory_limit.cache_clear()


@needs_onednn
def test_a_model_s_linears_take_the_row_count_measured_on_its_own_shapes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe's timing is replaced (it varies), what it is asked and what becomes of its
    answer is not: one decoder layer's shapes as the model holds them (q/k/v fused), and every
    projection, the lm_head's too, running steps of that many rows on the small-batch path."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from dpserve.engine.models.llama import PagedLlama

    if linear_module._under_memory_limit():
        pytest.skip("under a memory limit the weights are held once and nothing is measured")
    monkeypatch.delenv(SMALL_BATCH_ROWS_ENV, raising=False)
    asked: list[tuple[tuple[int, int], ...]] = []

    def measured(threads: int, shapes: tuple[tuple[int, int], ...]) -> int:
        asked.append(shapes)
        return 3

    monkeypatch.setattr(linear_module, "_measured_small_batch_rows", measured)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=512,
    )
    model = PagedLlama(AutoModelForCausalLM.from_config(config).to(torch.float32))
    assert asked == [((512, 256), (256, 256), (1024, 256), (1024, 256), (256, 1024))]
    assert model.kernels.small_batch_rows == 3
    assert {linear.small_rows for linear in model.projections()} == {3}


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ CPU kernels are not built here")
@pytest.mark.parametrize("weight_format", ["fp32", "bf16", "int8"])
def test_a_wide_linear_is_held_column_blocked_and_equals_torch(
    weight_format: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of 3,000 columns: the decode kernel's copy is column-blocked; small batches (the
    kernel), a bf16/int8 weight's larger ones (widened in tiles gathered from the chunks) and
    fp32's (oneDNN's packed copy) all equal torch on the weight as held; fp32 activations
    (bf16's rounded ones: test_cpu_weight_formats)."""
    if weight_format == "fp32" and not uses_onednn(torch.ones(2, 2)):
        pytest.skip("without oneDNN an fp32 linear keeps no copy for the small batches")
    monkeypatch.setenv(SMALL_BATCH_ROWS_ENV, str(SMALL_BATCH_MAX_ROWS))
    monkeypatch.setenv(BF16_DOTS_ENV, "0")
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(70, 3000, generator=generator) / 3000**0.5
    bias = torch.randn(70, generator=generator)
    linear = Linear(weight.clone(), bias.clone(), weight_format)  # type: ignore[arg-type]
    assert linear.dense is not None and linear.dense.dim() == 3
    held = dequantize(cpu_kernels.weight_rows(linear.dense, 0, 70, 3000), linear.scales)
    for rows in (1, 4, 5, 9, 70):
        x = torch.randn(rows, 3000, generator=generator)
        torch.testing.assert_close(
            linear(x), functional.linear(x, held, bias), rtol=1e-4, atol=1e-4
        )
