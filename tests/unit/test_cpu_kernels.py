"""The C++ CPU kernels (``dpserve.engine.kernels.cpu_kernels``) against the torch code they replace:
RMSNorm, RoPE with the KV write, decode attention over the paged pool (NaN wherever a
sequence owns nothing, so a read past a length or a padding entry fails the comparison), a
whole model's logits with and without them, the refusal of out-of-range inputs, and how the
build cache is keyed and switched off."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch.nn import functional

from dpserve import cpu_settings
from dpserve.engine.kernels import cpu_kernels
from dpserve.engine.layers.attention import paged_decode_attention_reference
from dpserve.engine.layers.rotary import rotate_in_place
from dpserve.engine.layers.weight_format import quantize_int8_per_channel, to_bf16
from tests.paged_cases import make_paged_case, random_lengths

needs_kernels = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason="the CPU kernels did not build here (no C++ compiler, or DPSERVE_CPU_KERNELS=0)",
)


@needs_kernels
@pytest.mark.parametrize(("rows", "cols"), [(1, 64), (4, 576), (33, 100)])
def test_rms_norm_equals_torch(rows: int, cols: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, cols + 7, generator=generator) * 3
    hidden = wide[:, :cols]  # rows with a stride wider than the row
    weight = torch.randn(cols, generator=generator)
    expected = functional.rms_norm(hidden, (cols,), weight, 1e-5)
    torch.testing.assert_close(cpu_kernels.rms_norm(hidden, weight, 1e-5), expected)


def _rope_case(
    generator: torch.Generator,
    tokens: int,
    positions_known: int,
    blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random rotations (complex), token positions, distinct pool slots and a KV pool."""
    angles = torch.rand(positions_known, 1, head_dim // 2, generator=generator) * 6.3
    rotation = torch.polar(torch.ones_like(angles), angles)
    positions = torch.randint(0, positions_known, (tokens,), generator=generator)
    slots = torch.randperm(blocks * block_size, generator=generator)[:tokens]
    pool = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=generator)
    return rotation, positions, slots, pool


def _torch_rotate_and_write(
    qkv: torch.Tensor,
    pool: torch.Tensor,
    rotation: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> None:
    """What the kernel does, in torch: rotate the query and key heads in place, then write each
    token's key and value to its slot of ``pool``."""
    tokens = qkv.shape[0]
    rotate_in_place(
        qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, -1, 2),
        rotation.index_select(0, positions),
    )
    written = qkv[:, heads * head_dim :].view(tokens, 2, kv_heads, head_dim)
    pool.view(2, -1, kv_heads, head_dim)[:, slots] = written.transpose(0, 1)


@needs_kernels
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_rotate_and_write_kv_equals_torch(heads: int, kv_heads: int, head_dim: int) -> None:
    generator = torch.Generator().manual_seed(head_dim)
    tokens, positions_known, block_size, blocks = 11, 300, 16, 8
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
    rotation, positions, slots, pool = _rope_case(
        generator, tokens, positions_known, blocks, block_size, kv_heads, head_dim
    )

    expected_qkv, expected_pool = qkv.clone(), pool.clone()
    _torch_rotate_and_write(
        expected_qkv, expected_pool, rotation, positions, slots, heads, kv_heads, head_dim
    )

    pairs = torch.view_as_real(rotation).view(positions_known, -1, 2)
    cpu_kernels.rotate_and_write_kv(qkv, pairs, positions, slots, pool, heads, kv_heads)
    torch.testing.assert_close(qkv, expected_qkv)
    torch.testing.assert_close(pool, expected_pool)


