"""``ResumedPenalties``: presence and frequency penalties that count a resumed request's tokens
as generated, inside vLLM's sampler (a vLLM logits processor, loaded by its workers).

A request re-dispatched after its engine died reaches vLLM with the tokens already streamed
(``resume_tokens``) at the end of its prompt, and vLLM's presence and frequency penalties count
only its own output: without this processor the continuation would differ from the
uninterrupted run. dpserve's engine and vLLM both apply ``repetition_penalty`` (over prompt and
output) first and subtract ``frequency x count`` and ``presence`` (once) over the output after
it. For a resumed request with those penalties the runner passes its repetition penalty here
(vLLM's set to 1) with the number of resumed tokens (``RESUMED_PENALTIES``, in
``SamplingParams.extra_args``); vLLM runs this processor before its own penalties, so this one
applies the repetition penalty and the part of presence and frequency that the resumed tokens
add, and vLLM subtracts the part its own output adds:

    repetition(x) - f * (resumed + output) - p * [resumed + output > 0]
      = [repetition(x) - f * resumed - p * [resumed > 0 and output == 0]]     (here)
        - f * output - p * [output > 0]                                       (vLLM)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Final

import torch

# The key in vLLM's ``SamplingParams.extra_args``: {"resumed": count, "repetition": penalty}.
RESUMED_PENALTIES: Final = "dpserve_resumed_penalties"
# What vLLM loads by name in its workers (``--logits-processors``).
QUALIFIED_NAME: Final = f"{__name__}:ResumedPenalties"


def resumed_penalties_args(resumed: int, repetition_penalty: float) -> dict[str, Any]:
    """The ``extra_args`` entry the runner sends with a resumed request that has presence or
    frequency penalties (vLLM's own repetition penalty then set to 1)."""
    return {RESUMED_PENALTIES: {"resumed": resumed, "repetition": repetition_penalty}}


@dataclass(frozen=True, slots=True)
class PenalizedRow:
    prompt: list[int]  # prompt + resumed tokens, as vLLM has them
    resumed: int
    output: list[int]  # vLLM's running list of this request's tokens (-1: not copied back yet)
    presence: float
    frequency: float
    repetition: float


def penalized_row(params: Any, prompt: list[int] | None, output: list[int]) -> PenalizedRow | None:
    """A request's row state from vLLM's ``SamplingParams``; None when it has nothing here."""
    spec: Any = (params.extra_args or {}).get(RESUMED_PENALTIES)
    if spec is None or prompt is None:
        return None
    return PenalizedRow(
        prompt,
        int(spec["resumed"]),
        output,
        float(params.presence_penalty),
        float(params.frequency_penalty),
        float(spec["repetition"]),
    )


def penalized(scores: torch.Tensor, row: PenalizedRow) -> torch.Tensor:
    """One row of logits with the repetition penalty and the resumed tokens' part of presence
    and frequency applied (the formula above)."""
    vocab = scores.shape[0]
    device = scores.device
    output = torch.tensor([t for t in row.output if 0 <= t < vocab], dtype=torch.int64)
    resumed = torch.tensor(row.prompt[len(row.prompt) - row.resumed :], dtype=torch.int64)
    output_counts = torch.bincount(output, minlength=vocab).to(device)
    resumed_counts = torch.bincount(resumed, minlength=vocab).to(device, torch.float32)
    if row.repetition != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[torch.tensor(row.prompt, dtype=torch.int64, device=device)] = True
        seen |= output_counts > 0
        repeated = torch.where(scores > 0, scores / row.repetition, scores * row.repetition)
        scores = torch.where(seen, repeated, scores)
    only_resumed = (resumed_counts > 0) & (output_counts == 0)
    return scores - row.frequency * resumed_counts - row.presence * only_resumed.float()


@functools.cache
def _processor_class() -> type:
    """vLLM's ``LogitsProcessor`` subclass, built when vLLM first asks for it (this module
    imports without vLLM, as the package's other modules do)."""
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class ResumedPenalties(LogitsProcessor):  # type: ignore[misc]  # vLLM is Any to mypy here
        def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
            self._rows: dict[int, PenalizedRow] = {}  # by index in vLLM's batch

        def is_argmax_invariant(self) -> bool:
            return False  # penalties change which token is greedy

        def update_state(self, batch_update: Any) -> None:
            process_dict_updates(self._rows, batch_update, penalized_row)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            for index, row in self._rows.items():
                logits[index] = penalized(logits[index], row)
            return logits

    ResumedPenalties.__module__ = __name__
    ResumedPenalties.__qualname__ = "ResumedPenalties"
    return ResumedPenalties


def __getattr__(name: str) -> Any:
    if name == "ResumedPenalties":  # what vLLM's loader looks up (``QUALIFIED_NAME``)
        return _processor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
