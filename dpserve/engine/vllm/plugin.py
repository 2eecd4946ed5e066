"""dpserve's vLLM plugin (entry point ``vllm.general_plugins``: vLLM runs it in every process
it starts, its model workers included): a fix for vLLM's CPU LoRA ops, where the engine runs.

vLLM's CPU build computes LoRA deltas with plain torch ops (``lora.ops.torch_ops``) that gather
each row's adapter weights by the row's slot index, and a base-model row's index is -1: torch
reads that as the last slot, so in a step that mixes base-model requests with adapter requests
the base rows get the last slot's adapter added (wrong output, no error; vLLM's Triton kernels
skip -1). Open upstream as vllm-project/vllm#48421. Until vLLM fixes it, this plugin wraps
those ops so that a -1 row multiplies zeros: its delta is zero, as the Triton kernels leave it.
It checks the bug first (one tiny call), so a vLLM with the fix is left alone.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# The ops that gather by slot index; vLLM's sgmv_* (prompt chunks) call these through their
# module, and its CPU Punica wrapper imported them by name.
_GATHERING_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
_OP_MODULES = (
    "vllm.lora.ops.torch_ops.lora_ops",
    "vllm.lora.ops.torch_ops",
    "vllm.lora.punica_wrapper.punica_cpu",
)


def register() -> None:
    """vLLM's general-plugin hook: fix the CPU LoRA ops where they need it (idempotent)."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        import importlib

        modules = [importlib.import_module(name) for name in _OP_MODULES]
    except ImportError:  # a vLLM without these modules: nothing of this to fix
        return
    if not base_rows_get_an_adapter(modules[0].bgmv_shrink):
        return
    for module in modules:
        for name in _GATHERING_OPS:
            op = getattr(module, name, None)
            if op is not None and not getattr(op, "_dpserve_skips_base_rows", False):
                setattr(module, name, skipping_base_rows(op))
    log.info("dpserve: vLLM's CPU LoRA ops now leave base-model rows alone (vllm#48421)")


def base_rows_get_an_adapter(bgmv_shrink: Callable[..., Any]) -> bool:
    """Whether ``bgmv_shrink`` gives a row of slot index -1 (the base model) a nonzero delta."""
    import torch

    weights = torch.ones(1, 1, 2, 2)  # one slot: [slots, 1, rank, hidden]
    out = torch.zeros(1, 2)
    bgmv_shrink(torch.ones(1, 2), weights, out, torch.tensor([-1]), 1.0)
    return bool(out.abs().sum() > 0)


def skipping_base_rows(op: Callable[..., Any]) -> Callable[..., Any]:
    """``op`` (inputs, weights, output, indices, ...) with every row of index -1 computed
    from zeros under slot 0's weights: a zero delta, whatever the slots hold."""

    @functools.wraps(op)
    def op_without_base_rows(
        inputs: Any, weights: Any, output: Any, indices: Any, *args: Any, **kwargs: Any
    ) -> Any:
        base = indices < 0
        if inputs.dim() == 2 and inputs.shape[0] == indices.shape[0] and bool(base.any()):
            inputs = inputs.masked_fill(base.unsqueeze(-1), 0)
            indices = indices.clamp(min=0)
        return op(inputs, weights, output, indices, *args, **kwargs)

    op_without_base_rows._dpserve_skips_base_rows = True  # type: ignore[attr-defined]
    return op_without_base_rows
