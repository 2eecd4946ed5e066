"""What the paged engine core (``engine.paged``) needs of a model: the step's batch types and
the ``PagedModel`` protocol. A model is one module of this package over ``engine.layers``,
registered in ``registry``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dpserve.engine.layers.kernel_choice import KernelChoice
from dpserve.engine.layers.kv_cache import KVCacheShape, PagedKVCache
from dpserve.engine.layers.linear import Linear
from dpserve.engine.layers.rotary import TokenInputs
from dpserve.engine.layers.step_attention import AttentionLayout
from dpserve.engine.lora.adapter import AdapterLayout
from dpserve.engine.lora.delta import StepAdapters


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
    # The rows of LoRA adapters, grouped by adapter; None: every row runs the base model.
    adapters: StepAdapters | None = None


class PagedModel(Protocol):
    """A model's weights and its forward over a ``PagedKVCache``, one step at a time.

    ``forward`` is the whole step; the stages below it, in this order, are what
    ``paged.piecewise_graphs`` captures separately, cut at attention: ``token_inputs`` and
    ``attention_layout`` once per step, ``embed``, then per layer ``attention_input``,
    ``attention`` and ``layer_output``, then ``final_norm`` and ``lm_head``."""

    config: Any  # the transformers config
    device: torch.device
    dtype: torch.dtype
    embedding: torch.Tensor  # [vocab, hidden]
    lm_head: Linear
    vocab_size: int
    context_size: int
    q_size: int  # query width of a layer's qkv
    kv_size: int  # key (and value) width of a layer's qkv
    kernels: KernelChoice
    # Whether a row's arithmetic is the same whatever shares its step (layers.step_attention):
    # a resumed stream then continues to the bit.
    batch_invariant: bool

    @property
    def num_layers(self) -> int: ...
    @property
    def glue(self) -> str: ...

    def kv_cache_shape(self, block_size: int) -> KVCacheShape: ...
    def adapter_layout(self) -> AdapterLayout: ...
    def activation_bytes(self, max_tokens: int, max_logit_rows: int) -> int: ...
    def warm_up(
        self, cache: PagedKVCache, max_batch: int, max_blocks: int, max_tokens: int
    ) -> None: ...
    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor: ...
    def token_inputs(self, positions: torch.Tensor, slot_mapping: torch.Tensor) -> TokenInputs: ...
    def attention_layout(self, batch: ForwardBatch, block_size: int) -> AttentionLayout: ...
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...
    def attention_input(
        self, index: int, hidden: torch.Tensor, tokens: TokenInputs, cache: PagedKVCache
    ) -> torch.Tensor: ...
    def attention(
        self, index: int, qkv: torch.Tensor, cache: PagedKVCache, layout: AttentionLayout
    ) -> torch.Tensor: ...
    def layer_output(
        self, index: int, hidden: torch.Tensor, attended: torch.Tensor
    ) -> torch.Tensor: ...
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor: ...


def warm_up_batch(decodes: int, prompt_tokens: int, device: torch.device) -> ForwardBatch:
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
