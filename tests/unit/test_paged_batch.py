"""The persistent batch builder gives, step after step, exactly the tensors a from-scratch
rebuild from the sequences' Python lists gives (the way the engine built them before): for
decodes, prefill chunks that start at 0 and chunks that start later (chunked prefill, a
prefix-cache hit), rows that are reused after a sequence leaves, and blocks appended over time.
"""

from __future__ import annotations

import random

import torch

from dpserve.engine.paged.batch import BatchBuilder, apply_pending
from dpserve.engine.paged.scheduler import PrefillChunk, StepPlan
from dpserve.engine.runner import RunnerRequest
from dpserve.engine.sequences import Sequence
from dpserve.sampling import SamplingParams

BLOCK = 4


def sequence(request_id: int, prompt_length: int, rng: random.Random) -> Sequence:
    prompt = [rng.randrange(5, 300) for _ in range(prompt_length)]
    return Sequence(
        RunnerRequest(request_id, prompt, SamplingParams()), SamplingParams(), 99, frozenset()
    )


def reference(plan: StepPlan[Sequence]) -> dict[str, list[int] | list[list[int]]]:
    """The tensors rebuilt from lists, as the engine did before the builder kept them."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for s in plan.decodes:
        p = s.num_cached
        ids.append(s.token_at(p))
        positions.append(p)
        slots.append(s.blocks[p // BLOCK] * BLOCK + p % BLOCK)
    width = max((-(-(s.num_cached + 1) // BLOCK) for s in plan.decodes), default=0)
    tables = [(s.blocks + [0] * width)[:width] for s in plan.decodes]
    lens = [s.num_cached + 1 for s in plan.decodes]
    logit_rows = list(range(len(plan.decodes)))
    for chunk in plan.prefills:
        end = chunk.start + chunk.length
        ids += chunk.sequence.tokens_between(chunk.start, end)
        positions += range(chunk.start, end)
        slots += [
            chunk.sequence.blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(chunk.start, end)
        ]
        if chunk.completes_prefill:
            logit_rows.append(len(ids) - 1)
    return {
        "ids": ids,
        "positions": positions,
        "slots": slots,
        "tables": tables,
        "lens": lens,
        "logit_rows": logit_rows,
    }


def test_builder_matches_a_rebuild_from_lists_step_after_step() -> None:
    rng = random.Random(4)
    builder: BatchBuilder[Sequence] = BatchBuilder(8, 64, BLOCK, torch.device("cpu"))
    next_block = iter(range(1, 10_000))
    running: list[Sequence] = []
    next_id = 0
    # What the last step sampled (the builder feeds it when those sequences decode next), and
    # how many steps decoded the same sequences as the step before: the builder then carries
    # their rows, positions and tokens over instead of reading them.
    last_sampled: tuple[list[Sequence], list[int]] | None = None
    previous_decodes: list[Sequence] = []
    carried = odd_steps = 0
    for step in range(60):
        # Some sequences leave (their rows are reused), new ones arrive, some mid-prefill.
        for s in [s for s in running if rng.random() < 0.08]:
            running.remove(s)
            builder.release(s)
            previous_decodes = []
        while len(running) < 8 and rng.random() < 0.5:
            s = sequence(next_id, rng.randint(1, 40), rng)
            next_id += 1
            # A prefix-cache hit or an earlier chunk: the first scheduled token is not 0.
            s.num_cached = rng.choice([0, 0, rng.randrange(0, s.context_length())])
            running.append(s)
        plan: StepPlan[Sequence] = StepPlan()
        for s in running:
            remaining = s.context_length() - s.num_cached
            needed = -(-(s.num_cached + min(remaining, 7)) // BLOCK) - len(s.blocks)
            s.blocks += [next(next_block) for _ in range(max(0, needed))]
            if remaining == 1:
                plan.decodes.append(s)
                if needed > 0:
                    plan.grown.append(s)  # as the scheduler reports them
            else:
                plan.prefills.append(PrefillChunk(s, s.num_cached, min(remaining, 7)))
        if not plan:
            continue
        carried += bool(plan.decodes) and plan.decodes == previous_decodes
        built, late = builder.build(plan, None, last_sampled)
        previous_decodes = plan.decodes
        assert late is None
        batch = built.batch
        expected = reference(plan)
        assert batch.input_ids.tolist() == expected["ids"], step
        assert batch.positions.tolist() == expected["positions"], step
        assert batch.slot_mapping.tolist() == expected["slots"], step
        assert batch.num_decodes == len(plan.decodes)
        # Each tensor sent starts on a 16-byte boundary of the one buffer (Triton compiles a
        # kernel per pointer alignment: the start-up warm-up runs aligned ones only).
        for name, sent in {
            "positions": batch.positions,
            "slots": batch.slot_mapping,
            "lens": batch.seq_lens,
        }.items():
            if sent is not None:
                assert (sent.data_ptr() - batch.input_ids.data_ptr()) % 16 == 0, (step, name)
        odd_steps += len(expected["ids"]) % 2
        if plan.decodes:
            assert batch.block_tables is not None and batch.seq_lens is not None
            assert batch.block_tables.tolist() == expected["tables"], step
            assert batch.seq_lens.tolist() == expected["lens"], step
        if plan.prefills:
            assert batch.logits_indices is not None
            assert batch.logits_indices.tolist() == expected["logit_rows"], step
            for chunk, prefill in zip(plan.prefills, batch.prefills, strict=True):
                assert prefill.cached == chunk.start
                if chunk.start:
                    assert prefill.blocks is not None
                    covering = -(-(chunk.start + chunk.length) // BLOCK)
                    assert prefill.blocks.tolist() == chunk.sequence.blocks[:covering]
        assert built.sampled == plan.decodes + [
            c.sequence for c in plan.prefills if c.completes_prefill
        ]
        # The step ran: commit as the scheduler does, and give finished prefills a token.
        for s in plan.decodes:
            s.num_cached += 1
            s.tokens.append(rng.randrange(5, 300))
        for chunk in plan.prefills:
            chunk.sequence.num_cached = chunk.start + chunk.length
            if chunk.completes_prefill:
                chunk.sequence.tokens.append(rng.randrange(5, 300))
        last_sampled = (built.sampled, [s.tokens[-1] for s in built.sampled])
    assert carried >= 10
    assert odd_steps >= 10  # steps of an odd token count, where a segment could start mid-way


def test_pending_tokens_are_fed_from_the_device() -> None:
    rng = random.Random(1)
    builder: BatchBuilder[Sequence] = BatchBuilder(4, 16, BLOCK, torch.device("cpu"))
    first, second = sequence(0, 5, rng), sequence(1, 9, rng)
    for s in (first, second):
        s.blocks = [1 + s.request_id * 4, 2 + s.request_id * 4, 3 + s.request_id * 4]
        s.num_cached = s.context_length()
        s.pending = 1  # sampled by the step in flight, not on the host yet
    # New to the builder as decodes: listed as grown, their tables are written.
    plan: StepPlan[Sequence] = StepPlan(decodes=[first, second], grown=[first, second])
    built, late = builder.build(plan, {second: 0, first: 1})
    assert late is not None
    previous_tokens = torch.tensor([77, 66])  # the step in flight sampled these
    apply_pending(built.batch, late, previous_tokens)
    assert built.batch.input_ids.tolist() == [66, 77]
    assert built.batch.positions.tolist() == [5, 9]