@needs_kernels
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 1, 48)])
def test_rotate_and_write_kv_with_the_head_norm_equals_the_norm_then_torch(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    """Qwen3's q/k RMSNorm fused into the kernel: the same queries and pool as ``head_norm_``
    on the query and key heads, then the torch rotation and write."""
    from dpserve.engine.layers.norm import head_norm_

    generator = torch.Generator().manual_seed(head_dim + 1)
    tokens, positions_known, block_size, blocks = 7, 64, 8, 4
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=generator) * 3
    query_norm = torch.rand(head_dim, generator=generator) + 0.5
    key_norm = torch.rand(head_dim, generator=generator) + 0.5
    rotation, positions, slots, pool = _rope_case(
        generator, tokens, positions_known, blocks, block_size, kv_heads, head_dim
    )

    expected_qkv, expected_pool = qkv.clone(), pool.clone()
    head_norm_(expected_qkv[:, :q_size].view(tokens, heads, head_dim), query_norm, 1e-6)
    head_norm_(
        expected_qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim), key_norm, 1e-6
    )
    _torch_rotate_and_write(
        expected_qkv, expected_pool, rotation, positions, slots, heads, kv_heads, head_dim
    )

    pairs = torch.view_as_real(rotation).view(positions_known, -1, 2)
    cpu_kernels.rotate_and_write_kv(
        qkv, pairs, positions, slots, pool, heads, kv_heads, (query_norm, key_norm, 1e-6)
    )
    torch.testing.assert_close(qkv, expected_qkv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, expected_pool, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 8, 128, 16), (4, 2, 16, 4), (6, 2, 48, 8)],
)
# 12 sequences: a thread takes whole sequences; 1 on two threads: too short to split (below).
@pytest.mark.parametrize("sequences", [12, 1])
def test_decode_attention_equals_the_reference(
    heads: int, kv_heads: int, head_dim: int, block_size: int, sequences: int
) -> None:
    lengths = random_lengths(sequences, block_size, longest=300, seed=heads)
    case = make_paged_case(
        lengths, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size
    )
    expected = paged_decode_attention_reference(*case.args())
    # The engine passes the query as a view of the qkv projection: rows wider than the heads.
    qkv = torch.randn(len(lengths), (heads + 2 * kv_heads) * head_dim)
    query = qkv[:, : heads * head_dim].view(len(lengths), heads, head_dim)
    query.copy_(case.query)
    pool = torch.stack((case.k_cache, case.v_cache))
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        out = cpu_kernels.decode_attention(
            query, pool, case.block_tables, case.seq_lens, case.scale
        ).view(expected.shape)
    finally:
        torch.set_num_threads(threads)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("lengths", [[64], [65], [300], [1000], [70, 1000]])
