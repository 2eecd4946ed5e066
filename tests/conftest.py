"""Fixtures shared by every test layer."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight causal LM and its tokenizer, saved as a transformers directory."""
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_byte_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model over a tokenizer that has no fast version
    (``tiny_model.build_tiny_byte_model``)."""
    from tests.tiny_model import build_tiny_byte_model

    return build_tiny_byte_model(tmp_path_factory.mktemp("tiny-byte-model"))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The Python of vLLM's own install (``make vllm``; ``make test`` names it in
    ``$DPSERVE_VLLM_PYTHON``). Without it a test skips, but not in CI (``CI=true``, or
    ``DPSERVE_E2E_REQUIRED=1`` as ``.ci/run`` sets): there it fails."""
    import os

    path = os.environ.get("DPSERVE_VLLM_PYTHON", "")
    if path and os.access(path, os.X_OK):
        return path
    why = (
        "vLLM's own install is missing: run `make vllm` and set DPSERVE_VLLM_PYTHON to its "
        f"bin/python (got {path!r})"
    )
    if os.environ.get("CI") == "true" or os.environ.get("DPSERVE_E2E_REQUIRED") == "1":
        pytest.fail(why)
    pytest.skip(why)
