"""Our own forward pass for Llama-family models (Llama, Mistral, Qwen2, SmolLM), in torch.

Why not transformers' forward: on a GPU it is kernel-launch bound and its caches are not paged
(issue 10). Here one forward covers a whole step — every sequence's tokens flattened into one
``[tokens, hidden]`` matrix, so the projections and the MLP are one matmul each — and attention
reads and writes the paged cache directly: new keys and values go in through the slot mapping
(``index_copy_`` into the flattened pool), decode rows use ``paged_decode_attention`` and each
prefill chunk ``prefill_attention``.

The weights are taken from the transformers model that ``dpserve.models`` loaded (any
directory, hub id or the GGUF default): q/k/v and gate/up are fused into one matrix each, and
the transformers layers are dropped one by one as they are converted, so memory never holds
two copies of the model. RoPE comes from the model's own rotary module, evaluated once for
every position, so each scaling variant (llama3, linear, yarn, ...) is exactly transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import torch
from torch.nn import functional

from dpserve.engine.kv_cache import KVCacheShape, PagedKVCache
from dpserve.engine.paged_attention import paged_decode_attention, prefill_attention

SUPPORTED_MODEL_TYPES: Final = frozenset({"llama", "mistral", "qwen2"})
# RoPE variants whose tables depend on the sequence length seen so far: not precomputable.
_LENGTH_DEPENDENT_ROPE: Final = frozenset({"dynamic", "longrope"})


def unsupported_reason(model: Any) -> str | None:
    """Why ``PagedLlama`` cannot run ``model`` (then the transformers backend serves it), or
    None."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (only silu is implemented)"
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if any(kind != "full_attention" for kind in layer_types) or (
        model_type == "mistral" and window and window < config.max_position_embeddings
    ):
        return "sliding-window attention is not implemented"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        return "no model.rotary_emb module"
    if getattr(rotary, "rope_type", "default") in _LENGTH_DEPENDENT_ROPE:
        return f"RoPE type {rotary.rope_type!r} depends on the sequence length"
    return None


@dataclass(slots=True)
class PrefillSlice:
    """One prefill chunk's rows in a ``ForwardBatch``."""

    offset: int  # first row of the chunk in the flattened tokens
    length: int
    cached: int  # tokens of the sequence already in the cache before the chunk
    blocks: torch.Tensor | None  # int64 block ids covering cached + length (None if cached 0)


@dataclass(slots=True)
class ForwardBatch:
    """The tensors of one step: decode rows first, then the prefill chunks' rows."""

    input_ids: torch.Tensor  # [tokens] int64
    positions: torch.Tensor  # [tokens] int64
    slot_mapping: torch.Tensor  # [tokens] int64: block * block_size + offset
    num_decodes: int
    block_tables: torch.Tensor | None  # [num_decodes, width] int32
    seq_lens: torch.Tensor | None  # [num_decodes] int32, the fed token included
    prefills: list[PrefillSlice]
    logits_indices: torch.Tensor | None  # rows to compute logits for; None: every row


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None


