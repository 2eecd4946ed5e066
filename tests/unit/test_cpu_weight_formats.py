"""Lower-precision CPU weights (``--cpu-weights``, issue 33): the quantization functions
(``layers.weight_format``), the decode kernel's bf16 and int8 formats on each instruction path
against torch on the dequantized weight, ``Linear``'s large-step library path, an engine that
generates with each format, and the refusals where a format cannot be honoured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional

from dpserve import cpu_settings
from dpserve.engine.kernels import cpu_kernels
from dpserve.engine.layers import weight_format
from dpserve.engine.layers.linear import Linear
from dpserve.engine.layers.weight_format import (
    WeightFormatRefused,
    dequantize,
    quantize_int8_per_channel,
    refusal,
    to_bf16,
)

needs_kernels = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason="the CPU kernels did not build here (no C++ compiler, or DPSERVE_CPU_KERNELS=0)",
)

X86_PATHS = [
    pytest.param(cpu_kernels.ISA_AVX2, id="avx2"),
    pytest.param(cpu_kernels.ISA_AVX512, id="avx512"),
    pytest.param(cpu_kernels.ISA_PORTABLE, id="portable"),
]
LOW_FORMATS = ["bf16", "int8"]


def _skip_unless_the_cpu_runs(isa: int) -> None:
    if not cpu_kernels.decode_matmul_supports(isa):
        flag = {cpu_kernels.ISA_AVX2: "AVX2 and FMA", cpu_kernels.ISA_AVX512: "AVX-512F"}
        pytest.skip(f"this CPU lacks {flag.get(isa, 'it')}: the path cannot run here")


def _stored(weight: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight as the format holds it, and int8's scales."""
    if name == "bf16":
        return to_bf16(weight), None
    return quantize_int8_per_channel(weight)


def _epilogues(
    biased: torch.Tensor, other: torch.Tensor
) -> dict[int, tuple[torch.Tensor | None, torch.Tensor]]:
    """Each of the decode kernel's epilogues: the other operand it takes, and what it should
    give after a product of ``biased``."""
    return {
        cpu_kernels.EPILOGUE_NONE: (None, biased),
        cpu_kernels.EPILOGUE_SILU: (None, functional.silu(biased)),
        cpu_kernels.EPILOGUE_MUL: (other, biased * other),
        cpu_kernels.EPILOGUE_ADD: (other, biased + other),
    }


# ------------------------------------------------------------------------ quantization


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (7, 13), (64, 577)])
def test_int8_round_trip_is_within_half_a_scale(rows: int, cols: int) -> None:
    generator = torch.Generator().manual_seed(rows + cols)
    # Rows of very different magnitudes: each row's scale is its own.
    weight = torch.randn(rows, cols, generator=generator) * torch.logspace(-3, 2, rows)[:, None]
    q, scales = quantize_int8_per_channel(weight)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32
    assert q.shape == (rows, cols) and scales.shape == (rows,)
    assert int(q.abs().max()) <= weight_format.INT8_MAX
    error = (dequantize(q, scales) - weight).abs()
    # Rounding to nearest: at most half a step, plus fp32's own rounding of the division.
    assert bool(torch.all(error <= scales[:, None] * (0.5 + 1e-5)))
    # Each row's largest magnitude is represented exactly as +-127 steps.
    assert bool(torch.all(q.abs().amax(dim=1) == weight_format.INT8_MAX))


def test_int8_keeps_a_row_of_zeros_zero() -> None:
    weight = torch.zeros(3, 8)
    weight[1] = torch.arange(8.0) - 4
    q, scales = quantize_int8_per_channel(weight)
    assert float(scales[0]) == 0.0 and float(scales[2]) == 0.0
    assert torch.equal(dequantize(q, scales)[0], torch.zeros(8))
    assert bool(torch.isfinite(dequantize(q, scales)).all())


