"""The start-up step ``PagedLlama.warm_up`` runs on CUDA (a full ``max_num_batched_tokens``
step): it must touch nothing a sequence could own. Checked on CPU, where the same forward runs."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from dpserve.engine.layers.kv_cache import PagedKVCache
from dpserve.engine.models.base import warm_up_batch
from dpserve.engine.models.llama import PagedLlama


def test_the_warm_up_step_writes_only_block_zero(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        llama = PagedLlama(model)
        cache = PagedKVCache(llama.kv_cache_shape(4), 8, torch.device("cpu"))
        for pair in cache.kv:
            pair.fill_(7.0)  # what sequences would hold
        batch = warm_up_batch(1, 1100, torch.device("cpu"))
        assert [chunk.length for chunk in batch.prefills] == [512, 512, 76]
        logits = llama.forward(batch, cache)
    assert logits.shape == (1 + 3, llama.vocab_size)  # the decode row, each chunk's last row
    assert torch.isfinite(logits).all()
    for pair in cache.kv:
        assert (pair[:, 0, 0] != 7.0).any()  # slot 0 of the reserved block took every write
        assert (pair[:, 0, 1:] == 7.0).all()
        assert (pair[:, 1:] == 7.0).all()