def test_decode_attention_split_over_threads_equals_the_reference(
    lengths: list[int], threads: int
) -> None:
    """Fewer sequences than threads: each sequence's tokens are split into parts of whole
    blocks (4 blocks at least), each part's softmax merged into the sequence's; a sequence too
    short to split (64 tokens: 4 blocks) runs whole beside one that is split."""
    case = make_paged_case(lengths, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    expected = paged_decode_attention_reference(*case.args())
    pool = torch.stack((case.k_cache, case.v_cache))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_kernels.decode_attention(
            case.query, pool, case.block_tables, case.seq_lens, case.scale
        ).view(expected.shape)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_batch_invariant_decode_attention_gives_a_row_the_same_bits_in_any_batch() -> None:
    """``batch_invariant``: a row's output is the same bits alone or beside others, on one
    thread or three, for lengths whose parts differ (1, 2, 4, 8 and 16 parts); and
    still the reference's within fp32 error."""
    lengths = [5, 64, 130, 300, 1000, 1100]
    case = make_paged_case(lengths, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    expected = paged_decode_attention_reference(*case.args())
    pool = torch.stack((case.k_cache, case.v_cache))

    def attend(rows: list[int]) -> torch.Tensor:
        return cpu_kernels.decode_attention(
            case.query[rows],
            pool,
            case.block_tables[rows],
            case.seq_lens[rows],
            case.scale,
            batch_invariant=True,
        )

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([attend([row]) for row in range(len(lengths))])
        for threads in (1, 3):
            torch.set_num_threads(threads)
            for rows in ([0, 1, 2, 3, 4, 5], [5, 3, 1], [4, 4, 2, 0, 3]):
                assert torch.equal(attend(rows), alone[rows]), (threads, rows)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(alone.view(expected.shape), expected, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_decode_attention_refuses_what_would_read_outside_the_pool() -> None:
    case = make_paged_case([5, 20], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    pool = torch.stack((case.k_cache, case.v_cache))
    too_far = case.block_tables.clone()
    too_far[1, 0] = pool.shape[1]
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_kernels.decode_attention(case.query, pool, too_far, case.seq_lens, case.scale)
    longer = torch.tensor([5, 10_000], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="sequence length out of range"):
        cpu_kernels.decode_attention(case.query, pool, case.block_tables, longer, case.scale)
    with pytest.raises(RuntimeError):
        cpu_kernels.decode_attention(
            case.query.double(), pool, case.block_tables, case.seq_lens, case.scale
        )


@needs_kernels
def test_a_model_gives_the_same_logits_with_and_without_the_kernels(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two steps of the whole model (a prefill of two prompts, then one decode step each) on
    each path, the second with the first's cache contents: logits equal to ~1e-5 of their
    largest magnitude."""
    from transformers import AutoModelForCausalLM

    from dpserve.engine.layers.kv_cache import PagedKVCache
    from dpserve.engine.models.base import ForwardBatch, PrefillSlice
    from dpserve.engine.models.llama import PagedLlama

    def load(kernels: bool) -> PagedLlama:
        with monkeypatch.context() as patch:
            patch.setattr(cpu_kernels, "usable", lambda tensor: kernels)
            model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
            return PagedLlama(model)

    def steps(llama: PagedLlama) -> list[torch.Tensor]:
        cache = PagedKVCache(
            llama.kv_cache_shape(block_size=4), num_blocks=16, device=torch.device("cpu")
        )
        prompts = [[5, 9, 30, 7, 100, 3], [42, 8, 17]]
        tables = torch.tensor([[1, 2, 0], [3, 0, 0]], dtype=torch.int32)
        slots = [4, 5, 6, 7, 8, 9, 12, 13, 14]
        prefill = ForwardBatch(
            input_ids=torch.tensor(prompts[0] + prompts[1]),
            positions=torch.tensor([*range(6), *range(3)]),
            slot_mapping=torch.tensor(slots),
            num_decodes=0,
            block_tables=None,
            seq_lens=None,
            prefills=[PrefillSlice(0, 6, 0, None), PrefillSlice(6, 3, 0, None)],
            logits_indices=torch.tensor([5, 8]),
        )
        first = llama.forward(prefill, cache)
        decode = ForwardBatch(
            input_ids=first.argmax(dim=-1),
            positions=torch.tensor([6, 3]),
            slot_mapping=torch.tensor([10, 15]),
            num_decodes=2,
            block_tables=tables,
            seq_lens=torch.tensor([7, 4], dtype=torch.int32),
            prefills=[],
            logits_indices=None,
        )
        return [first, llama.forward(decode, cache)]

    with_kernels, without = load(True), load(False)
    assert (with_kernels.glue, without.glue) == ("cpu", "torch")
    for ours, theirs in zip(steps(with_kernels), steps(without), strict=True):
        # The kernels sum in another order (their vector width is the CPU's): measured on an
        # AVX-512 Xeon, 1.2e-5 apart on logits of up to 8.5, ~10 ulp. A wrong rotation, mask
        # or norm moves logits by whole units.
        scale = theirs.abs().max().item()
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * scale)


def test_the_build_key_follows_the_cpu_and_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    key = cpu_kernels.build_key("g++")
    monkeypatch.setattr(cpu_kernels, "_cpu_identity", lambda: "flags: sse2")
    assert cpu_kernels.build_key("g++") != key
    assert len({key, cpu_kernels.build_key("clang++")}) == 2


def test_no_compiler_means_no_kernels_and_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpu_kernels.build()


def test_the_environment_switches_the_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.DISABLE_VARIABLE, "0")
    assert cpu_kernels.available.__wrapped__() is False  # type: ignore[attr-defined]


def test_the_environment_names_the_engine_s_instruction_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``DPSERVE_CPU_ISA`` (``bench/serving_cpu.py --avx2-only``): the layers' decode path, and
    the glue built for x86-64-v3 (a build of its own), as on an AVX2-only CPU."""
    engine_isa = cpu_settings.isa_setting.__wrapped__
    assert engine_isa() == cpu_kernels.ISA_AUTO
    monkeypatch.setenv(cpu_settings.ISA_ENV, "avx2")
    assert engine_isa() == cpu_kernels.ISA_AVX2
    assert cpu_kernels.build_key("g++", (cpu_kernels.PORTABLE_ARCH,)) != cpu_kernels.build_key(
        "g++"
    )
    monkeypatch.setenv(cpu_settings.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="DPSERVE_CPU_ISA must be one of auto, portable"):
        engine_isa()


X86_64_V3 = frozenset(cpu_kernels.PORTABLE_CPU_FLAGS)


def test_a_prebuilt_library_is_refused_unless_it_fits(tmp_path: Path) -> None:
    library = tmp_path / "kernels.so"
    with pytest.raises(RuntimeError, match="no prebuilt library"):
        cpu_kernels.prebuilt(library, X86_64_V3)
    library.write_bytes(b"not checked here")
    with pytest.raises(RuntimeError, match="which torch"):
        cpu_kernels.prebuilt(library, X86_64_V3)
    (tmp_path / "kernels.so.torch-version").write_text("1.0.0\n")
    with pytest.raises(RuntimeError, match=r"built for torch 1\.0\.0"):
        cpu_kernels.prebuilt(library, X86_64_V3)
    (tmp_path / "kernels.so.torch-version").write_text(torch.__version__ + "\n")
    with pytest.raises(RuntimeError, match="x86-64-v3"):
        cpu_kernels.prebuilt(library, frozenset({"sse2", "avx"}))
    if cpu_kernels.platform.machine().lower() in ("x86_64", "amd64"):
        assert cpu_kernels.prebuilt(library, X86_64_V3) == library


_LOAD_WITHOUT_A_COMPILER = """
import torch
from dpserve.engine.kernels import cpu_kernels
assert cpu_kernels.available()
rows = torch.randn(3, 40)
weight = torch.randn(40)
out = cpu_kernels.rms_norm(rows, weight, 1e-6)
torch.testing.assert_close(out, torch.nn.functional.rms_norm(rows, (40,), weight, 1e-6))
print("loaded")
"""


@needs_kernels
def test_an_image_without_a_compiler_loads_the_portable_build(tmp_path: Path) -> None:
    """What the runtime image does: a library built with ``--portable`` on a machine with a
    compiler, loaded through ``$DPSERVE_CPU_KERNELS_PREBUILT`` where there is none."""
    import os
    import subprocess
    import sys

    if not cpu_kernels._cpu_flags() >= X86_64_V3:
        pytest.skip("this CPU cannot run an x86-64-v3 build")
    library = tmp_path / "prebuilt" / "dpserve_cpu_kernels.so"
    assert cpu_kernels.main(["--portable", str(library)]) == 0
    # The image runs as another user than the one who built it: anyone may read it.
    assert library.stat().st_mode & 0o777 == 0o755
    environment = {
        **os.environ,
        "CXX": str(tmp_path / "no-compiler"),
        "DPSERVE_CACHE": str(tmp_path / "cache"),
        cpu_kernels.PREBUILT_VARIABLE: str(library),
    }
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_A_COMPILER],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-3000:]
    assert not (tmp_path / "cache" / "cpu-kernels").exists()  # nothing was built there


@needs_kernels
def test_the_cached_portable_build_is_one_prebuilt_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``build(portable=True)``, what the tests' local Kubernetes node gives its pods as
    ``$DPSERVE_CPU_KERNELS_PREBUILT``: the x86-64-v3 build in the cache, the torch version
    beside it, built once."""
    if not cpu_kernels._cpu_flags() >= X86_64_V3:
        pytest.skip("this CPU cannot run an x86-64-v3 build")
    monkeypatch.setenv("DPSERVE_CACHE", str(tmp_path))
    library = cpu_kernels.build(portable=True)
    assert cpu_kernels.prebuilt(library) == library
    built = library.stat().st_mtime_ns
    # A cache from before the version file was written there gets it, the library kept.
    library.with_name(library.name + ".torch-version").unlink()
    assert cpu_kernels.build(portable=True) == library
    assert cpu_kernels.prebuilt(library) == library
    assert library.stat().st_mtime_ns == built


# ------------------------------------------------------------------------- the decode matmul

X86_PATHS = [
    pytest.param(cpu_kernels.ISA_AVX2, id="avx2"),
    pytest.param(cpu_kernels.ISA_AVX512, id="avx512"),
    pytest.param(cpu_kernels.ISA_PORTABLE, id="portable"),
]


def _skip_unless_the_cpu_runs(isa: int) -> None:
    if not cpu_kernels.decode_matmul_supports(isa):
        flag = {cpu_kernels.ISA_AVX2: "AVX2 and FMA", cpu_kernels.ISA_AVX512: "AVX-512F"}
        pytest.skip(f"this CPU lacks {flag.get(isa, 'it')}: the path cannot run here")


@needs_kernels
@pytest.mark.parametrize("isa", X86_PATHS)
# 5-16: groups after the first run AVX2's register-blocked pass (three weight rows at a time).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 16])
@pytest.mark.parametrize(
    # Output rows that are not a multiple of any path's block of rows or of a thread's tile;
    # K below one vector, not a multiple of 8 or 16, one vector plus a tail, SmolLM2's.
    ("out_features", "in_features"),
    [(37, 5), (19, 13), (67, 577), (16, 24), (130, 576)],
)
def test_decode_matmul_equals_torch(
    isa: int, rows: int, out_features: int, in_features: int
) -> None:
    _skip_unless_the_cpu_runs(isa)
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    # Rows wider than they are: the engine passes views of wider activations and residuals.
    x = torch.randn(rows, in_features + 3, generator=generator)[:, :in_features]
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    other = torch.randn(rows, out_features + 1, generator=generator)[:, :out_features]
    plain = x @ weight.T
    expected = {
        cpu_kernels.EPILOGUE_NONE: (None, None, plain),
        cpu_kernels.EPILOGUE_SILU: (bias, None, functional.silu(plain + bias)),
        cpu_kernels.EPILOGUE_MUL: (None, other, plain * other),
        cpu_kernels.EPILOGUE_ADD: (bias, other, plain + bias + other),
    }
    for epilogue, (with_bias, with_other, wanted) in expected.items():
        out = cpu_kernels.decode_matmul(x, weight, with_bias, with_other, epilogue, isa)
        assert out.shape == (rows, out_features)
        # Summed in vector-width order, not torch's: ~1e-6 relative on sums of K products.
        torch.testing.assert_close(out, wanted, rtol=1e-5, atol=1e-5 * in_features**0.5)


@needs_kernels
@pytest.mark.parametrize("isa", X86_PATHS)
@pytest.mark.parametrize("weight_format", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize(
    # Rows of 2,048 (2 chunks of 1,024), 2,049 (3 of 688, the last 1 column wide: a tail), and
    # 3,000 (3 of 1,008, the last 984); output rows beyond a thread's tile and an L2 tile.
    ("out_features", "in_features"),
    [(37, 2048), (19, 2049), (70, 3000)],
)
def test_a_column_blocked_weight_gives_what_the_row_major_one_gives(
    isa: int, weight_format: str, out_features: int, in_features: int
) -> None:
    """Wide rows are held column-blocked (``decode_weight_copy``): every chunk's partial sums
    added up, the scales, bias and epilogue applied once, for 1-9 activation rows."""
    _skip_unless_the_cpu_runs(isa)
    generator = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    scales = None
    if weight_format == "bf16":
        weight = to_bf16(weight)
    elif weight_format == "int8":
        weight, scales = quantize_int8_per_channel(weight)
    blocked = cpu_kernels.decode_weight_copy(weight)
    width = cpu_kernels.chunk_width(in_features)
    assert blocked.shape == (-(-in_features // width), out_features, width)
    torch.testing.assert_close(
        cpu_kernels.weight_rows(blocked, 3, 17, in_features), weight[3:17], rtol=0, atol=0
    )
    bias = torch.randn(out_features, generator=generator)
    for rows in (1, 2, 3, 4, 5, 9, 16):
        x = torch.randn(rows, in_features + 3, generator=generator)[:, :in_features]
        other = torch.randn(rows, out_features, generator=generator)
        for epilogue in (cpu_kernels.EPILOGUE_SILU, cpu_kernels.EPILOGUE_ADD):
            wanted = cpu_kernels.decode_matmul(x, weight, bias, other, epilogue, isa, scales)
            out = cpu_kernels.decode_matmul(x, blocked, bias, other, epilogue, isa, scales)
            torch.testing.assert_close(out, wanted, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_decode_matmul_silu_stays_finite_at_extremes() -> None:
    """SiLU of large negative and positive products: 0 and the product itself, no NaN from an
    exp that overflows."""
    weight = torch.tensor([[1.0], [1.0], [1.0], [1.0]])
    x = torch.tensor([[-200.0], [-1.0], [0.0], [300.0]])
    for row in range(4):
        out = cpu_kernels.decode_matmul(
            x[row : row + 1], weight, epilogue=cpu_kernels.EPILOGUE_SILU
        )
        torch.testing.assert_close(out, functional.silu(x[row : row + 1] @ weight.T))


@needs_kernels
def test_decode_matmul_of_no_rows_or_no_outputs_is_empty() -> None:
    assert cpu_kernels.decode_matmul(torch.ones(0, 8), torch.ones(4, 8)).shape == (0, 4)
    assert cpu_kernels.decode_matmul(torch.ones(2, 8), torch.ones(0, 8)).shape == (2, 0)


@needs_kernels
def test_decode_matmul_refuses_what_it_cannot_read() -> None:
    x, weight = torch.ones(2, 8), torch.ones(4, 8)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.decode_matmul(x.double(), weight.double())
    with pytest.raises(RuntimeError, match="columns"):
        cpu_kernels.decode_matmul(x, torch.ones(4, 9))
    with pytest.raises(RuntimeError, match="columns"):  # 3 chunks of 4 for 8 columns
        cpu_kernels.decode_matmul(x, torch.ones(3, 4, 4))
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        cpu_kernels.decode_matmul(x, torch.ones(8, 4).T)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        cpu_kernels.decode_matmul(torch.ones(8, 2).T, weight)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.decode_matmul(x, weight, torch.ones(3))
    with pytest.raises(RuntimeError, match="needs the other operand"):
        cpu_kernels.decode_matmul(x, weight, epilogue=cpu_kernels.EPILOGUE_ADD)
    with pytest.raises(RuntimeError, match="other must be"):
        cpu_kernels.decode_matmul(x, weight, None, torch.ones(2, 3), cpu_kernels.EPILOGUE_MUL)
    with pytest.raises(RuntimeError, match="unknown epilogue"):
        cpu_kernels.decode_matmul(x, weight, epilogue=9)
    with pytest.raises(RuntimeError, match="unknown instruction path"):
        cpu_kernels.decode_matmul(x, weight, isa=7)
    assert not cpu_kernels.decode_matmul_supports(7)


@needs_kernels
@pytest.mark.parametrize(("wide", "requests"), [(False, 6), (True, 6), (False, 16), (True, 16)])
def test_an_engine_decodes_the_same_tokens_and_logprobs_with_the_decode_kernel(
    tiny_model_path: Path,
    wide: bool,
    requests: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Greedy requests of different lengths, so that decode steps of 1 to ``requests``
    sequences run (beyond 4, groups of rows after the first take the register-blocked pass):
    the same tokens with the small batches on the decode kernel as with every step on oneDNN,
    and log-probs within 1e-4 of oneDNN's at 6 requests. At 16 (requests of up to 79 tokens)
    two fp32 runs drift further apart (up to 7e-4 on the wide model), so there the kernel's
    log-probs are held to a float64 forward of the same tokens: at least as close to it as
    oneDNN's (the kernel's dot products are the nearer to float64's, ~4e-8 relative against
    ~1.5e-7). ``wide``: a model whose MLP rows have 2,048 columns, which the kernel holds
    column-blocked."""
    from dpserve.cpu_settings import SMALL_BATCH_ROWS_ENV
    from dpserve.engine.layers.linear import uses_onednn
    from dpserve.engine.model_runner import ModelRunner
    from tests.runner_runs import greedy_requests
    from tests.tiny_model import build_tiny_model

    if not uses_onednn(torch.ones(2, 2)):
        pytest.skip("this torch build has no oneDNN linears: the small batches have no other path")
    if wide:
        tiny_model_path = build_tiny_model(tmp_path / "wide", hidden_size=1024)

    def generate(small_batch_rows: int) -> dict[int, tuple[list[int], list[float]]]:
        monkeypatch.setenv(SMALL_BATCH_ROWS_ENV, str(small_batch_rows))
        runner = ModelRunner(str(tiny_model_path), device="cpu", max_num_seqs=requests)
        assert runner.backend.model.lm_head.decode_kernel == bool(small_batch_rows)
        down = runner.backend.model.layers[0].mlp.down
        if small_batch_rows:  # the kernel's copy: column-blocked where rows are wide
            assert down.dense is not None and down.dense.dim() == (3 if wide else 2)
        return greedy_requests(runner, requests)

    ours, onednn = generate(cpu_settings.DECODE_MATMUL_MAX_ROWS), generate(0)
    assert ours.keys() == onednn.keys() == set(range(requests))
    for request, (tokens, logprobs) in ours.items():
        assert tokens == onednn[request][0] and len(tokens) == 4 + 5 * request
        if requests <= 6:
            torch.testing.assert_close(
                torch.tensor(logprobs), torch.tensor(onednn[request][1]), rtol=0, atol=1e-4
            )
    if requests > 6:
        exact = _float64_logprobs(tiny_model_path, ours)
        assert _farthest(ours, exact) <= max(_farthest(onednn, exact), 1e-4)


def _float64_logprobs(
    path: Path, runs: dict[int, tuple[list[int], list[float]]]
) -> dict[int, list[float]]:
    """Each ``greedy_requests`` run's tokens scored by transformers' forward in float64."""
    from transformers import AutoModelForCausalLM

    from tests.runner_runs import greedy_prompt

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    exact: dict[int, list[float]] = {}
    for request, (tokens, _) in runs.items():
        prompt = greedy_prompt(request)
        with torch.no_grad():
            scores = model(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
        steps = torch.arange(len(tokens)) + len(prompt) - 1
        exact[request] = scores[steps, torch.tensor(tokens)].tolist()
    return exact


def _farthest(
    runs: dict[int, tuple[list[int], list[float]]], exact: dict[int, list[float]]
) -> float:
    return max(
        abs(ours - wanted)
        for request, (_, logprobs) in runs.items()
        for ours, wanted in zip(logprobs, exact[request], strict=True)
    )


@pytest.mark.parametrize("shape", [(3, 5), (1024, 1536)])
def test_a_huge_page_copy_holds_the_weight_on_its_own(shape: tuple[int, int]) -> None:
    """The copy equals the weight, is contiguous, owns its memory (the original may go), and a
    weight of at least one huge page starts on a huge-page boundary."""
    weight = torch.randn(*shape)
    expected = weight.clone()
    copy = cpu_kernels.huge_page_copy(weight)
    del weight
    assert copy.is_contiguous() and copy.shape == shape and torch.equal(copy, expected)
    large = copy.numel() * 4 >= cpu_kernels.HUGE_PAGE_BYTES
    if large and hasattr(cpu_kernels.mmap, "MADV_HUGEPAGE"):
        assert copy.data_ptr() % cpu_kernels.HUGE_PAGE_BYTES == 0


@pytest.mark.skipif(
    not hasattr(cpu_kernels.mmap, "MADV_HUGEPAGE"), reason="no madvise(MADV_HUGEPAGE) here"
)
def test_weights_under_a_huge_page_lie_side_by_side_in_memory_advised_into_huge_pages() -> None:
    """Each alone would sit in 4 KB pages: they share regions, one after another from cache-line
    boundaries, and the kernel holds those regions under the huge-page advice (smaps' ``hg``)."""
    weights = [torch.randn(rows, 576) for rows in (300, 299, 1, 600)]
    copies = [cpu_kernels.huge_page_copy(weight) for weight in weights]
    for weight, copy in zip(weights, copies, strict=True):
        assert torch.equal(copy, weight) and copy.data_ptr() % 64 == 0
    for before, after in itertools.pairwise(copies):
        following = before.data_ptr() + -(-before.numel() * 4 // 64) * 64
        # the next weight follows, or opens the next region (on a huge page's boundary)
        assert after.data_ptr() == following or after.data_ptr() % cpu_kernels.HUGE_PAGE_BYTES == 0
    assert all(_advised_into_huge_pages(copy.data_ptr()) for copy in copies)
    # Copies that live briefly (the engine's probe) take regions of their own, not the ones a
    # model's weights hold: a region of the process's would keep their memory after them.
    regions = cpu_kernels.SharedRegions()
    brief = [cpu_kernels.huge_page_copy(weight, regions) for weight in weights[:2]]
    assert brief[0].data_ptr() % cpu_kernels.HUGE_PAGE_BYTES == 0
    assert brief[1].data_ptr() == brief[0].data_ptr() + -(-brief[0].numel() * 4 // 64) * 64
    after = cpu_kernels.huge_page_copy(weights[0])
    assert after.data_ptr() == copies[-1].data_ptr() + -(-copies[-1].numel() * 4 // 64) * 64 or (
        after.data_ptr() % cpu_kernels.HUGE_PAGE_BYTES == 0
    )


def _advised_into_huge_pages(address: int) -> bool:
    """Whether the mapping holding ``address`` has madvise(MADV_HUGEPAGE) (smaps' ``hg``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(end, 16) for end in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    return False
