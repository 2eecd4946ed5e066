"""Our own forward pass for Llama-family models (Llama, Mistral, Qwen2, SmolLM), in torch.

Why not transformers' forward: on a GPU it is kernel-launch bound and its caches are not paged
(issue 10). Here one forward covers a whole step — every sequence's tokens flattened into one
``[tokens, hidden]`` matrix, so the projections and the MLP are one matmul each — and attention
reads and writes the paged cache directly: new keys and values go in through the slot mapping
(``index_put_`` into the flattened pool), the decode rows in one ``paged_decode_attention`` call
and every prefill chunk of the step in one ``varlen_prefill_attention`` call.

On CUDA (``uses_triton_layers``) the element-wise glue and the prefill attention are Triton
kernels: RoPE with the KV write and SiLU x up (``triton_layer_ops``), the step's prefill chunks
read straight from the pool (``triton_prefill``); the decode rows use ``triton_decode``. On CPU
in fp32, where they build (``cpu_kernels``), RMSNorm, RoPE with the KV write and the decode
rows' attention are C++ loops. Which of the three a model runs is its ``glue``.

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

from dpserve.engine import cpu_kernels, triton_layer_ops, triton_prefill
from dpserve.engine.kv_cache import KVCacheShape, PagedKVCache
from dpserve.engine.linear import Linear, uses_onednn
from dpserve.engine.paged_attention import (
    DecodeLayout,
    PrefillLayout,
    decode_attention_backend,
    decode_layout,
    gathered_decode_attention,
    paged_decode_attention,
    prefill_layout,
    varlen_prefill_attention,
)

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


def uses_triton_layers(device: torch.device) -> bool:
    """Whether the layer's glue (RoPE with the KV write, SiLU x up) and the prefill attention
    run as Triton kernels (``triton_layer_ops``, ``triton_prefill``): on CUDA, where torch
    launches a kernel per element-wise step; on CPU torch's operations are the fast path."""
    return device.type == "cuda" and triton_layer_ops.available(device)


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


class _MLP:
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, the residual added by the down projection.

    With oneDNN the gate and up projections stay separate so SiLU and the product ride in
    their epilogues (three operations in all); otherwise they are one fused matmul followed
    by SiLU and a product, one Triton kernel where ``fused`` (CUDA)."""

    def __init__(self, mlp: Any, fused: bool) -> None:
        self.fused = fused
        if uses_onednn(mlp.gate_proj.weight):
            self.gate: Linear | None = Linear(*_weights(mlp.gate_proj))
            self.up: Linear | None = Linear(*_weights(mlp.up_proj))
            self.gate_up: Linear | None = None
        else:
            self.gate = self.up = None
            self.gate_up = Linear(*_fused(mlp.gate_proj, mlp.up_proj))
        self.down = Linear(*_weights(mlp.down_proj))

    def plus(self, normed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + mlp(normed)``."""
        if self.gate is not None and self.up is not None:
            activated = self.up.times(normed, self.gate.silu(normed))
        else:
            assert self.gate_up is not None
            if self.fused:
                activated = triton_layer_ops.silu_times_up(self.gate_up(normed))
            else:
                gate, up = self.gate_up(normed).chunk(2, dim=-1)
                activated = functional.silu(gate).mul_(up)
        return self.down.plus(activated, residual)


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear  # query and key rows in RoPE-pair order: see _pair_rotary_dims
    o_proj: Linear
    post_norm: torch.Tensor
    mlp: _MLP


def _weights(linear: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    return linear.weight.detach(), _detached(linear.bias)


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


def _rotary_pair_order(head_dim: int) -> torch.Tensor:
    """Dimension ``i`` and ``i + head_dim / 2`` of a head are the two halves RoPE rotates
    together (transformers' ``rotate_half``); this order puts them side by side
    (``0, h, 1, h + 1, ...``), so each pair is one complex number."""
    half = head_dim // 2
    return torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).reshape(-1)


