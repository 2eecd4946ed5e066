"""The fused MoE kernel (``kernels.triton_moe``) equals the expert loop it replaces on CUDA and
transformers' own MoE blocks (CPU, Triton's interpreter), and its expert-sorted layout holds
every (token, choice) pair once, in a block of its expert.

As in ``test_triton_layer_kernels``: the kernel cases run in a child process with
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dpserve.engine.kernels import triton_moe
from dpserve.engine.layers.kernel_choice import KernelChoice
from dpserve.engine.layers.moe import SparseMoE
from tests.triton_interpreter import TRITON_MISSING, interpreter_case, interpreter_run

pytest.importorskip("triton", reason=TRITON_MISSING)
test_the_moe_kernel_cases_pass_in_the_interpreter = interpreter_run(__file__)

TORCH_LOOP = KernelChoice(glue="torch", decode_attention="torch")
TRITON = KernelChoice(glue="triton", decode_attention="torch")


@pytest.mark.parametrize(
    ("tokens", "top_k", "num_experts", "block_m"),
    [(1, 8, 128, 16), (5, 2, 8, 16), (40, 2, 8, 16), (3, 1, 4, 4)],
)
def test_expert_blocks_hold_every_pair_once_in_a_block_of_its_expert(
    tokens: int, top_k: int, num_experts: int, block_m: int
) -> None:
    generator = torch.Generator().manual_seed(tokens + top_k)
    experts = torch.stack(
        [torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)]
    ).reshape(tokens, top_k)
    pair_ids, block_experts = triton_moe.expert_blocks(experts, num_experts, block_m)
    num_pairs = tokens * top_k
    # The layout's size depends on the number of pairs only (one graph per step size).
    assert block_experts.numel() == -(-num_pairs // block_m) + min(num_experts, num_pairs)
    assert pair_ids.numel() == block_experts.numel() * block_m
    used = pair_ids[pair_ids < num_pairs]
    assert sorted(used.tolist()) == list(range(num_pairs))
    flat = experts.reshape(-1)
    active = torch.unique(flat).numel()
    needed = sum(-(-int((flat == e).sum()) // block_m) for e in range(num_experts))
    assert int((block_experts >= 0).sum()) == needed
    # The used blocks come first, each holding pairs of its expert only (then padding).
    assert (block_experts[:needed] >= 0).all() and (block_experts[needed:] == -1).all()
    for block in range(needed):
        ids = pair_ids[block * block_m : (block + 1) * block_m]
        ids = ids[ids < num_pairs].long()
        assert ids.numel() > 0
        assert (flat[ids] == block_experts[block]).all()
    assert active == torch.unique(block_experts[:needed]).numel()


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    experts = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_moe.fused_moe(
            torch.zeros(1, 4), experts, torch.ones(1, 1), torch.zeros(1, 8, 4), torch.zeros(1, 4, 4)
        )


def moe_block(
    kind: str,
    hidden: int,
    inner: int,
    experts: int,
    top_k: int,
    *,
    device: str = "cpu",
    std: float | None = 0.3,
) -> Any:
    """A transformers MoE block with random weights (its forward is the reference), made on
    ``device``; ``std`` None: each weight's standard deviation is 1/sqrt(its input width)."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(hidden + inner + experts)
    with torch.device(device):
        if kind == "mixtral":
            config: Any = MixtralConfig(
                hidden_size=hidden,
                intermediate_size=inner,
                num_local_experts=experts,
                num_experts_per_tok=top_k,
            )
            block: Any = MixtralSparseMoeBlock(config)
        else:
            config = Qwen3MoeConfig(
                hidden_size=hidden,
                moe_intermediate_size=inner,
                num_experts=experts,
                num_experts_per_tok=top_k,
                norm_topk_prob=kind == "qwen3-moe-renormalised",
            )
            block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, parameter.shape[-1] ** -0.5 if std is None else std)
    return block.eval()


@interpreter_case
@pytest.mark.parametrize("kind", ["qwen3-moe", "qwen3-moe-renormalised", "mixtral"])
@pytest.mark.parametrize("tokens", [1, 7, 37])
def test_the_fused_moe_equals_the_expert_loop_and_transformers(kind: str, tokens: int) -> None:
    # Widths that are not multiples of the kernel's blocks (16 rows, 64 columns, 32 inner).
    block = moe_block(kind, hidden=48, inner=40, experts=6, top_k=2)
    top_k, renormalize = 2, kind != "qwen3-moe"
    loop = SparseMoE(block, top_k, renormalize, TORCH_LOOP)
    fused = SparseMoE(block, top_k, renormalize, TRITON)
    normed = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(tokens))
    residual = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(tokens + 1))
    with torch.no_grad():
        reference = residual + block(normed.unsqueeze(0)).reshape(tokens, 48)
        by_loop = loop.plus(normed, residual)
        by_kernel = fused.plus(normed, residual)
    torch.testing.assert_close(by_loop, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(by_kernel, by_loop, rtol=0, atol=1e-5)


@interpreter_case
def test_the_fused_moe_with_many_experts_and_one_token_as_a_decode_step() -> None:
    # Qwen3-30B-A3B's routing at a small width: 8 of 128 experts for one token.
    block = moe_block("qwen3-moe-renormalised", hidden=32, inner=16, experts=128, top_k=8)
    loop = SparseMoE(block, 8, True, TORCH_LOOP)
    fused = SparseMoE(block, 8, True, TRITON)
    normed = torch.randn(1, 32, generator=torch.Generator().manual_seed(3))
    residual = torch.zeros(1, 32)
    with torch.no_grad():
        torch.testing.assert_close(
            fused.plus(normed, residual), loop.plus(normed, residual), rtol=0, atol=1e-5
        )
