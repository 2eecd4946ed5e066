"""lm-evaluation-harness, a client nobody here wrote, scoring a small local multiple-choice task
through ``dpserve serve`` on the tiny model (``lm_eval --model local-completions``, no hub
download): every choice's log-likelihood comes from a completions request with ``echo``,
``logprobs`` and ``max_tokens: 0``, and must equal the transformers model's on the same tokens.

lm-eval lives in its own virtualenv (``make lm-eval``; ``make test`` builds it and passes its
path in ``DPSERVE_LM_EVAL``): its dependencies pin ``python-dateutil<3`` below what the
kubernetes client of the test environment needs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.timeout(300)

DEFAULT_LM_EVAL = Path.home() / ".cache/dpserve/lm-eval/venv/bin/lm_eval"

QUESTIONS = [
    {"question": question, "choices": choices, "answer": 0}
    for question, choices in [
        ("The capital of France is", ["Paris", "Berlin", "Rome"]),
        ("One, two, three, four,", ["five", "dog", "blue"]),
        ("The quick brown fox jumps over the lazy", ["dog", "sea"]),
        ("Water freezes at zero degrees", ["Celsius", "Kelvin"]),
        ("A week has seven", ["days", "legs", "moons"]),
        ("Cats say", ["meow", "moo"]),
    ]
]

TASK = """\
task: dpserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def lm_eval_binary() -> Path:
    configured = os.environ.get("DPSERVE_LM_EVAL")
    if configured:
        path = Path(configured)
        assert path.exists(), f"DPSERVE_LM_EVAL={configured} does not exist: run `make lm-eval`"
        return path
    if not DEFAULT_LM_EVAL.exists():
        pytest.skip(f"lm-evaluation-harness is not installed at {DEFAULT_LM_EVAL}: `make lm-eval`")
    return DEFAULT_LM_EVAL


def reference_loglikelihood(model: Any, tokenizer: Any, context: str, continuation: str) -> float:
    """What lm-eval asks for, computed with transformers. As lm-eval pairs them: the context's
    trailing spaces move to the continuation, the two are encoded whole (no special tokens)
    and the continuation is what follows the context's own tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    start = len(tokenizer.encode(context, add_special_tokens=False))
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[at - 1, whole[at]]) for at in range(start, len(whole)))


def test_lm_eval_scores_a_local_multiple_choice_task_with_exact_loglikelihoods(
    tiny_serve_url: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(question) + "\n" for question in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "dpserve_mc.yaml").write_text(TASK.format(data=data))
    out = tmp_path / "out"
    model_args = ",".join([
        "model=tiny",
        f"base_url={tiny_serve_url}/completions",
        f"tokenizer={tiny_model_path}",
        "tokenizer_backend=huggingface",
        "tokenized_requests=True",
        "num_concurrent=2",
        "max_retries=1",
    ])  # fmt: skip
    completed = subprocess.run(
        [
            str(lm_eval_binary()), "--model", "local-completions", "--model_args", model_args,
            "--tasks", "dpserve_mc", "--include_path", str(tasks), "--batch_size", "4",
            "--output_path", str(out), "--log_samples",
        ],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
             "HF_DATASETS_CACHE": str(tmp_path / "datasets")},
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    [results_file] = out.rglob("results_*.json")
    accuracy = json.loads(results_file.read_text())["results"]["dpserve_mc"]["acc,none"]
    [samples_file] = out.rglob("samples_dpserve_mc_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert sorted(sample["doc"]["question"] for sample in samples) == sorted(
        question["question"] for question in QUESTIONS
    )

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    correct = 0
    for sample in samples:
        doc = sample["doc"]
        # One log-likelihood request per choice: (the question and lm-eval's target
        # delimiter, the choice).
        pairs = [(args["arg_0"], args["arg_1"]) for args in sample["arguments"].values()]
        assert [continuation.strip() for _, continuation in pairs] == doc["choices"]
        served = [float(response[0]) for response in sample["filtered_resps"]]
        expected = [reference_loglikelihood(model, tokenizer, *pair) for pair in pairs]
        assert served == pytest.approx(expected, abs=1e-3), (doc, pairs)
        correct += max(range(len(expected)), key=expected.__getitem__) == doc["answer"]
    assert accuracy == pytest.approx(correct / len(samples))
