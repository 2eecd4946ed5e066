"""A PEFT LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``), checked
against the model it is to run on and converted to ``weights.AdapterWeights``.

What runs: LoRA (``r``, ``lora_alpha``, ``use_rslora``) on the attention projections
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) and the gated MLP's (``gate_proj``,
``up_proj``, ``down_proj``) of any layer, rank up to the engine's ``--max-lora-rank``.
Per-module ranks and alphas (``rank_pattern``, ``alpha_pattern``) are PEFT's: a pattern
applies to the modules whose dotted name ends with it. Anything else is refused with an error
that names it (``AdapterError``): DoRA, biases, ``modules_to_save``, embedding or ``lm_head``
adapters, other modules (a mixture of experts' experts), a pickled ``adapter_model.bin``, and
weights whose shapes do not fit this model (an adapter made for another base model).

Our q/k/v projections are one fused matrix with the query and key rows in RoPE pair order
(``layers.rotary``): B's rows for ``q_proj`` and ``k_proj`` are permuted the same way here,
or the delta would land on the wrong dimensions (silently wrong output, not an error).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from dpserve.engine.layers.rotary import pair_rotary_dims
from dpserve.engine.lora.serving import AdapterError
from dpserve.engine.lora.weights import AdapterWeights, ModuleDelta

CONFIG_FILE: Final = "adapter_config.json"
WEIGHTS_FILE: Final = "adapter_model.safetensors"
ATTENTION_MODULES: Final = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES: Final = ("gate_proj", "up_proj", "down_proj")
# Projections our layers compute as one output (``weights.AdapterWeights`` holds them fused):
# q/k/v always (one ``Linear``), gate/up whose deltas are added to the two halves of one.
FUSED_MODULES: Final = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_KEY: Final = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight"
)
# Config entries that change what LoRA computes: refused unless at their no-op value.
_UNSUPPORTED_SETTINGS: Final = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out weights (Conv1D models)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "layer_replication": "layer_replication",
    "target_parameters": "adapters on parameters (target_parameters, e.g. MoE experts)",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
}


@dataclass(frozen=True, slots=True)
class ModuleShape:
    """An adaptable projection of one layer, as PEFT sees it (transformers' module)."""

    in_features: int
    out_features: int
    # Query and key projections: their heads, whose dimensions B's rows are reordered over
    # (RoPE pair order); None for the others.
    rope_heads: int | None = None
    head_dim: int = 0


# Per layer: the modules an adapter may target there (a MoE layer has no MLP entries).
AdapterLayout = list[dict[str, ModuleShape]]


def read_adapter(
    name: str,
    path: str,
    layout: AdapterLayout,
    *,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> AdapterWeights:
    """Load and check the PEFT LoRA directory ``path`` for a model of ``layout``."""
    directory = Path(path)
    config = _read_config(name, directory)
    rank: Any = config.get("r")
    alpha: Any = config.get("lora_alpha", rank)
    _check_rank(name, "r", rank, max_rank)
    _check_alpha(name, "lora_alpha", alpha)
    rank_pattern, alpha_pattern = (
        _pattern(name, config, "rank_pattern"),
        _pattern(name, config, "alpha_pattern"),
    )
    for key, value in rank_pattern.items():
        _check_rank(name, f"rank_pattern[{key!r}]", value, max_rank)
    for key, value in alpha_pattern.items():
        _check_alpha(name, f"alpha_pattern[{key!r}]", value)
    rslora = bool(config.get("use_rslora"))
    tensors = _read_weights(name, directory)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise AdapterError(
                f"adapter {name!r} has weights this engine does not run: {key} (only LoRA "
                f"A/B of {', '.join(ATTENTION_MODULES + MLP_MODULES)} are supported; not "
                "embeddings, lm_head, biases or other modules)"
            )
        layer, _, module, which = match.groups()
        pairs.setdefault((int(layer), module), {})[which] = tensor
    if not pairs:
        raise AdapterError(f"adapter {name!r} has no LoRA weights in {directory / WEIGHTS_FILE}")
    weights = AdapterWeights(name, str(directory), rank, [{} for _ in layout])
    for (layer, module), found in sorted(pairs.items()):
        part = "self_attn" if module in ATTENTION_MODULES else "mlp"
        dotted = f"model.layers.{layer}.{part}.{module}"
        own_rank = _pattern_value(rank_pattern, dotted, rank)
        own_alpha = _pattern_value(alpha_pattern, dotted, alpha)
        scale = own_alpha / math.sqrt(own_rank) if rslora else own_alpha / own_rank
        weights.rank = max(weights.rank, own_rank)
        index = _layer_index(name, layer, layout)
        weights.layers[index][module] = _module_delta(
            name, layer, module, found, layout, own_rank, scale, dtype, device
        )
    for index, modules in enumerate(weights.layers):
        for fused, parts in FUSED_MODULES.items():
            _fuse(modules, fused, parts, layout[index])
    return weights


def _fuse(
    modules: dict[str, ModuleDelta],
    fused: str,
    parts: tuple[str, ...],
    shapes: dict[str, ModuleShape],
) -> None:
    """Replace the deltas of ``parts`` (projections of the same input whose outputs our
    layers concatenate) by one: A stacked, B block-diagonal over the concatenated output (a
    part the adapter leaves alone is a zero block). One shrink and one expand instead of one
    each per part: a step's delta is a few small matmuls per layer, and their count is its
    cost."""
    present = [part for part in parts if part in modules]
    if not present or any(part not in shapes for part in parts):
        return
    a = torch.cat([modules[part].a for part in present])
    widths = [shapes[part].out_features for part in parts]
    b = a.new_zeros(sum(widths), a.shape[0])
    row = column = 0
    for part, width in zip(parts, widths, strict=True):
        delta = modules.pop(part, None)
        if delta is not None:
            rank = delta.a.shape[0]
            b[row : row + width, column : column + rank] = delta.b
            column += rank
        row += width
    modules[fused] = ModuleDelta(a, b)


def _check_rank(name: str, what: str, rank: object, max_rank: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"adapter {name!r}: {what} must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(
            f"adapter {name!r} has rank {rank} ({what}), more than this engine's "
            f"--max-lora-rank {max_rank} (start the engine with a larger --max-lora-rank)"
        )


def _check_alpha(name: str, what: str, alpha: object) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise AdapterError(f"adapter {name!r}: {what} must be a number, got {alpha!r}")


def _pattern(name: str, config: dict[str, Any], key: str) -> dict[str, Any]:
    pattern = config.get(key) or {}
    if not isinstance(pattern, dict):
        raise AdapterError(f"adapter {name!r}: {key} must be a JSON object")
    return pattern


def _pattern_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rule: the first pattern that the module's dotted name ends with (as a regex
    over whole name parts) gives its value."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(name: str, directory: Path) -> dict[str, Any]:
    config_path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise AdapterError(f"adapter {name!r}: {directory} is not a directory")
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise AdapterError(
            f"adapter {name!r}: {config_path} not found (a PEFT LoRA directory holds "
            f"{CONFIG_FILE} and {WEIGHTS_FILE})"
        ) from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name!r}: cannot read {config_path}: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {config_path} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"adapter {name!r} is a {kind} adapter; only LORA is supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(
            f"adapter {name!r} trains biases (bias={config['bias']!r}); only bias='none' runs"
        )
    for key, what in _UNSUPPORTED_SETTINGS.items():
        if config.get(key):
            raise AdapterError(f"adapter {name!r} uses {what}, which this engine does not run")
    return config


