"""oneMKL's VML dispatch is resolved before the engine's first threaded unary operation
(pytorch/pytorch#188792: a first call racing on several threads may run a low-accuracy kernel)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpserve import model_loading, vector_math

VML_HEADER = Path(torch.__file__).parent / "include" / "ATen" / "cpu" / "vml.h"


@pytest.mark.skipif(
    not VML_HEADER.exists(), reason=f"torch's headers are not installed ({VML_HEADER})"
)
def test_every_operation_torch_sends_to_vml_is_resolved() -> None:
    routed = set(re.findall(r"^IMPLEMENT_VML_MKL\((\w+),", VML_HEADER.read_text(), re.MULTILINE))
    assert routed, "no IMPLEMENT_VML_MKL line found: has vml.h changed its form?"
    assert routed == set(vector_math.VML_OPERATIONS)


def test_loading_a_model_resolves_the_dispatch_first(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(model_loading, "resolve_vml_dispatch", lambda: calls.append("resolved"))
    model, _ = model_loading.load_model_and_tokenizer(str(tiny_model_path), "float32", "cpu")
    assert calls == ["resolved"]
    assert model is not None


# A fresh process: the dispatch, then the RoPE table as the engine computes it, on two threads.
_FRESH_PROCESS = """
import torch
from dpserve.vector_math import resolve_vml_dispatch
resolve_vml_dispatch()
torch.set_num_threads(2)
inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
angles = torch.arange(256)[None, :, None].float() * inv_freq
angles = torch.cat((angles, angles), dim=-1)
for op in (torch.cos, torch.sin):
    error = (op(angles).double() - op(angles.double())).abs().max().item()
    assert error < 1e-5, (op.__name__, error)
"""


def test_the_first_threaded_cos_and_sin_after_the_dispatch_are_accurate() -> None:
    """Without the dispatch, about one such process in twenty to a hundred got errors of 1.5e-4
    here (2 cores, oneMKL 2024.2); eight processes catch a regression only sometimes, but never
    fail with it in place."""
    for _ in range(8):
        child = subprocess.run(
            [sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=120
        )
        assert child.returncode == 0, child.stderr[-2000:]