def test_bf16_rounding_is_within_its_precision() -> None:
    weight = torch.randn(16, 100, generator=torch.Generator().manual_seed(3))
    rounded = to_bf16(weight)
    assert rounded.dtype == torch.bfloat16 and rounded.is_contiguous()
    # 8 significant bits (7 stored), rounded to nearest: half a step is 2**-8 relative.
    assert bool(torch.all((dequantize(rounded, None) - weight).abs() <= weight.abs() * 2**-8))


def test_quantizing_refuses_what_is_not_a_matrix() -> None:
    with pytest.raises(ValueError, match=r"\[n, k\]"):
        quantize_int8_per_channel(torch.ones(4))
    with pytest.raises(ValueError, match="scales"):
        dequantize(torch.ones(2, 2, dtype=torch.int8), None)


# ------------------------------------------------------------------- the decode kernel


@needs_kernels
@pytest.mark.parametrize("name", LOW_FORMATS)
@pytest.mark.parametrize("isa", X86_PATHS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 16])
@pytest.mark.parametrize(
    # N not a multiple of a thread's tile; K below one vector, not a multiple of 8, 16 or 32,
    # one vector plus a tail, SmolLM2's.
    ("out_features", "in_features"),
    [(37, 5), (19, 13), (67, 577), (16, 24), (130, 576)],
)
def test_decode_matmul_of_a_low_precision_weight_equals_torch_on_its_dequantized_weight(
    name: str, isa: int, rows: int, out_features: int, in_features: int
) -> None:
    _skip_unless_the_cpu_runs(isa)
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features + 3, generator=generator)[:, :in_features]
    stored, scales = _stored(torch.randn(out_features, in_features, generator=generator), name)
    reference = dequantize(stored, scales)
    bias = torch.randn(out_features, generator=generator)
    other = torch.randn(rows, out_features + 1, generator=generator)[:, :out_features]
    plain = x @ reference.T
    for with_bias in (None, bias):
        biased = plain if with_bias is None else plain + with_bias
        for epilogue, (with_other, wanted) in _epilogues(biased, other).items():
            out = cpu_kernels.decode_matmul(
                x, stored, with_bias, with_other, epilogue, isa, scales=scales
            )
            assert out.dtype == torch.float32 and out.shape == (rows, out_features)
            # fp32 sums in vector order, not torch's: ~1e-6 relative on sums of K products
            # (int8's products are ~127x larger before the scale: the same relative error).
            torch.testing.assert_close(out, wanted, rtol=1e-4, atol=1e-5 * in_features**0.5)


needs_bf16_dots = pytest.mark.skipif(
    not cpu_kernels.available() or not cpu_kernels.decode_matmul_supports_bf16_dots(),
    reason="this CPU lacks AVX-512-BF16 (or the CPU kernels did not build): the bf16 dot "
    "products cannot run here",
)


@needs_bf16_dots
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11, 16, 40])
@pytest.mark.parametrize(
    # K below one 32-pair step, one plus a tail, a 64-column step plus a 32 and a tail,
    # SmolLM2's (whole steps), a column-blocked weight's (three chunks of 688: 21 whole 32s and
    # a tail of 16 each).
    ("out_features", "in_features"),
    [(37, 5), (19, 45), (67, 113), (130, 576), (21, 2064)],
)
def test_bf16_dot_products_equal_torch_on_activations_rounded_to_bf16(
    rows: int, out_features: int, in_features: int
) -> None:
    """``bf16_dots``: the weight's and the activations' bf16 values multiplied exactly and
    summed in fp32, so within fp32 summation error of torch's float64 product of the same
    rounded values; every epilogue, with and without a bias, row-major and column-blocked."""
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features + 3, generator=generator)[:, :in_features]
    stored = to_bf16(torch.randn(out_features, in_features, generator=generator))
    weight = cpu_kernels.decode_weight_copy(stored)
    bias = torch.randn(out_features, generator=generator)
    other = torch.randn(rows, out_features + 1, generator=generator)[:, :out_features]
    plain = (x.bfloat16().double() @ stored.double().T).float()
    for with_bias in (None, bias):
        biased = plain if with_bias is None else plain + with_bias
        for epilogue, (with_other, wanted) in _epilogues(biased, other).items():
            out = cpu_kernels.decode_matmul(
                x, weight, with_bias, with_other, epilogue, cpu_kernels.ISA_AVX512, bf16_dots=True
            )
            assert out.dtype == torch.float32 and out.shape == (rows, out_features)
            torch.testing.assert_close(out, wanted, rtol=1e-5, atol=1e-6 * in_features**0.5)
    # Against the fp32 activations the rounding shows (so the activations really were rounded).
    exact = x.double() @ stored.double().T
    assert not torch.allclose(plain.double(), exact, rtol=1e-6, atol=1e-6)