def _fused(*linears: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([linear.weight.detach() for linear in linears])
    biases = [linear.bias for linear in linears]
    if all(bias is None for bias in biases):
        return weight, None
    bias = torch.cat(
        [
            linear.bias.detach()
            if linear.bias is not None
            else weight.new_zeros(linear.out_features)
            for linear in linears
        ]
    )
    return weight, bias


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


def _convert_layer(layer: Any) -> _Layer:
    attention, mlp = layer.self_attn, layer.mlp
    qkv_weight, qkv_bias = _fused(attention.q_proj, attention.k_proj, attention.v_proj)
    gate_up_weight, gate_up_bias = _fused(mlp.gate_proj, mlp.up_proj)
    return _Layer(
        input_norm=layer.input_layernorm.weight.detach(),
        qkv_weight=qkv_weight,
        qkv_bias=qkv_bias,
        o_weight=attention.o_proj.weight.detach(),
        o_bias=_detached(attention.o_proj.bias),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up_weight=gate_up_weight,
        gate_up_bias=gate_up_bias,
        down_weight=mlp.down_proj.weight.detach(),
        down_bias=_detached(mlp.down_proj.bias),
    )


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, operation for operation (fp32 statistics)."""
    dtype = hidden.dtype
    hidden = hidden.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = states.shape[-1] // 2
    rotated = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
    return states * cos + rotated * sin


class PagedLlama:
    """The weights of a Llama-family model and its forward pass over a ``PagedKVCache``."""

    def __init__(self, model: Any) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"not a supported Llama-family model: {reason}")
        self.config = config = model.config
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        )
        self.scale = self.head_dim**-0.5
        self.eps = float(config.rms_norm_eps)
        self.context_size = int(config.max_position_embeddings)
        decoder = model.model
        self.embedding = decoder.embed_tokens.weight.detach()
        self.dtype, self.device = self.embedding.dtype, self.embedding.device
        self.norm = decoder.norm.weight.detach()
        self.lm_head = model.lm_head.weight.detach()  # the embedding itself when tied
        self.vocab_size = int(self.lm_head.shape[0])
        self.cos, self.sin = self._rope_tables(decoder.rotary_emb)
        self.layers: list[_Layer] = []
        for index in range(len(decoder.layers)):
            self.layers.append(_convert_layer(decoder.layers[index]))
            decoder.layers[index] = torch.nn.Identity()  # frees its (now copied) weights

    def _rope_tables(self, rotary: Any) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(self.context_size, device=self.device).unsqueeze(0)
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            cos, sin = rotary(probe, positions)
        return cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [positions, 1, head_dim]

    def kv_cache_shape(self, block_size: int) -> KVCacheShape:
        return KVCacheShape(
            num_layers=len(self.layers),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            block_size=block_size,
        )

    def activation_bytes(self, max_tokens: int, max_logit_rows: int) -> int:
        """A generous bound on what one forward of ``max_tokens`` tokens allocates beside the
        cache: a few hidden-size and intermediate-size rows per token, the logits in fp32."""
        config = self.config
        widths = 6 * int(config.hidden_size) + 3 * int(config.intermediate_size)
        element: int = self.embedding.element_size()
        return max_tokens * widths * element + 2 * max_logit_rows * self.vocab_size * 4

    # ---------------------------------------------------------------------------- forward

    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """fp32 logits ``[rows, vocab]`` for ``batch.logits_indices`` (every row if None)."""
        hidden = functional.embedding(batch.input_ids, self.embedding)
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        for index, layer in enumerate(self.layers):
            normed = rms_norm(hidden, layer.input_norm, self.eps)
            hidden = hidden + self._attention(normed, layer, index, cos, sin, batch, cache)
            normed = rms_norm(hidden, layer.post_norm, self.eps)
            gate, up = functional.linear(normed, layer.gate_up_weight, layer.gate_up_bias).chunk(
                2, dim=-1
            )
            hidden = hidden + functional.linear(
                functional.silu(gate) * up, layer.down_weight, layer.down_bias
            )
        if batch.logits_indices is not None:
            hidden = hidden.index_select(0, batch.logits_indices)
        return functional.linear(rms_norm(hidden, self.norm, self.eps), self.lm_head).float()

    def _attention(
        self,
        normed: torch.Tensor,
        layer: _Layer,
        index: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        tokens = normed.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        query, key, value = torch.split(
            functional.linear(normed, layer.qkv_weight, layer.qkv_bias),
            [q_size, kv_size, kv_size],
            dim=-1,
        )
        query = _rotate(query.view(tokens, self.num_heads, self.head_dim), cos, sin)
        key = _rotate(key.view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        value = value.view(tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = cache.keys[index], cache.values[index]
        flat_shape = (-1, self.num_kv_heads, self.head_dim)
        k_cache.view(flat_shape).index_copy_(0, batch.slot_mapping, key)
        v_cache.view(flat_shape).index_copy_(0, batch.slot_mapping, value)

        decodes = batch.num_decodes
        if not batch.prefills:
            out = self._decode(query, k_cache, v_cache, batch)
        else:
            out = torch.empty_like(query)
            if decodes:
                out[:decodes] = self._decode(query[:decodes], k_cache, v_cache, batch)
            for chunk in batch.prefills:
                rows = slice(chunk.offset, chunk.offset + chunk.length)
                if chunk.blocks is None:  # nothing cached before: the chunk's own keys
                    keys, values = key[rows], value[rows]
                else:
                    total = chunk.cached + chunk.length
                    keys = k_cache[chunk.blocks].view(flat_shape)[:total]
                    values = v_cache[chunk.blocks].view(flat_shape)[:total]
                out[rows] = prefill_attention(query[rows], keys, values, self.scale)
        return functional.linear(out.reshape(tokens, q_size), layer.o_weight, layer.o_bias)

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        assert batch.block_tables is not None and batch.seq_lens is not None
        return paged_decode_attention(
            query, k_cache, v_cache, batch.block_tables, batch.seq_lens, self.scale
        )
