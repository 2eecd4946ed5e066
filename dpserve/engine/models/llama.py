"""The Llama family (Llama, Mistral, Qwen2, SmolLM) over the paged cache: our own forward.

Why not transformers' forward: on a GPU it is kernel-launch bound and its caches are not paged
(issue 10). Here one forward covers a whole step — every sequence's tokens flattened into one
``[tokens, hidden]`` matrix, so the projections and the MLP are one matmul each — and attention
reads and writes the paged cache directly: new keys and values go in through the slot mapping,
the decode rows in one call and every prefill chunk of the step in one
(``layers.step_attention``). Which implementation each op runs is ``layers.kernel_choice``'s.

The weights are taken from the transformers model that ``dpserve.model_loading`` loaded (any
directory, hub id or the GGUF default): q/k/v and gate/up are fused into one matrix each, the
query and key rows in RoPE pair order (``layers.rotary``), and the transformers layers are
dropped one by one as they are converted, so memory never holds two copies of the model.
Subclasses (``qwen3``) change a layer's conversion and its attention input, nothing else.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.nn import functional

from dpserve.engine.layers import linear
from dpserve.engine.layers.cpu_decode_layers import DecodeLayers
from dpserve.engine.layers.kernel_choice import KernelChoice, choose_kernels
from dpserve.engine.layers.kv_cache import KVCacheShape, PagedKVCache
from dpserve.engine.layers.linear import (
    Linear,
    detached_weights,
    resident,
    rounds_bf16_activations,
)
from dpserve.engine.layers.mlp import FeedForward, GatedMLP
from dpserve.engine.layers.norm import row_norm
from dpserve.engine.layers.rotary import (
    LENGTH_DEPENDENT_ROPE,
    HeadNorms,
    RotaryKVWrite,
    TokenInputs,
    pair_rotary_dims,
    rope_rotation,
)
from dpserve.engine.layers.step_attention import AttentionLayout, StepAttention
from dpserve.engine.layers.weight_format import DEFAULT_WEIGHT_FORMAT, ELEMENT_BYTES, WeightFormat
from dpserve.engine.lora.adapter import AdapterLayout, ModuleShape
from dpserve.engine.lora.delta import StepAdapters
from dpserve.engine.models.base import ForwardBatch, warm_up_batch

log = logging.getLogger(__name__)


def unsupported_reason(model: Any) -> str | None:
    """Why ``PagedLlama`` cannot run ``model`` of a registered type (then the transformers
    backend serves it), or None."""
    config = model.config
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (only silu is implemented)"
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if any(kind != "full_attention" for kind in layer_types) or (
        getattr(config, "model_type", None) in ("mistral", "mixtral")
        and window
        and window < config.max_position_embeddings
    ):
        return "sliding-window attention is not implemented"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        return "no model.rotary_emb module"
    if getattr(rotary, "rope_type", "default") in LENGTH_DEPENDENT_ROPE:
        return f"RoPE type {rotary.rope_type!r} depends on the sequence length"
    return None


@dataclass(slots=True)
class LlamaLayer:
    input_norm: torch.Tensor
    qkv: Linear  # query and key rows in RoPE-pair order (layers.rotary)
    o_proj: Linear
    post_norm: torch.Tensor
    mlp: FeedForward


def fused_qkv(
    attention: Any, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The q/k/v projections as one weight (and bias), queries and keys in RoPE pair order."""
    q_weight, q_bias = pair_rotary_dims(*detached_weights(attention.q_proj), num_heads, head_dim)
    k_weight, k_bias = pair_rotary_dims(*detached_weights(attention.k_proj), num_kv_heads, head_dim)
    v_weight, v_bias = detached_weights(attention.v_proj)
    qkv_weight = torch.cat((q_weight, k_weight, v_weight))
    qkv_bias = None
    if any(bias is not None for bias in (q_bias, k_bias, v_bias)):
        qkv_bias = torch.cat(
            [
                bias if bias is not None else qkv_weight.new_zeros(weight.shape[0])
                for bias, weight in ((q_bias, q_weight), (k_bias, k_weight), (v_bias, v_weight))
            ]
        )
    return qkv_weight, qkv_bias