def _read_weights(name: str, directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        pickled = (directory / "adapter_model.bin").is_file()
        hint = " (adapter_model.bin is pickled: save it with safe_serialization)"
        raise AdapterError(f"adapter {name!r}: {weights_path} not found{hint if pickled else ''}")
    try:
        return load_file(str(weights_path))
    except Exception as exc:  # safetensors raises its own types for a damaged file
        raise AdapterError(f"adapter {name!r}: cannot read {weights_path}: {exc}") from None


def _layer_index(name: str, layer: int, layout: AdapterLayout) -> int:
    if layer >= len(layout):
        raise AdapterError(
            f"adapter {name!r} adapts layer {layer}, but the model has {len(layout)} layers "
            "(an adapter of another base model)"
        )
    return layer


def _module_delta(
    name: str,
    layer: int,
    module: str,
    found: dict[str, torch.Tensor],
    layout: AdapterLayout,
    rank: int,
    scale: float,
    dtype: torch.dtype,
    device: torch.device,
) -> ModuleDelta:
    where = f"layers.{layer}.{module}"
    shape = layout[layer].get(module)
    if shape is None:
        raise AdapterError(
            f"adapter {name!r} adapts {where}, which this model's layer {layer} does not have "
            "as a plain projection (a mixture-of-experts block takes no MLP adapters here)"
        )
    if set(found) != {"A", "B"}:
        raise AdapterError(f"adapter {name!r}: {where} has lora_{''.join(found)} without its pair")
    a, b = found["A"], found["B"]
    expected_a, expected_b = (rank, shape.in_features), (shape.out_features, rank)
    if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
        raise AdapterError(
            f"adapter {name!r}: {where} has lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}, this model needs {expected_a} and {expected_b} (rank {rank}): "
            "an adapter of another base model?"
        )
    b = b.float() * scale
    if shape.rope_heads is not None:  # the fused qkv's query and key rows are in pair order
        b, _ = pair_rotary_dims(b, None, shape.rope_heads, shape.head_dim)
    return ModuleDelta(
        a.to(device=device, dtype=dtype).contiguous(), b.to(device=device, dtype=dtype).contiguous()
    )
