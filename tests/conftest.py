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
