"""Which implementation each op of a paged model runs on this device: decided here, once per
model, and read by the layers through ``KernelChoice`` (no layer asks the device again).

| op                | CUDA                         | CPU, fp32, C++ built | otherwise         |
|-------------------|------------------------------|----------------------|-------------------|
| linear, <= N rows | cuBLAS                       | ``decode_matmul``    | oneDNN or torch   |
| linear, more rows | cuBLAS                       | oneDNN (``linear``)  | oneDNN or torch   |
| RMSNorm           | torch                        | ``cpu_kernels``      | torch             |
| q/k RMSNorm       | in the RoPE kernel (*)       | in the RoPE kernel   | torch, per head   |
| RoPE + KV write   | ``triton_layer_ops``         | ``cpu_kernels``      | complex product   |
| SiLU x up         | ``triton_layer_ops``         | oneDNN epilogues     | torch             |
| mixture of experts| ``triton_moe``               | ``moe``: by expert   | ``moe``: by expert|
| decode attention  | ``triton_decode``            | ``cpu_kernels``      | gathered torch    |
| prefill attention | ``triton_prefill``           | SDPA, gathered       | SDPA, gathered    |
| greedy argmax     | ``triton_greedy`` (sampler)  | torch                | torch             |

N, the row count up to which a decode step's linears run the C++ ``decode_matmul`` (a weight
row read once for all rows) rather than oneDNN, is measured at start against oneDNN at each row
count on the model's own projection shapes (``linear.small_batch_rows``, up to
``linear.SMALL_BATCH_MAX_ROWS``) and logged; it is ``KernelChoice.small_batch_rows``, and each
``Linear`` of the model takes it when built. Without the C++ kernels the same rows may run
torch's dense ``F.linear`` instead, where that measures faster than oneDNN.

(*) For power-of-two head sizes; otherwise torch, per head, before the kernel.
On CPU a decode step whose every row and projection the C++ column takes runs all its layers in
one C++ call over those same kernels (``cpu_decode_layers``), the host's Python between them
left out.
"CUDA" means Triton imports and its kernels compile there (``triton_layer_ops.available``,
``attention.decode_attention_backend``); otherwise the CUDA column falls back to torch op by op.
"CPU, fp32" means the C++ kernels built on this machine (``cpu_kernels.usable``); without a
compiler, with ``DPSERVE_CPU_KERNELS=0`` or in bf16 the CPU runs the torch column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from dpserve.engine.kernels import cpu_kernels, triton_layer_ops
from dpserve.engine.layers import linear
from dpserve.engine.layers.attention import decode_attention_backend

Glue = Literal["triton", "cpu", "torch"]


def uses_triton_layers(device: torch.device) -> bool:
    """Whether the layer's glue (RoPE with the KV write, SiLU x up) and the prefill attention
    run as Triton kernels (``triton_layer_ops``, ``triton_prefill``): on CUDA, where torch
    launches a kernel per element-wise step; on CPU torch's operations are the fast path."""
    return device.type == "cuda" and triton_layer_ops.available(device)


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """What one model runs on its device (the table above)."""

    # Which code runs the glue around the matmuls (norms, RoPE + KV write, SiLU x up):
    # "triton" (CUDA), "cpu" (the C++ kernels: fp32 on CPU) or "torch".
    glue: Glue
    # Which code runs the decode rows' attention where the glue is not "cpu" ("triton" or
    # "torch"); with the C++ glue the decode attention is the C++ kernel.
    decode_attention: str
    # Up to how many rows an fp32 CPU linear runs its small-batch path (``linear.Linear``);
    # 0 where nothing was measured (another device or dtype: the linears then never use it).
    small_batch_rows: int = 0

    @property
    def triton_layers(self) -> bool:
        return self.glue == "triton"


def choose_kernels(
    weights: torch.Tensor, projection_shapes: Sequence[linear.Shape] = ()
) -> KernelChoice:
    """The implementations for a model whose weights look like ``weights`` (device, dtype) and
    whose decoder layer's projections have ``projection_shapes`` ([out, in] each)."""
    device = weights.device
    glue: Glue = (
        "triton"
        if uses_triton_layers(device)
        else "cpu"
        if cpu_kernels.usable(weights)
        else "torch"
    )
    return KernelChoice(
        glue=glue,
        decode_attention=decode_attention_backend(device),
        small_batch_rows=(
            linear.small_batch_rows(weights.dtype, projection_shapes)
            if linear.uses_onednn(weights)
            else 0
        ),
    )
