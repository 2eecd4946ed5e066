"""Tiny random LoRA adapters made with ``peft`` for a tiny model directory, and the reference
they are checked against: transformers + peft with the adapter merged into the weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_MODULES = ALL_MODULES[:4]


def make_adapter(
    base: Path,
    directory: Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: float = 16,
    rslora: bool = False,
    modules: tuple[str, ...] = ALL_MODULES,
    spread: float = 0.3,
) -> Path:
    """A PEFT LoRA directory for the model in ``base`` with random A and B (B is zeros after
    PEFT's usual init; non-zero here, so the adapter changes the output)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=list(modules))
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * spread)
    peft_model.save_pretrained(directory)
    return directory


def merged_model(base: Path, adapter: Path | None) -> Any:
    """The base model with ``adapter`` merged into its weights (the base model for None)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base).eval()
    if adapter is None:
        return model
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


def reference_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """``generate``'s greedy tokens after ``prompt`` (EOS ignored)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
    return [int(token) for token in out[0, len(prompt) :]]


def reference_logprobs(model: Any, prompt: list[int], generated: list[int]) -> list[float]:
    """The log-prob of each generated token under ``model`` (one forward over everything)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [float(logprobs[start + i, token]) for i, token in enumerate(generated)]
