"""A request's LoRA adapter on the wire: ``SamplingParams.lora_name`` (validated, serialized),
the prefix-cache keys it adds (``block_hash.extra_keys``), and the engine flags that load
adapters (``flags``)."""

from __future__ import annotations

import argparse

import pytest

from dpserve import flags
from dpserve.block_hash import block_hashes, extra_keys
from dpserve.sampling import InvalidSamplingParams, SamplingParams


def test_the_adapter_name_travels_with_the_sampling_params() -> None:
    params = SamplingParams(lora_name="org/sql-v2")
    assert params.serialize() == {"lora_name": "org/sql-v2"}
    assert SamplingParams.deserialize(params.serialize()) == params
    assert "lora_name" not in SamplingParams().serialize()  # the base model: nothing sent


@pytest.mark.parametrize("name", ["", "has space", "a,b", "-leading", "x" * 129, 7, "é"])
def test_bad_adapter_names_are_refused(name: object) -> None:
    with pytest.raises(InvalidSamplingParams, match="LoRA adapter name"):
        SamplingParams(lora_name=name)  # type: ignore[arg-type]


def test_adapters_and_salts_key_blocks_apart() -> None:
    tokens = list(range(64))
    keys = [
        extra_keys(None),
        extra_keys("a"),
        extra_keys(None, "a"),
        extra_keys(None, "b"),
        extra_keys("a", "a"),
        extra_keys("b", "a"),
    ]
    assert len({bytes(key) for key in keys}) == len(keys)
    assert len({tuple(block_hashes(tokens, 16, key)) for key in keys}) == len(keys)
    assert extra_keys("salt") == b"salt:salt"  # the base model's keys are what they were


def _lora_args(*argv: str, backend: str = "dpserve", fake: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    flags.add_lora_flags(parser)
    args = parser.parse_args(argv)
    args.backend, args.fake = backend, fake
    return args


def test_lora_flags() -> None:
    args = _lora_args("--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "2")
    assert flags.lora_flags_error(args) is None
    assert flags.lora_modules(args) == {"sql": "/a/sql", "chat": "/a/chat"}
    assert flags.lora_args(args) == (
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "64",
        "--lora-modules", "sql=/a/sql", "chat=/a/chat",
    )  # fmt: skip
    assert flags.lora_args(_lora_args()) == ()  # nothing passed on when LoRA is off
    for argv, why in [
        (("--lora-modules", "sql"), "NAME=PATH"),
        (("--lora-modules", "bad name=/a"), "LoRA adapter name"),
        (("--lora-modules", "a=/x", "a=/y"), "twice"),
    ]:
        error = flags.lora_flags_error(_lora_args(*argv))
        assert error is not None and why in error
    assert "not --fake" in str(flags.lora_flags_error(_lora_args("--enable-lora", fake=True)))
    # vLLM's engine takes the same flags (mapped to its own).
    assert flags.lora_flags_error(_lora_args("--enable-lora", backend="vllm")) is None
