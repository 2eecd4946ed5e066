"""``KVEventTranslator``: vLLM's BlockStored / BlockRemoved events as dpserve's block hashes,
with the request's cache_salt and LoRA adapter mixed in as dpserve's engine mixes them. (The
events are vLLM's by class name and fields; these are made here with the fields vLLM 0.32
publishes, so the test runs without vLLM. ``test_vllm_engine.py`` and ``test_vllm_lora.py``
check the same against real vLLM.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from dpserve.block_hash import block_hashes, extra_keys
from dpserve.engine.kv_events import KVEventKind
from dpserve.engine.vllm.kv_events import KVEventTranslator

BLOCK = 4


@dataclass
class BlockStored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[Any]


def _keys(lora: str | None, salt: str | None, blocks: int) -> list[tuple[Any, ...] | None]:
    """vLLM's extra keys per block: the adapter's name on every block, the salt on the
    first; None for a block with neither."""
    keys: list[tuple[Any, ...] | None] = []
    for index in range(blocks):
        key = tuple(k for k in (lora, salt if index == 0 else None) if k is not None)
        keys.append(key or None)
    return keys


@pytest.mark.parametrize(
    ("lora", "salt"), [(None, None), (None, "tenant"), ("sql", None), ("sql", "tenant")]
)
def test_stored_blocks_get_dpserve_hashes_with_adapter_and_salt(
    lora: str | None, salt: str | None
) -> None:
    tokens = list(range(10, 22))  # three blocks of 4
    translator = KVEventTranslator(BLOCK)
    first = BlockStored(["v0", "v1"], None, tokens[:8], BLOCK, lora_name=lora,
                        extra_keys=_keys(lora, salt, 2))  # fmt: skip
    # The third block comes later, under its parent (its keys have no salt).
    later = BlockStored(["v2"], "v1", tokens[8:], BLOCK, lora_name=lora,
                        extra_keys=[(lora,) if lora else None])  # fmt: skip
    events = translator.translate([first, later])
    expected = block_hashes(tokens, BLOCK, extra_keys(salt, lora))
    assert [e.kind for e in events] == [KVEventKind.STORED, KVEventKind.STORED]
    assert [*events[0].hashes, *events[1].hashes] == expected
    assert sorted(translator.snapshot()) == sorted(expected)
    removed = translator.translate([BlockRemoved(["v2"])])
    assert removed[0].kind is KVEventKind.REMOVED and removed[0].hashes == expected[2:]


def test_an_adapter_and_the_base_model_never_share_a_hash() -> None:
    tokens = list(range(10, 14))
    translator = KVEventTranslator(BLOCK)
    base = translator.translate([BlockStored(["b"], None, tokens, BLOCK)])
    tuned = translator.translate(
        [BlockStored(["t"], None, tokens, BLOCK, lora_name="sql", extra_keys=[("sql",)])]
    )
    assert base[0].hashes != tuned[0].hashes
    assert tuned[0].hashes == block_hashes(tokens, BLOCK, extra_keys(None, "sql"))
