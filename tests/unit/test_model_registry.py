"""models/registry.py and the files of dpserve/engine/models/ agree: every registered class
lives in a model file of that package, and every model file has a registry entry. The steps
of docs/architecture.md's "Adding an architecture" that this keeps: a file without its
registry line, or a line without its file, fails here."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from dpserve.engine.models import registry

MODELS_DIR = Path(registry.__file__).parent
# The package's modules that are not an architecture.
NOT_MODELS = frozenset({"__init__", "base", "registry"})


def registry_problems(classes: Mapping[str, type], directory: Path) -> list[str]:
    """What is wrong between a registry and the model files in ``directory``."""
    problems = []
    registered_files = set()
    for model_type, cls in classes.items():
        source = getattr(sys.modules.get(cls.__module__), "__file__", None)
        path = Path(source) if source else None
        if path is None or path.parent != directory or path.stem in NOT_MODELS:
            problems.append(f"{model_type!r} -> {cls.__name__}: not a model file of {directory}")
        else:
            registered_files.add(path.stem)
    for path in sorted(directory.glob("*.py")):
        if path.stem not in NOT_MODELS and path.stem not in registered_files:
            problems.append(f"{path.name} has no registry entry")
    return problems


def test_the_registry_and_the_model_files_agree() -> None:
    assert registry_problems(registry.MODEL_CLASSES, MODELS_DIR) == []


def test_a_model_file_without_a_registry_entry_fails() -> None:
    without_qwen3 = {k: v for k, v in registry.MODEL_CLASSES.items() if k != "qwen3"}
    assert registry_problems(without_qwen3, MODELS_DIR) == ["qwen3.py has no registry entry"]


def test_a_registry_entry_without_a_model_file_fails() -> None:
    class Elsewhere:  # defined in this test module, not in models/
        pass

    problems = registry_problems({**registry.MODEL_CLASSES, "gemma": Elsewhere}, MODELS_DIR)
    assert problems == [f"'gemma' -> Elsewhere: not a model file of {MODELS_DIR}"]


@pytest.mark.parametrize("model_type", sorted(registry.MODEL_CLASSES))
def test_every_registered_type_names_a_class_that_says_what_it_cannot_run(
    model_type: str,
) -> None:
    assert callable(registry.MODEL_CLASSES[model_type].unsupported_reason)