# Projections held in the matrix of the one before them (``fused_qkv``: transformers' attention
# modules define q, k, v in that order), and a mixture of experts' router, which runs outside
# ``Linear`` (``layers.moe``).
_JOIN_THE_PREVIOUS = frozenset({"k_proj", "v_proj"})
_ROUTER = "gate"


def projection_shapes(layer: Any) -> list[linear.Shape]:
    """The [out, in] shapes of a transformers decoder layer's projections as this model holds
    them, in the layer's order: q/k/v as the one matrix of ``fused_qkv``, the router left out
    (what the start-up probe measures: ``linear.small_batch_rows``)."""
    shapes: list[linear.Shape] = []
    for name, module in layer.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(module, torch.nn.Linear) or leaf == _ROUTER:
            continue
        rows, width = int(module.out_features), int(module.in_features)
        if leaf in _JOIN_THE_PREVIOUS and shapes:
            shapes[-1] = (shapes[-1][0] + rows, width)
        else:
            shapes.append((rows, width))
    return shapes


class PagedLlama:
    """The weights of a Llama-family model and its forward pass over a ``PagedKVCache``."""

    unsupported_reason = staticmethod(unsupported_reason)
    # Whether every product of a layer's feed-forward block runs on a kernel whose rows do not
    # depend on the batch (the gated MLP's projections); a mixture of experts' fp32 expert
    # products do not, so bf16 there keeps fp32 activations by default (rounds_bf16_activations).
    invariant_feed_forward: ClassVar[bool] = True

    def __init__(self, model: Any, weight_format: WeightFormat = DEFAULT_WEIGHT_FORMAT) -> None:
        reason = type(self).unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"not a supported {type(self).__name__} model: {reason}")
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
        self.embedding = resident(decoder.embed_tokens.weight)
        self.dtype, self.device = self.embedding.dtype, self.embedding.device
        self.norm = resident(decoder.norm.weight)
        # The embedding itself when tied; prepacked for oneDNN it becomes a copy (the lookup
        # needs the dense table), which is what makes the vocabulary projection fast.
        # How every projection's weight is held (``layers.weight_format``; the embedding and
        # norms stay as loaded): the vocabulary projection's too, a copy when tied.
        self.weight_format: WeightFormat = weight_format
        self.kernels: KernelChoice = choose_kernels(
            self.embedding, projection_shapes(decoder.layers[0]) if len(decoder.layers) else ()
        )
        # Whether bf16 projections round their activations to bf16 (by default only where the
        # step can then be batch-invariant); where they do, a prompt chunk's rows attend as
        # decode rows do, so that a stream resumed on another engine continues exactly
        # (step_attention).
        self.rounds_activations = rounds_bf16_activations(
            weight_format, by_default=self.kernels.glue == "cpu" and self.invariant_feed_forward
        )
        self.batch_invariant = (
            self.kernels.glue == "cpu" and self.rounds_activations and self.invariant_feed_forward
        )
        self.lm_head = self.linear(model.lm_head.weight.detach())
        self.vocab_size = self.lm_head.out_features
        self.rotation = rope_rotation(
            decoder.rotary_emb, self.context_size, self.head_dim, self.dtype, self.device
        )
        self.rotary = RotaryKVWrite(
            self.rotation, self.num_heads, self.num_kv_heads, self.head_dim, self.kernels
        )
        self.step_attention = StepAttention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.kernels,
            batch_invariant=self.batch_invariant,
        )
        self._norm = row_norm(self.kernels)
        # The LoRA rows of the step being computed (``forward`` sets and clears it); None: no
        # row of it has an adapter, and no layer does any LoRA work.
        self._adapters: StepAdapters | None = None
        self.layers: list[Any] = []
        for index in range(len(decoder.layers)):
            self.layers.append(self.convert_layer(decoder.layers[index]))
            decoder.layers[index] = torch.nn.Identity()  # frees its (now copied) weights
        # A decode step's layers in one C++ call where the glue is C++ and every layer fits.
        self.decode_layers: DecodeLayers | None = None
        if self.kernels.glue == "cpu":
            self.decode_layers = DecodeLayers.of(
                self.layers,
                [self.head_norms(layer) for layer in self.layers],
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                eps=self.eps,
                scale=self.scale,
                rotation_pairs=self.rotary.rotation_pairs,
                batch_invariant=self.batch_invariant,
            )
            if self.decode_layers is not None:
                rows = self.decode_layers.max_rows  # sys.maxsize: no bound (bf16 and int8)
                log.info(
                    "decode steps of %s run every layer in one C++ call",
                    "every size" if rows == sys.maxsize else f"up to {rows} sequences",
                )
        if self.device.type == "cpu":  # what --cpu-weights chose, and what it holds
            held = self.projection_bytes()
            as_fp32 = sum(
                linear.out_features * linear.in_features * ELEMENT_BYTES[DEFAULT_WEIGHT_FORMAT]
                for linear in self.projections()
            )
            log.info(
                "CPU projection weights held as %s: %.1f MB (%.1f MB as fp32); the embedding "
                "and norms stay fp32",
                weight_format,
                held / 1e6,
                as_fp32 / 1e6,
            )

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        """A projection of this model, its weight held in the model's weight format."""
        return Linear(
            weight,
            bias,
            self.weight_format,
            self.kernels.small_batch_rows,
            rounds_activations=self.rounds_activations,
        )

    def projections(self) -> list[Linear]:
        """Every ``Linear`` of the model: each layer's (its MLP's too) and the lm_head."""
        found: list[Linear] = [self.lm_head]
        for layer in self.layers:
            for part in (layer, layer.mlp):
                values = (
                    [getattr(part, field.name) for field in dataclasses.fields(part)]
                    if dataclasses.is_dataclass(part)
                    else list(vars(part).values())
                )
                found += [value for value in values if isinstance(value, Linear)]
        return found

    def projection_bytes(self) -> int:
        """The bytes the projections' weights take as held (``Linear.nbytes``)."""
        return sum(linear.nbytes for linear in self.projections())

    @property
    def glue(self) -> str:
        """Which code runs the layers' glue: "triton", "cpu" (C++ kernels) or "torch"."""
        return self.kernels.glue

    @property
    def triton_layers(self) -> bool:
        return self.kernels.triton_layers

    @property
    def decode_backend(self) -> str:
        return self.kernels.decode_attention

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def convert_layer(self, layer: Any) -> LlamaLayer:
        """One transformers decoder layer's weights, converted (then the layer is dropped)."""
        return LlamaLayer(
            input_norm=resident(layer.input_layernorm.weight),
            qkv=self.linear(
                *fused_qkv(layer.self_attn, self.num_heads, self.num_kv_heads, self.head_dim)
            ),
            o_proj=self.linear(*detached_weights(layer.self_attn.o_proj)),
            post_norm=resident(layer.post_attention_layernorm.weight),
            mlp=self.convert_mlp(layer.mlp),
        )

    def convert_mlp(self, mlp: Any) -> FeedForward:
        """A layer's feed-forward block: the gated MLP in Llama."""
        return GatedMLP(
            mlp, self.kernels, self.weight_format, rounds_activations=self.rounds_activations
        )

    def adapter_layout(self) -> AdapterLayout:
        """Which projections of each layer a LoRA adapter may adapt, as PEFT names and sees
        them (``lora.adapter``): attention everywhere, the MLP where it is a ``GatedMLP``."""
        hidden = int(self.embedding.shape[1])
        attention = {
            "q_proj": ModuleShape(hidden, self.q_size, self.num_heads, self.head_dim),
            "k_proj": ModuleShape(hidden, self.kv_size, self.num_kv_heads, self.head_dim),
            "v_proj": ModuleShape(hidden, self.kv_size),
            "o_proj": ModuleShape(self.q_size, hidden),
        }
        layout: AdapterLayout = []
        for layer in self.layers:
            modules = dict(attention)
            if isinstance(layer.mlp, GatedMLP):
                inner = layer.mlp.down.in_features
                modules["gate_proj"] = modules["up_proj"] = ModuleShape(hidden, inner)
                modules["down_proj"] = ModuleShape(inner, hidden)
            layout.append(modules)
        return layout

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
                    self.forward(warm_up_batch(decodes, 4, self.device), cache)
            self.forward(warm_up_batch(0, max_tokens, self.device), cache)
            self.step_attention.warm_up(cache.block_size, self.device, max_batch, max_blocks)

    # ---------------------------------------------------------------------------- forward

    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Logits ``[rows, vocab]`` (the model's dtype) for ``batch.logits_indices`` (every
        row if None). The stages below, in this order, are what ``piecewise_graphs`` cuts at
        attention; a decode step on CPU runs them all in one C++ call where ``decode_layers``
        takes it (the same kernels, the same result)."""
        hidden = self.embed(batch.input_ids)
        fused, rows = self.decode_layers, len(batch.input_ids)
        if fused is not None and fused.runs(rows, batch.num_decodes, batch.adapters is not None):
            assert batch.block_tables is not None and batch.seq_lens is not None
            hidden = fused(
                hidden,
                batch.positions,
                batch.slot_mapping,
                cache.kv,
                batch.block_tables,
                batch.seq_lens,
            )
        else:
            hidden = self._layers(hidden, batch, cache)
        if batch.logits_indices is not None:
            hidden = hidden.index_select(0, batch.logits_indices)
        return self.lm_head(self.final_norm(hidden))

    def _layers(
        self, hidden: torch.Tensor, batch: ForwardBatch, cache: PagedKVCache
    ) -> torch.Tensor:
        """``hidden`` through every layer, one stage at a time."""
        tokens = self.token_inputs(batch.positions, batch.slot_mapping)
        layout = self.attention_layout(batch, cache.block_size)
        self._adapters = batch.adapters
        try:
            for index in range(len(self.layers)):
                qkv = self.attention_input(index, hidden, tokens, cache)
                attended = self.attention(index, qkv, cache, layout)
                hidden = self.layer_output(index, hidden, attended)
        finally:  # the stages run alone (piecewise graphs) only for steps without adapters
            self._adapters = None
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return functional.embedding(input_ids, self.embedding)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._norm(hidden, self.norm, self.eps)

    def token_inputs(self, positions: torch.Tensor, slot_mapping: torch.Tensor) -> TokenInputs:
        return self.rotary.token_inputs(positions, slot_mapping)

    def attention_layout(self, batch: ForwardBatch, block_size: int) -> AttentionLayout:
        return self.step_attention.layout(
            batch.num_decodes,
            batch.block_tables,
            batch.seq_lens,
            batch.prefills,
            batch.slot_mapping,
            block_size,
        )

    def attention_input(
        self, index: int, hidden: torch.Tensor, tokens: TokenInputs, cache: PagedKVCache
    ) -> torch.Tensor:
        """Layer ``index``'s ``qkv`` ``[tokens, q + k + v]`` from its input ``hidden``: the
        queries rotated in place, the rotated keys and the values written to the pool."""
        layer = self.layers[index]
        normed = self._norm(hidden, layer.input_norm, self.eps)
        qkv: torch.Tensor = layer.qkv(normed)
        if self._adapters is not None:  # before Qwen3's head norms, as in transformers
            self._adapters.add(index, "qkv", normed, qkv)
        self.rotary(qkv, tokens, cache.kv[index], self.head_norms(layer))
        return qkv

    def head_norms(self, layer: Any) -> HeadNorms | None:
        """The norm a layer applies to each query and key head before RoPE: none in Llama."""
        return None

    def layer_output(
        self, index: int, hidden: torch.Tensor, attended: torch.Tensor
    ) -> torch.Tensor:
        """Layer ``index``'s output: its input ``hidden`` plus the output projection of
        ``attended`` ``[tokens, num_heads * head_dim]``, then plus its MLP."""
        layer = self.layers[index]
        adapters = self._adapters
        hidden = layer.o_proj.plus(attended, hidden)
        if adapters is not None:
            adapters.add(index, "o_proj", attended, hidden)
        normed = self._norm(hidden, layer.post_norm, self.eps)
        if adapters is not None and isinstance(layer.mlp, GatedMLP):
            return layer.mlp.plus(normed, hidden, adapters.for_layer(index))
        out: torch.Tensor = layer.mlp.plus(normed, hidden)  # a MoE block takes no adapter
        return out

    def attention(
        self, index: int, qkv: torch.Tensor, cache: PagedKVCache, layout: AttentionLayout
    ) -> torch.Tensor:
        """``[tokens, num_heads * head_dim]``: decode rows in one call, prefill chunks in
        one."""
        return self.step_attention(qkv, cache.kv[index], layout)
