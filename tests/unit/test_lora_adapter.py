"""Reading PEFT LoRA directories (``engine.lora.adapter``): what runs, and a clear error
naming the problem for everything that does not."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from dpserve.engine.layers.rotary import pair_rotary_dims
from dpserve.engine.lora.adapter import AdapterLayout, ModuleShape, read_adapter
from dpserve.engine.lora.serving import AdapterError
from tests.lora_adapters import make_adapter

HIDDEN, Q, KV, INNER, HEADS, KV_HEADS, HEAD_DIM = 64, 64, 32, 128, 4, 2, 16


def tiny_layout(layers: int = 2) -> AdapterLayout:
    """The tiny Llama's (tests.tiny_model) adaptable projections."""
    modules = {
        "q_proj": ModuleShape(HIDDEN, Q, HEADS, HEAD_DIM),
        "k_proj": ModuleShape(HIDDEN, KV, KV_HEADS, HEAD_DIM),
        "v_proj": ModuleShape(HIDDEN, KV),
        "o_proj": ModuleShape(Q, HIDDEN),
        "gate_proj": ModuleShape(HIDDEN, INNER),
        "up_proj": ModuleShape(HIDDEN, INNER),
        "down_proj": ModuleShape(INNER, HIDDEN),
    }
    return [dict(modules) for _ in range(layers)]


@pytest.fixture(scope="module")
def good(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_model_path, tmp_path_factory.mktemp("lora") / "good", seed=7)


