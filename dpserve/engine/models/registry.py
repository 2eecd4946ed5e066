"""Which class runs each architecture on the paged engine: one line per transformers
``model_type``. A type that is not here, or that its class declines (``unsupported_reason``),
is served by the transformers fallback (``hf_backend``), with the reason in the log.
``tests/unit/test_model_registry.py`` checks that every entry's module exists and that every
model module of this package has an entry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from dpserve.engine.layers.weight_format import DEFAULT_WEIGHT_FORMAT, WeightFormat
from dpserve.engine.models.base import PagedModel
from dpserve.engine.models.llama import PagedLlama
from dpserve.engine.models.mixtral import PagedMixtral
from dpserve.engine.models.qwen3 import PagedQwen3
from dpserve.engine.models.qwen3_moe import PagedQwen3Moe

# Every architecture here is a PagedLlama or a subclass of it (its layers changed).
MODEL_CLASSES: Final[Mapping[str, type[PagedLlama]]] = {
    "llama": PagedLlama,
    "mistral": PagedLlama,
    "mixtral": PagedMixtral,
    "qwen2": PagedLlama,
    "qwen3": PagedQwen3,
    "qwen3_moe": PagedQwen3Moe,
}


def model_class(model: Any) -> type[PagedLlama] | None:
    """The class registered for ``model``'s ``model_type``, or None."""
    return MODEL_CLASSES.get(getattr(model.config, "model_type", None) or "")


def unsupported_reason(model: Any) -> str | None:
    """Why no paged model class can run ``model`` (then the transformers backend serves it),
    or None."""
    found = model_class(model)
    if found is None:
        model_type = getattr(model.config, "model_type", None)
        return f"model type {model_type!r} is not one of {sorted(MODEL_CLASSES)}"
    return found.unsupported_reason(model)


def build(model: Any, weight_format: WeightFormat = DEFAULT_WEIGHT_FORMAT) -> PagedModel:
    """The paged model for ``model`` (which ``unsupported_reason`` accepted), its projection
    weights held in ``weight_format`` (``layers.weight_format``)."""
    found = model_class(model)
    if found is None:
        raise ValueError(f"no paged model class: {unsupported_reason(model)}")
    return found(model, weight_format)
