"""Structured output on CPU: xgrammar vs llguidance, mask time per token and output validity.

    python bench/grammar_mask.py [--walks 20] [--batch 64]

For each tokenizer (the tiny test model's 384-token vocabulary, SmolLM2's 49k) and each library:
compile a typical JSON schema, then run ``--walks`` random walks (a random allowed token each
step, as a random-weight model would choose: the hardest case for a constraint) and report the
mean time to fill one row's token mask, the compile time, and how many finished outputs are
valid UTF-8 that parse and validate against the schema. The batch figure fills ``--batch``
rows' masks per step (what one decode step of the engine does), to compare with a decode step.
Not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False,
}
MAX_STEPS = 400


def tokenizers() -> list[tuple[str, Any]]:
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.tiny_model import build_tiny_model

    out = [
        ("tiny (384)", AutoTokenizer.from_pretrained(build_tiny_model(Path(tempfile.mkdtemp()))))
    ]
    smollm = Path.home() / ".cache/dpserve/models/smollm2-135m-instruct"
    if smollm.exists():
        out.append(("SmolLM2 (49k)", AutoTokenizer.from_pretrained(smollm)))
    return out


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.vocab = len(tokenizer)
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab)
        started = time.perf_counter()
        self.compiled = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False
        )
        self.compile_s = time.perf_counter() - started
        self.eos = tokenizer.eos_token_id

    def new(self) -> Any:
        return self.xgr.GrammarMatcher(self.compiled)

    def allowed(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.vocab = len(tokenizer)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab)
        started = time.perf_counter()
        self.grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
        )
        self.new()
        self.compile_s = time.perf_counter() - started

    def new(self) -> Any:
        return self.llg.LLMatcher(self.tokenizer, self.grammar)

    def bitmask(self, rows: int) -> torch.Tensor:
        return torch.full((rows, (self.vocab + 31) // 32), -1, dtype=torch.int32)

    def allowed(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask.shape[1]
        matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), words * 4)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())


def allowed_tokens(bitmask: torch.Tensor, row: int, vocab: int) -> list[int]:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab].nonzero().flatten().tolist()


def walk(lib: Any, tokenizer: Any, rng: random.Random) -> tuple[float, int, bool]:
    """(seconds filling masks, tokens, valid output)"""
    matcher = lib.new()
    bitmask = lib.bitmask(1)
    tokens: list[int] = []
    spent = 0.0
    for _ in range(MAX_STEPS):
        if lib.done(matcher):
            break
        bitmask.fill_(-1)
        started = time.perf_counter()
        lib.allowed(matcher, bitmask, 0)
        spent += time.perf_counter() - started
        choices = allowed_tokens(bitmask, 0, lib.vocab)
        token = rng.choice(choices)
        if not lib.accept(matcher, token):
            return spent, len(tokens), False
        if token == tokenizer.eos_token_id:
            break
        tokens.append(token)
    raw = b"".join(_token_bytes(tokenizer, t) for t in tokens)
    try:
        jsonschema.validate(json.loads(raw.decode("utf-8")), SCHEMA)
    except (UnicodeDecodeError, ValueError, jsonschema.ValidationError):
        return spent, len(tokens), False
    return spent, max(1, len(tokens)), True


def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are moved
    to code points from 256 on."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTES = _byte_table()


def _token_bytes(tokenizer: Any, token: int) -> bytes:
    return bytes(_BYTES[c] for c in tokenizer.convert_ids_to_tokens(token))


def batch_fill(lib: Any, batch: int, steps: int, rng: random.Random, tokenizer: Any) -> float:
    """Seconds per step to fill ``batch`` rows' masks, the matchers walking at random."""
    matchers = [lib.new() for _ in range(batch)]
    bitmask = lib.bitmask(batch)
    spent = 0.0
    for _ in range(steps):
        bitmask.fill_(-1)
        started = time.perf_counter()
        for row, matcher in enumerate(matchers):
            lib.allowed(matcher, bitmask, row)
        spent += time.perf_counter() - started
        for row, matcher in enumerate(matchers):
            if lib.done(matcher):
                matchers[row] = matcher = lib.new()
                continue
            token = rng.choice(allowed_tokens(bitmask, row, lib.vocab))
            lib.accept(matcher, token)
            if token == tokenizer.eos_token_id:
                matchers[row] = lib.new()
    return spent / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--walks", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batch-steps", type=int, default=20)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for label, tokenizer in tokenizers():
        for cls in (XGrammar, LLGuidance):
            lib = cls(tokenizer)
            rng = random.Random(0)
            spent = tokens = valid = 0
            for _ in range(args.walks):
                s, n, ok = walk(lib, tokenizer, rng)
                spent += s
                tokens += n
                valid += ok
            per_step = batch_fill(lib, args.batch, args.batch_steps, rng, tokenizer)
            print(
                f"{label:14} {lib.name:10} compile {lib.compile_s * 1e3:7.1f} ms  "
                f"mask {spent / tokens * 1e6:7.1f} us/token  "
                f"batch {args.batch}: {per_step * 1e3:6.2f} ms/step  "
                f"valid {valid}/{args.walks}"
            )


if __name__ == "__main__":
    main()