def _pair_rotary_dims(
    weight: torch.Tensor, bias: torch.Tensor | None, heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A query or key projection whose output heads come out in ``_rotary_pair_order``.
    Queries and keys are permuted alike, so every score q.k is the same sum; the cache holds
    keys in this order."""
    order = _rotary_pair_order(head_dim).to(weight.device)
    weight = weight.view(heads, head_dim, -1).index_select(1, order).reshape(weight.shape)
    if bias is not None:
        bias = bias.view(heads, head_dim).index_select(1, order).reshape(bias.shape)
    return weight, bias


def _convert_layer(
    layer: Any, num_heads: int, num_kv_heads: int, head_dim: int, fused: bool
) -> _Layer:
    attention = layer.self_attn
    q_weight, q_bias = _pair_rotary_dims(*_weights(attention.q_proj), num_heads, head_dim)
    k_weight, k_bias = _pair_rotary_dims(*_weights(attention.k_proj), num_kv_heads, head_dim)
    v_weight, v_bias = _weights(attention.v_proj)
    qkv_weight = torch.cat((q_weight, k_weight, v_weight))
    qkv_bias = None
    if any(bias is not None for bias in (q_bias, k_bias, v_bias)):
        qkv_bias = torch.cat(
            [
                bias if bias is not None else qkv_weight.new_zeros(weight.shape[0])
                for bias, weight in ((q_bias, q_weight), (k_bias, k_weight), (v_bias, v_weight))
            ]
        )
    return _Layer(
        input_norm=layer.input_layernorm.weight.detach(),
        qkv=Linear(qkv_weight, qkv_bias),
        o_proj=Linear(*_weights(attention.o_proj)),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        mlp=_MLP(layer.mlp, fused),
    )


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm (fp32 statistics) as one torch operation."""
    return functional.rms_norm(hidden, weight.shape, weight, eps)


def _rotate_in_place(pairs: torch.Tensor, rotation: torch.Tensor) -> None:
    """RoPE on ``pairs`` ``[tokens, heads, head_dim / 2, 2]`` (a view of the projection's
    output in ``_rotary_pair_order``) by ``rotation`` ``[tokens, 1, head_dim / 2]`` complex:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) is a complex product, one operation."""
    if pairs.dtype in (torch.float32, torch.float64):
        torch.view_as_complex(pairs).mul_(rotation)
    else:  # no complex bfloat16: rotate in fp32 and write back rounded
        rotated = torch.view_as_complex(pairs.float()) * rotation
        pairs.copy_(torch.view_as_real(rotated))


@dataclass(slots=True)
class TokenInputs:
    """Each row's position and cache slot, and what the torch path derives from them once per
    step: all a layer reads besides its attention (``piecewise_graphs`` captures on these)."""

    positions: torch.Tensor  # [tokens] int64
    slot_mapping: torch.Tensor  # [tokens] int64
    # The torch path's RoPE ([tokens, 1, head_dim / 2] complex, each row's position) and KV
    # write (index_put_ into a layer's kv pair); None where a kernel does both.
    rotation: torch.Tensor | None
    write_index: tuple[torch.Tensor, torch.Tensor] | None


@dataclass(slots=True)
class AttentionLayout:
    """What a step's attention reads besides the queries and the pool, computed once per step:
    the decode rows' tables and lengths, the prefill chunks' layout."""

    num_decodes: int
    block_tables: torch.Tensor | None
    seq_lens: torch.Tensor | None
    decode: DecodeLayout | None  # None: no decode rows, or a kernel reads the tables
    prefill: PrefillLayout | triton_prefill.VarlenPrefillLayout | None


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
        self.group = self.num_heads // self.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.eps = float(config.rms_norm_eps)
        self.context_size = int(config.max_position_embeddings)
        decoder = model.model
        self.embedding = decoder.embed_tokens.weight.detach()
        self.dtype, self.device = self.embedding.dtype, self.embedding.device
        self.norm = decoder.norm.weight.detach()
        # The embedding itself when tied; prepacked for oneDNN it becomes a copy (the lookup
        # needs the dense table), which is what makes the vocabulary projection fast.
        self.lm_head = Linear(model.lm_head.weight.detach())
        self.vocab_size = self.lm_head.out_features
        self.rotation = self._rope_rotation(decoder.rotary_emb)
        self.triton_layers = uses_triton_layers(self.device)
        # "triton" (CUDA), "cpu" (the C++ kernels: fp32 on CPU) or "torch".
        self.glue = (
            "triton"
            if self.triton_layers
            else "cpu"
            if cpu_kernels.usable(self.embedding)
            else "torch"
        )
        # The rotation as (cos, sin) pairs, [positions, head_dim / 2, 2], for the C++ kernel.
        self.rotation_pairs = torch.view_as_real(self.rotation).view(self.context_size, -1, 2)
        self._norm = cpu_kernels.rms_norm if self.glue == "cpu" else rms_norm
        self.layers: list[_Layer] = []
        for index in range(len(decoder.layers)):
            self.layers.append(
                _convert_layer(
                    decoder.layers[index],
                    self.num_heads,
                    self.num_kv_heads,
                    self.head_dim,
                    self.triton_layers,
                )
            )
            decoder.layers[index] = torch.nn.Identity()  # frees its (now copied) weights
        self.decode_backend = decode_attention_backend(self.device)

    def _rope_rotation(self, rotary: Any) -> torch.Tensor:
        """``[positions, 1, head_dim / 2]`` complex64: cos + i sin of every position, from the
        model's own rotary module (so every scaling variant is transformers')."""
        positions = torch.arange(self.context_size, device=self.device).unsqueeze(0)
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            cos, sin = rotary(probe, positions)
        cos, sin = cos[0].float(), sin[0].float()
        half = self.head_dim // 2
        paired = torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(
            sin[:, :half], sin[:, half:]
        )
        if not paired:
            raise ValueError("the rotary tables do not rotate dimension pairs (i, i + dim/2)")
        return torch.complex(cos[:, :half], sin[:, :half]).unsqueeze(1)

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

    def warm_up(
        self, cache: PagedKVCache, max_batch: int, max_blocks: int, max_tokens: int
    ) -> None:
        """Before serving, on CUDA: compile every Triton kernel variant a run can hit and run
        one step of ``max_tokens`` prompt tokens, so that the first requests wait for neither
        the JIT nor the allocator's growth, and a step that does not fit beside the pool fails
        here, at start, rather than mid-serving. Only block 0 (never handed out) is written."""
        if self.device.type != "cuda":
            return
        with torch.cuda.device(self.device):
            if self.triton_layers:
                for decodes in (0, 1):  # the query rows at an aligned and an unaligned address
                    self.forward(_warm_up_batch(decodes, 4, self.device), cache)
            self.forward(_warm_up_batch(0, max_tokens, self.device), cache)
            if self.decode_backend == "triton":
                self._warm_up_decode(cache, max_batch, max_blocks)

    def _warm_up_decode(self, cache: PagedKVCache, max_batch: int, max_blocks: int) -> None:
        from dpserve.engine import triton_decode

        triton_decode.warm_up(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            cache.block_size,
            self.dtype,
            self.device,
            max_batch,
            max_blocks,
        )

    # ---------------------------------------------------------------------------- forward

    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Logits ``[rows, vocab]`` (the model's dtype) for ``batch.logits_indices`` (every
        row if None). The stages below, in this order, are what ``piecewise_graphs`` cuts at
        attention."""
        tokens = self.token_inputs(batch.positions, batch.slot_mapping)
        layout = self.attention_layout(batch, cache.block_size)
        hidden = self.embed(batch.input_ids)
        for index in range(len(self.layers)):
            qkv = self.attention_input(index, hidden, tokens, cache)
            hidden = self.layer_output(index, hidden, self.attention(index, qkv, cache, layout))
        if batch.logits_indices is not None:
            hidden = hidden.index_select(0, batch.logits_indices)
        return self.lm_head(self.final_norm(hidden))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return functional.embedding(input_ids, self.embedding)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._norm(hidden, self.norm, self.eps)

    def token_inputs(self, positions: torch.Tensor, slot_mapping: torch.Tensor) -> TokenInputs:
        if self.glue != "torch":
            return TokenInputs(positions, slot_mapping, rotation=None, write_index=None)
        return TokenInputs(
            positions,
            slot_mapping,
            rotation=self.rotation.index_select(0, positions),
            write_index=(
                torch.arange(2, device=slot_mapping.device).unsqueeze(1),
                slot_mapping.unsqueeze(0),
            ),
        )

    def attention_layout(self, batch: ForwardBatch, block_size: int) -> AttentionLayout:
        slots = batch.slot_mapping
        decode = None
        prefill: PrefillLayout | triton_prefill.VarlenPrefillLayout | None = None
        decodes = batch.num_decodes
        if decodes and self.decode_backend != "triton" and self.glue != "cpu":
            assert batch.block_tables is not None and batch.seq_lens is not None
            decode = decode_layout(batch.block_tables, batch.seq_lens, block_size, self.dtype)
        chunks = batch.prefills
        if chunks and self.triton_layers:
            prefill = triton_prefill.varlen_layout(
                lengths=[chunk.length for chunk in chunks],
                cached=[chunk.cached for chunk in chunks],
                cached_blocks=[chunk.blocks for chunk in chunks],
                slot_mapping=slots[decodes:],
                block_size=block_size,
            )
        elif chunks:
            prefill = prefill_layout(
                offsets=[chunk.offset - decodes for chunk in chunks],
                lengths=[chunk.length for chunk in chunks],
                cached=[chunk.cached for chunk in chunks],
                cached_blocks=[chunk.blocks for chunk in chunks],
                slot_mapping=slots[decodes:],
                block_size=block_size,
                group=self.group,
                dtype=self.dtype,
            )
        return AttentionLayout(decodes, batch.block_tables, batch.seq_lens, decode, prefill)

    def attention_input(
        self, index: int, hidden: torch.Tensor, tokens: TokenInputs, cache: PagedKVCache
    ) -> torch.Tensor:
        """Layer ``index``'s ``qkv`` ``[tokens, q + k + v]`` from its input ``hidden``: the
        queries rotated in place, the rotated keys and the values written to the pool."""
        layer, kv_pair = self.layers[index], cache.kv[index]
        rows = hidden.shape[0]
        qkv = layer.qkv(self._norm(hidden, layer.input_norm, self.eps))
        if self.glue == "cpu":
            cpu_kernels.rotate_and_write_kv(
                qkv,
                self.rotation_pairs,
                tokens.positions,
                tokens.slot_mapping,
                kv_pair,
                self.num_heads,
                self.num_kv_heads,
            )
        elif tokens.rotation is None or tokens.write_index is None:
            triton_layer_ops.rotate_and_write_kv(
                qkv,
                self.rotation,
                tokens.positions,
                tokens.slot_mapping,
                kv_pair,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
            )
        else:
            rotated_heads = self.num_heads + self.num_kv_heads
            _rotate_in_place(
                qkv[:, : self.q_size + self.kv_size].view(rows, rotated_heads, -1, 2),
                tokens.rotation,
            )
            key_value = qkv[:, self.q_size :].view(rows, 2, self.num_kv_heads, self.head_dim)
            kv_pair.view(2, -1, self.num_kv_heads, self.head_dim).index_put_(
                tokens.write_index, key_value.transpose(0, 1)
            )
        return qkv

    def layer_output(
        self, index: int, hidden: torch.Tensor, attended: torch.Tensor
    ) -> torch.Tensor:
        """Layer ``index``'s output: its input ``hidden`` plus the output projection of
        ``attended`` ``[tokens, num_heads * head_dim]``, then plus its MLP."""
        layer = self.layers[index]
        hidden = layer.o_proj.plus(attended, hidden)
        return layer.mlp.plus(self._norm(hidden, layer.post_norm, self.eps), hidden)

    def attention(
        self, index: int, qkv: torch.Tensor, cache: PagedKVCache, layout: AttentionLayout
    ) -> torch.Tensor:
        """``[tokens, num_heads * head_dim]``: decode rows in one call, prefill chunks in
        one."""
        kv_pair = cache.kv[index]
        query = qkv[:, : self.q_size].view(qkv.shape[0], self.num_heads, self.head_dim)
        decodes = layout.num_decodes
        parts = []
        if decodes:
            parts.append(self._decode(query[:decodes], kv_pair, layout))
        if isinstance(layout.prefill, triton_prefill.VarlenPrefillLayout):
            parts.append(
                triton_prefill.varlen_prefill_attention_triton(
                    query[decodes:], kv_pair, layout.prefill, self.scale
                )
            )
        elif layout.prefill is not None:
            parts.append(
                varlen_prefill_attention(query[decodes:], kv_pair, layout.prefill, self.scale)
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decode(
        self, query: torch.Tensor, kv_pair: torch.Tensor, layout: AttentionLayout
    ) -> torch.Tensor:
        if layout.decode is not None:
            return gathered_decode_attention(query, kv_pair, layout.decode, self.scale)
        assert layout.block_tables is not None and layout.seq_lens is not None
        if self.glue == "cpu":
            return cpu_kernels.decode_attention(
                query, kv_pair, layout.block_tables, layout.seq_lens, self.scale
            )
        out = paged_decode_attention(
            query, kv_pair[0], kv_pair[1], layout.block_tables, layout.seq_lens, self.scale
        )
        return out.reshape(query.shape[0], self.q_size)


def _warm_up_batch(decodes: int, prompt_tokens: int, device: torch.device) -> ForwardBatch:
    """``decodes`` decode rows and ``prompt_tokens`` prompt tokens in chunks of up to 512,
    every one at position 0 and slot 0; logits of each chunk's last row."""
    lengths = [min(512, prompt_tokens - start) for start in range(0, prompt_tokens, 512)]
    offsets = [decodes + sum(lengths[:index]) for index in range(len(lengths))]
    zeros = torch.zeros(decodes + prompt_tokens, dtype=torch.long, device=device)
    last_rows = [offset + length - 1 for offset, length in zip(offsets, lengths, strict=True)]
    return ForwardBatch(
        input_ids=zeros,
        positions=zeros,
        slot_mapping=zeros,
        num_decodes=decodes,
        block_tables=torch.zeros((decodes, 1), dtype=torch.int32, device=device),
        seq_lens=torch.ones(decodes, dtype=torch.int32, device=device),
        prefills=[
            PrefillSlice(offset, length, 0, None)
            for offset, length in zip(offsets, lengths, strict=True)
        ],
        logits_indices=torch.tensor([*range(decodes), *last_rows], device=device),
    )