def read(path: Path, layout: AdapterLayout | None = None, max_rank: int = 64) -> Any:
    return read_adapter(
        "x",
        str(path),
        layout or tiny_layout(),
        max_rank=max_rank,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def edited(
    good: Path,
    tmp_path: Path,
    config: dict[str, Any] | None = None,
    weights: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """A copy of ``good`` with ``config`` entries set and ``weights`` applied to its tensors."""
    copy = tmp_path / "edited"
    shutil.copytree(good, copy)
    if config:
        path = copy / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if weights is not None:
        tensors = load_file(copy / "adapter_model.safetensors")
        weights(tensors)
        save_file(tensors, copy / "adapter_model.safetensors")
    return copy


def test_a_peft_adapter_is_read_scaled_fused_and_in_rope_pair_order(good: Path) -> None:
    adapter = read(good)
    tensors = load_file(good / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.1.self_attn"
    scale = 16 / 8  # lora_alpha / r

    def a(module: str) -> torch.Tensor:
        return tensors[f"{prefix}.{module}.lora_A.weight"]

    def b(module: str) -> torch.Tensor:
        return tensors[f"{prefix}.{module}.lora_B.weight"] * scale

    qkv = adapter.layers[1]["qkv"]  # q/k/v as our one projection: A stacked, B block-diagonal
    assert torch.equal(qkv.a, torch.cat([a("q_proj"), a("k_proj"), a("v_proj")]))
    q_b, _ = pair_rotary_dims(b("q_proj"), None, HEADS, HEAD_DIM)
    k_b, _ = pair_rotary_dims(b("k_proj"), None, KV_HEADS, HEAD_DIM)
    expected = torch.zeros(Q + 2 * KV, 3 * 8)
    expected[:Q, :8], expected[Q : Q + KV, 8:16], expected[Q + KV :, 16:] = q_b, k_b, b("v_proj")
    assert torch.allclose(qkv.b, expected)  # queries and keys in RoPE pair order, values not
    assert not torch.allclose(q_b, b("q_proj"))  # the reorder is not a no-op here
    assert adapter.layers[1]["gate_up"].b.shape == (2 * INNER, 2 * 8)
    assert set(adapter.layers[0]) == {"qkv", "o_proj", "gate_up", "down_proj"}
    assert adapter.rank == 8


def test_a_part_an_adapter_leaves_alone_is_a_zero_block(good: Path, tmp_path: Path) -> None:
    def only_k(tensors: dict[str, torch.Tensor]) -> None:
        for key in [key for key in tensors if "q_proj" in key or "v_proj" in key]:
            del tensors[key]

    qkv = read(edited(good, tmp_path, weights=only_k)).layers[0]["qkv"]
    assert qkv.a.shape == (8, HIDDEN) and qkv.b.shape == (Q + 2 * KV, 8)
    assert not qkv.b[:Q].any() and not qkv.b[Q + KV :].any() and qkv.b[Q : Q + KV].any()


def test_rslora_and_per_module_alpha(good: Path, tmp_path: Path) -> None:
    path = edited(good, tmp_path, {"use_rslora": True, "alpha_pattern": {"down_proj": 4}})
    adapter = read(path)
    tensors = load_file(path / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0"
    o_b = tensors[f"{prefix}.self_attn.o_proj.lora_B.weight"]
    down_b = tensors[f"{prefix}.mlp.down_proj.lora_B.weight"]
    assert torch.allclose(adapter.layers[0]["o_proj"].b, o_b * 16 / 8**0.5)
    assert torch.allclose(adapter.layers[0]["down_proj"].b, down_b * 4 / 8**0.5)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "trains biases"),
        ({"lora_bias": True}, "lora_bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "is a IA3 adapter"),
        ({"r": 0}, "r must be a positive integer"),
        ({"lora_alpha": "big"}, "lora_alpha must be a number"),
        ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters"),
        ({"rank_pattern": {"q_proj": 100}}, r"rank 100 \(rank_pattern\['q_proj'\]\)"),
    ],
)
def test_unsupported_settings_are_refused(
    good: Path, tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    with pytest.raises(AdapterError, match=message):
        read(edited(good, tmp_path, config))


def test_a_rank_over_the_engine_limit_is_refused(good: Path) -> None:
    with pytest.raises(AdapterError, match=r"rank 8 .*--max-lora-rank 4"):
        read(good, max_rank=4)


@pytest.mark.parametrize(
    ("key", "shape", "message"),
    [
        ("base_model.model.lm_head.lora_A.weight", (8, 64), "lm_head"),
        ("base_model.model.model.embed_tokens.lora_embedding_A", (8, 384), "embed_tokens"),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", (64,), "biases"),
        ("base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight", (8, 64), "layer 5"),
    ],
)
def test_weights_of_other_modules_are_refused(
    good: Path, tmp_path: Path, key: str, shape: tuple[int, ...], message: str
) -> None:
    def add(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key] = torch.zeros(shape)
        if "layers.5" in key:
            tensors[key.replace("lora_A", "lora_B")] = torch.zeros(64, 8)

    with pytest.raises(AdapterError, match=message):
        read(edited(good, tmp_path, weights=add))


def test_an_adapter_of_another_base_model_is_refused(good: Path) -> None:
    wider = [{name: ModuleShape(s.in_features * 2, s.out_features) for name, s in layer.items()}
             for layer in tiny_layout()]  # fmt: skip
    with pytest.raises(AdapterError, match="another base model"):
        read(good, wider)
    with pytest.raises(AdapterError, match="layer 1, but the model has 1 layers"):
        read(good, tiny_layout(layers=1))


def test_a_lone_half_of_a_pair_is_refused(good: Path, tmp_path: Path) -> None:
    def drop(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]

    with pytest.raises(AdapterError, match=r"layers\.0\.q_proj has lora_A without its pair"):
        read(edited(good, tmp_path, weights=drop))


def test_missing_and_damaged_files(good: Path, tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="is not a directory"):
        read(tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AdapterError, match=r"adapter_config\.json not found"):
        read(empty)
    pickled = edited(good, tmp_path)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(AdapterError, match="pickled: save it with safe_serialization"):
        read(pickled)
    (pickled / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(AdapterError, match="cannot read"):
        read(pickled)
    (pickled / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(AdapterError, match="not a JSON object"):
        read(pickled)


def test_the_sorted_and_the_grouped_delta_agree(good: Path, tmp_path: Path) -> None:
    """Steps of several adapters run sorted on CPU (each adapter's rows by its own A and B;
    tests/unit/test_lora_sorted_rows.py checks each path), a step of one adapter on every row
    grouped: both add each row its own adapter's delta."""
    from dpserve.engine.lora.delta import StepAdapters, group_rows

    first = read(good)
    second = read(edited(good, tmp_path, {"lora_alpha": 3}))  # same A and B, other scale
    weights = {0: first, 2: second}
    row_slots = [2, -1, 0, 0, 2, -1]
    x = torch.randn(len(row_slots), HIDDEN)
    mixed = group_rows(row_slots, weights, torch.device("cpu"))
    assert mixed is not None and mixed.sorted_rows is not None
    out = torch.zeros(len(row_slots), Q + 2 * KV)
    mixed.add(1, "qkv", x, out)
    for row, slot in enumerate(row_slots):
        alone = torch.zeros(1, Q + 2 * KV)
        if slot >= 0:
            StepAdapters(((weights[slot], None),)).add(1, "qkv", x[row : row + 1], alone)
        assert torch.allclose(out[row : row + 1], alone, atol=1e-5), row
    assert group_rows([-1, -1], weights, torch.device("cpu")) is None
    only = group_rows([0, 0], weights, torch.device("cpu"))
    assert only is not None  # sorted with the C++ kernel, else grouped (nothing gathered)
    assert only.sorted_rows is not None or only.groups[0][1] is None