@needs_bf16_dots
@pytest.mark.parametrize(("out_features", "in_features"), [(37, 5), (67, 113), (21, 2064)])
def test_a_bf16_dot_product_row_is_the_same_bits_in_any_batch(
    out_features: int, in_features: int
) -> None:
    """A row's outputs do not depend on the rows beside it: alone, in the first group of a call
    (the streamed pass) or a later one (the register-blocked pass over the cached tile), on one
    thread or two. Exact failover rests on it (``step_attention``)."""
    generator = torch.Generator().manual_seed(in_features)
    rows = torch.randn(13, in_features, generator=generator)
    weight = cpu_kernels.decode_weight_copy(
        to_bf16(torch.randn(out_features, in_features, generator=generator))
    )

    def product(x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.decode_matmul(x, weight, isa=cpu_kernels.ISA_AVX512, bf16_dots=True)

    alone = torch.cat([product(rows[index : index + 1]) for index in range(13)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for order in (list(range(13)), list(range(12, -1, -1)), list(range(5, 13))):
                assert torch.equal(product(rows[order]), alone[order]), (count, order)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_bf16_dot_products_are_refused_where_they_cannot_run() -> None:
    x = torch.ones(2, 64)
    with pytest.raises(RuntimeError, match="take a bfloat16 weight"):
        cpu_kernels.decode_matmul(x, torch.ones(4, 64), bf16_dots=True)
    if cpu_kernels.decode_matmul_supports(cpu_kernels.ISA_AVX2):
        with pytest.raises(RuntimeError, match="AVX-512 path on a CPU with AVX-512-BF16"):
            cpu_kernels.decode_matmul(
                x, to_bf16(torch.ones(4, 64)), isa=cpu_kernels.ISA_AVX2, bf16_dots=True
            )


@needs_kernels
def test_decode_matmul_refuses_formats_without_their_scales() -> None:
    x = torch.ones(2, 8)
    q, scales = quantize_int8_per_channel(torch.ones(4, 8))
    with pytest.raises(RuntimeError, match="needs float32 scales"):
        cpu_kernels.decode_matmul(x, q)
    with pytest.raises(RuntimeError, match="needs float32 scales"):
        cpu_kernels.decode_matmul(x, q, scales=scales[:3].contiguous())
    with pytest.raises(RuntimeError, match="int8 weight only"):
        cpu_kernels.decode_matmul(x, torch.ones(4, 8), scales=scales)
    with pytest.raises(RuntimeError, match="bfloat16 or int8 weight"):
        cpu_kernels.decode_matmul(x, torch.ones(4, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="float32 activations"):
        cpu_kernels.decode_matmul(x.bfloat16(), to_bf16(torch.ones(4, 8)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_a_huge_page_copy_holds_low_precision_weights(dtype: torch.dtype) -> None:
    weight = torch.randint(-100, 100, (1024, 2048)).to(dtype)
    copy = cpu_kernels.huge_page_copy(weight)
    assert copy.dtype == dtype and copy.is_contiguous() and torch.equal(copy, weight)


# ---------------------------------------------------------------------------- Linear


@pytest.mark.parametrize("name", LOW_FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40, 700])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("kernel_rows", [None, "8"], ids=["kernel-everywhere", "kernel-to-8"])
def test_a_low_precision_linear_equals_torch_on_its_dequantized_weight(
    name: str, rows: int, with_bias: bool, kernel_rows: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every variant, on the kernel where built (every row count, unless
    ``DPSERVE_CPU_SMALL_BATCH_ROWS`` bounds it) and on the library path past that bound or
    without the kernel (more output rows than a dequantization tile); only the low-precision
    copy is kept; fp32 activations (``BF16_DOTS_ENV=0``: the rounded ones are below)."""
    monkeypatch.setenv(cpu_settings.BF16_DOTS_ENV, "0")
    if kernel_rows is None:
        monkeypatch.delenv(cpu_settings.SMALL_BATCH_ROWS_ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_settings.SMALL_BATCH_ROWS_ENV, kernel_rows)
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(1100, 97, generator=generator)
    bias = torch.randn(1100, generator=generator) if with_bias else None
    linear = Linear(weight, bias, name)  # type: ignore[arg-type]
    on_kernel = cpu_kernels.available() and (kernel_rows is None or rows <= int(kernel_rows))
    assert linear._kernel(torch.empty(rows, 97)) == on_kernel
    stored, scales = _stored(weight, name)
    assert linear.dense is not None and linear.dense.dtype == stored.dtype
    assert torch.equal(linear.dense, stored)
    if scales is None:
        assert linear.scales is None
    else:
        assert linear.scales is not None and torch.equal(linear.scales, scales)
    assert linear.nbytes == weight.numel() * stored.element_size() + (0 if scales is None else 4400)
    x = torch.randn(rows, 97, generator=generator)
    other = torch.randn(rows, 1100, generator=generator)
    assert not linear.bf16_dots
    plain = x @ dequantize(stored, scales).T + (0 if bias is None else bias)
    torch.testing.assert_close(linear(x), plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(linear.silu(x), functional.silu(plain), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(linear.times(x, other), plain * other, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(linear.plus(x, other), plain + other, rtol=1e-4, atol=1e-4)


@needs_bf16_dots
@pytest.mark.parametrize("rows", [1, 9, 700])
def test_bf16_weights_round_their_activations_where_the_cpu_multiplies_bf16(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU with AVX-512-BF16, unset or ``DPSERVE_CPU_BF16_DOTS=1``: a bf16 linear rounds
    its activations to bf16 for every product (decode steps and prompt chunks: the same
    arithmetic), fp32 sums and outputs; an int8 or fp32 linear never does; "0": a bf16 linear
    keeps fp32 activations."""
    monkeypatch.delenv(cpu_settings.SMALL_BATCH_ROWS_ENV, raising=False)
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 576, generator=generator)
    x = torch.randn(rows, 576, generator=generator)
    rounded = (x.bfloat16().double() @ to_bf16(weight).double().T).float()
    monkeypatch.delenv(cpu_settings.BF16_DOTS_ENV, raising=False)
    assert Linear(weight, None, "bf16").bf16_dots
    monkeypatch.setenv(cpu_settings.BF16_DOTS_ENV, "1")
    linear = Linear(weight, None, "bf16")
    assert linear.bf16_dots and "rounded to bf16" in linear.arithmetic
    torch.testing.assert_close(linear(x), rounded, rtol=1e-5, atol=1e-5)
    assert not Linear(weight, None, "int8").bf16_dots
    assert not Linear(weight).bf16_dots
    monkeypatch.setenv(cpu_settings.BF16_DOTS_ENV, "0")
    widened = Linear(weight, None, "bf16")
    assert not widened.bf16_dots and "fp32 activations" in widened.arithmetic
    exact = (x.double() @ to_bf16(weight).double().T).float()
    torch.testing.assert_close(widened(x), exact, rtol=1e-5, atol=1e-5)
    # The two differ by the activations' rounding, well beyond fp32's summation error.
    assert (linear(x) - widened(x)).abs().max() > 1e-3
    # A model that says otherwise is obeyed (the rule's default is the model's call).
    assert Linear(weight, None, "bf16", rounds_activations=True).bf16_dots
    assert not Linear(weight, None, "int8", rounds_activations=True).bf16_dots


@needs_bf16_dots
def test_a_model_rounds_bf16_activations_by_default_only_where_its_step_is_batch_invariant(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dense model's bf16 projections round their activations and its attention runs row by
    row (``step_attention``); a mixture of experts (fp32 expert products, not batch-invariant)
    keeps fp32 activations unless ``DPSERVE_CPU_BF16_DOTS=1`` asks, and then is not called
    batch-invariant."""
    from dpserve.engine.model_runner import ModelRunner
    from tests.tiny_model import build_variant_model

    monkeypatch.delenv(cpu_settings.BF16_DOTS_ENV, raising=False)
    build_variant_model("qwen3-moe", tiny_model_path, tmp_path / "moe")

    def model(path: Path) -> Any:
        runner = ModelRunner(str(path), device="cpu", max_num_seqs=2, cpu_weights="bf16")
        return runner.backend.model

    runner = ModelRunner(str(tiny_model_path), device="cpu", max_num_seqs=2, cpu_weights="bf16")
    assert runner.backend.describe()["batch_invariant"] is True  # the engine's start-up facts
    dense = runner.backend.model
    assert dense.batch_invariant and dense.step_attention.batch_invariant
    assert all(linear.bf16_dots for linear in dense.projections())
    moe = model(tmp_path / "moe")
    assert not moe.batch_invariant and not moe.rounds_activations
    assert not any(linear.bf16_dots for linear in moe.projections())
    monkeypatch.setenv(cpu_settings.BF16_DOTS_ENV, "1")
    asked = model(tmp_path / "moe")
    assert asked.rounds_activations and not asked.batch_invariant
    assert all(linear.bf16_dots for linear in asked.projections())
    monkeypatch.setenv(cpu_settings.BF16_DOTS_ENV, "0")
    widened = model(tiny_model_path)
    assert not widened.batch_invariant and not widened.step_attention.batch_invariant


def test_a_low_precision_linear_takes_only_float32_cpu_weights() -> None:
    with pytest.raises(ValueError, match="float32 CPU weights"):
        Linear(torch.ones(4, 4, dtype=torch.bfloat16), None, "int8")


# ------------------------------------------------------------------------ the engine


def _generate(path: Path, cpu_weights: str) -> dict[int, tuple[list[int], list[float]]]:
    from dpserve.engine.model_runner import ModelRunner
    from tests.runner_runs import greedy_requests

    runner = ModelRunner(str(path), device="cpu", max_num_seqs=8, cpu_weights=cpu_weights)
    assert runner.backend.model.lm_head.weight_format == cpu_weights
    return greedy_requests(runner)


def _teacher_forced(path: Path, cpu_weights: str, prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt's tokens' log-probs after the first (``prompt_logprobs``): prefill steps."""
    from dpserve.engine.model_runner import ModelRunner
    from dpserve.engine.runner import RunnerRequest
    from dpserve.sampling import SamplingParams

    runner = ModelRunner(str(path), device="cpu", max_num_seqs=8, cpu_weights=cpu_weights)
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=1, prompt_logprobs=True)
    for request, prompt in enumerate(prompts):
        runner.add(RunnerRequest(request, prompt, params))
    found: dict[int, list[float]] = {}
    while runner.has_work():
        for update in runner.step():
            found.setdefault(update.request_id, []).extend(update.prompt_logprobs or [])
    return [found[request] for request in range(len(prompts))]


# Bounds on log-prob deviations from fp32 on the tiny model (nats), about twice what was
# measured: its random weights, 64 columns a row, make int8's rounding large (a row's step is
# its largest weight / 127, ~1% of a typical weight at 64 columns), and a random model's
# log-probs of unlikely tokens (~-6 nats) move most. Measured (every product on the decode
# kernel): teacher-forced mean 0.016 bf16, 0.020 bf16 with bf16 activations, 0.048 int8; greedy
# up to the first divergence at most 0.051 bf16, 0.043 bf16 with bf16 activations, 0.17 int8.
FORCED_MEAN_BOUND = {"bf16": 0.05, "int8": 0.2, "bf16-dots": 0.05}
GREEDY_BOUND = {"bf16": 0.1, "int8": 0.35, "bf16-dots": 0.1}


@pytest.mark.parametrize("name", [*LOW_FORMATS, "bf16-dots"])
def test_an_engine_with_low_precision_weights_generates_what_fp32_does_mostly(
    tiny_model_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy to completion, every request its full length, its first token fp32's; the log-probs
    agree with fp32's within ``GREEDY_BOUND`` up to and including the first token where the two
    runs differ. Whole sequences cannot be asked to agree: the tiny model's near-flat
    distributions have near ties that any rounding flips, after which the two continuations
    differ by construction; at the flip both picked a near-maximal token, so their log-probs
    still agree. Then teacher-forced (prefill steps, fp32's continuations as prompts): the mean
    deviation of every token's log-prob within ``FORCED_MEAN_BOUND``. "bf16-dots": bf16 with
    its activations rounded (``BF16_DOTS_ENV=1``), "bf16" with fp32 ones ("0")."""
    monkeypatch.setenv(cpu_settings.BF16_DOTS_ENV, "0")
    fp32 = _generate(tiny_model_path, "fp32")
    prompts = [[3 + request, 17, 40 + 2 * request, *fp32[request][0]] for request in range(6)]
    forced_fp32 = _teacher_forced(tiny_model_path, "fp32", prompts)
    if name == "bf16-dots":
        if not cpu_kernels.available() or not cpu_kernels.supports_bf16_dots():
            pytest.skip("this CPU lacks AVX-512-BF16 (or the CPU kernels did not build)")
        monkeypatch.setenv(cpu_settings.BF16_DOTS_ENV, "1")
    held = "bf16" if name == "bf16-dots" else name
    ours = _generate(tiny_model_path, held)
    assert ours.keys() == fp32.keys() == set(range(6))
    for request, (tokens, logprobs) in ours.items():
        wanted_tokens, wanted_logprobs = fp32[request]
        assert len(tokens) == len(logprobs) == 4 + 5 * request
        assert tokens[0] == wanted_tokens[0]
        differs = [
            i
            for i, pair in enumerate(zip(tokens, wanted_tokens, strict=True))
            if pair[0] != pair[1]
        ]
        checked = (differs[0] if differs else len(tokens) - 1) + 1
        deviation = max(
            abs(ours_lp - wanted_lp)
            for ours_lp, wanted_lp in zip(
                logprobs[:checked], wanted_logprobs[:checked], strict=True
            )
        )
        assert deviation < GREEDY_BOUND[name], (request, deviation)
    forced_ours = _teacher_forced(tiny_model_path, held, prompts)
    deviations = [
        abs(a - b)
        for ours_lps, fp32_lps in zip(forced_ours, forced_fp32, strict=True)
        for a, b in zip(ours_lps, fp32_lps, strict=True)
    ]
    assert len(deviations) == sum(len(prompt) - 1 for prompt in prompts)
    assert sum(deviations) / len(deviations) < FORCED_MEAN_BOUND[name]


# ------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("name", [*LOW_FORMATS, "bf16-dots"])
def test_a_resumed_stream_continues_exactly_on_low_precision_weights(
    tiny_model_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exact failover holds for the formats: a greedy stream resumed after any of its tokens
    (the new engine prefills them) continues with the uninterrupted run's tokens. With bf16
    activations ("bf16-dots") the step is batch-invariant (``step_attention``), so the resumed
    streams' log-probs are the uninterrupted run's to the bit, over a prompt long enough that
    attention splits a sequence into parts; "bf16" keeps fp32 activations."""
    from dpserve.engine.model_runner import ModelRunner
    from dpserve.engine.runner import RunnerRequest
    from dpserve.sampling import SamplingParams
    from tests.runner_runs import greedy_prompt

    monkeypatch.setenv(cpu_settings.BF16_DOTS_ENV, "0")
    bitwise = name == "bf16-dots"
    if bitwise:
        if not cpu_kernels.available() or not cpu_kernels.supports_bf16_dots():
            pytest.skip("this CPU lacks AVX-512-BF16 (or the CPU kernels did not build)")
        monkeypatch.setenv(cpu_settings.BF16_DOTS_ENV, "1")
    held = "bf16" if bitwise else name
    runner = ModelRunner(str(tiny_model_path), device="cpu", max_num_seqs=8, cpu_weights=held)
    runner.eos_token_ids = frozenset()
    # 170 prompt tokens: 11 blocks of 16 with the first token, 14 at the end (two parts).
    prompt = greedy_prompt(3) + ([(7 * i) % 50 + 3 for i in range(167)] if bitwise else [])

    def run(requests: list[RunnerRequest]) -> dict[int, tuple[list[int], list[float]]]:
        for each in requests:
            runner.add(each)
        streams: dict[int, tuple[list[int], list[float]]] = {
            each.request_id: ([], []) for each in requests
        }
        while runner.has_work():
            for update in runner.step():
                tokens, logprobs = streams[update.request_id]
                tokens.extend(update.tokens)
                logprobs.extend(update.logprobs or [])
        return streams

    params = SamplingParams(temperature=0.0, num_tokens_to_generate=40, return_log_probs=True)
    whole, whole_logprobs = run([RunnerRequest(0, prompt, params)])[0]
    assert len(whole) == len(whole_logprobs) == 40
    points = range(1, 40, 3)
    resumed = run(
        [RunnerRequest(1 + at, prompt, params, resume_tokens=whole[:at]) for at in points]
    )
    for at in points:
        tokens, logprobs = resumed[1 + at]
        assert tokens == whole[at:], at
        if bitwise:
            assert logprobs == whole_logprobs[at:], at


def test_the_formats_are_refused_where_they_cannot_be_honoured() -> None:
    assert refusal("fp32", device_type="cpu", dtype=torch.float32) is None
    assert refusal("fp32", device_type="cuda", dtype=torch.bfloat16, backend="vllm") is None
    assert (
        refusal("int8", device_type="cpu", dtype=torch.float32) is None
        and refusal("bf16", device_type="cpu", dtype=torch.float32) is None
    )
    assert "one of fp32, bf16, int8" in (
        refusal("fp8", device_type="cpu", dtype=torch.float32) or ""
    )
    assert "--backend vllm" in (
        refusal("int8", device_type="cpu", dtype=torch.float32, backend="vllm") or ""
    )
    assert "CPU engines" in (refusal("bf16", device_type="cuda", dtype=torch.float32) or "")
    assert "float32" in (refusal("int8", device_type="cpu", dtype=torch.bfloat16) or "")
    with pytest.raises(WeightFormatRefused, match="CPU engines"):
        weight_format.checked("int8", device_type="cuda", dtype=torch.float32)
    assert weight_format.checked("int8", device_type="cpu", dtype=torch.float32) == "int8"


def test_the_transformers_fallback_refuses_a_low_precision_format(tiny_model_path: Path) -> None:
    from dpserve.engine.model_runner import ModelRunner

    with pytest.raises(WeightFormatRefused, match="transformers fallback"):
        ModelRunner(str(tiny_model_path), backend="transformers", cpu_weights="int8")


def test_an_engine_refuses_a_low_precision_format_on_another_dtype(tiny_model_path: Path) -> None:
    from dpserve.engine.model_runner import ModelRunner

    with pytest.raises(WeightFormatRefused, match="float32"):
        ModelRunner(str(tiny_model_path), device="cpu", dtype="bfloat16", cpu_weights="bf16")


# ----------------------------------------------------------------------------- the CLI

ENGINE = ["engine", "--model", "/no/such/model", "--coordinator", "tcp://127.0.0.1:1"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--backend", "vllm"], "needs dpserve's own engine, not --backend vllm"),
        (["--device", "cuda"], "is for CPU engines (this one runs on cuda"),
        (["--device", "cpu", "--dtype", "bfloat16"], "converts float32 weights"),
    ],
    ids=["vllm", "cuda", "bf16-model"],
)
def test_an_engine_refuses_a_format_it_cannot_honour_before_loading(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    """One line and exit status 2, before any model is read (the path does not exist)."""
    from dpserve.cli import main

    assert main([*ENGINE, "--cpu-weights", "int8", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpserve engine: --cpu-weights int8 ") and message in err
    assert "\n" not in err


def test_an_engine_refuses_a_format_without_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    from dpserve.cli import main

    assert main(["engine", "--fake", "--coordinator", "1", "--cpu-weights", "bf16"]) == 2
    assert "--cpu-weights needs a model (not --fake)" in capsys.readouterr().err


def test_serve_refuses_a_format_with_vllm_and_passes_it_to_its_engines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dpserve.cli import build_parser, main
    from tests.unit.test_local_deployment import Supervised

    assert main(["serve", "--backend", "vllm", "--cpu-weights", "int8"]) == 2
    assert "dpserve serve: --cpu-weights int8 needs dpserve's own engine" in capsys.readouterr().err
    assert weight_format.flag_args(build_parser().parse_args(["serve"])) == ()
    passed = weight_format.flag_args(build_parser().parse_args(["serve", "--cpu-weights", "int8"]))
    assert passed == ("--cpu-weights", "int8")
    for backend in ("dpserve", "vllm"):
        run = Supervised()
        run.deployment.fake = False
        run.deployment.backend = backend
        run.deployment.cpu_weights_args = passed
        run.deployment.children.clear()
        run.deployment.start_processes()
        engine = next(c for c in run.deployment.children if c.name == "engine 0")
        args = build_parser().parse_args(engine.args[engine.args.index("engine") :])
        # vLLM's engines are never given it (serve refuses the pair before starting any).
        assert args.cpu_weights == ("int8" if backend == "dpserve" else "fp32")


@needs_kernels
def test_the_avx2_and_portable_paths_hold_no_avx512_instruction() -> None:
    """What an AVX2-only CPU runs: no zmm register, mask register or EVEX broadcast in any of
    their functions, for any format, whichever CPU built the library."""
    import re
    import shutil
    import subprocess

    objdump = shutil.which("objdump")
    if objdump is None or cpu_kernels._compiler() is None:
        pytest.skip("needs objdump and this machine's own build of the kernels")
    listing = subprocess.run(
        [objdump, "-d", "-C", "--no-show-raw-insn", str(cpu_kernels.build())],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    function = ""
    seen: set[str] = set()
    for line in listing.splitlines():
        if line.endswith(">:"):
            function = line
            continue
        name = re.search(r"dots_(?:avx2|portable)<[^>]*>", function)
        if name is not None:
            seen.add(name.group(0))
            assert not any(mark in line for mark in ("zmm", "%k", "{1to")), (function, line)
    # Every format's instantiations are there (float, bf16's raw bits, int8).
    for kind in ("float", "unsigned short", "signed char"):
        assert any(name.endswith(f"<{kind}, 1>") for name in seen), (kind, sorted(seen))
