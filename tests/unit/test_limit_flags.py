"""Every limit in ``dpserve.limits`` is a flag on ``http``, ``serve`` and ``coordinator``
whose default comes from there, and docs/security.md's table lists it with that default."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from dpserve import flags
from dpserve.cli import build_parser
from dpserve.limits import DEFAULT_HTTP_LIMITS, DEFAULT_REQUEST_LIMITS, HttpLimits, RequestLimits
from dpserve.openai.errors import InvalidRequest
from dpserve.openai.requests import parse_completion_request

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"

LIMITS = [
    (flags.request_limit_flag(f.name), getattr(DEFAULT_REQUEST_LIMITS, f.name))
    for f in dataclasses.fields(RequestLimits)
] + [
    (flags.http_limit_flag(f.name), getattr(DEFAULT_HTTP_LIMITS, f.name))
    for f in dataclasses.fields(HttpLimits)
]


@pytest.mark.parametrize("command", ["http", "serve", "coordinator"])
def test_every_limit_is_a_flag_with_its_default(command: str) -> None:
    required = ["--coordinator", "tcp://x:1"] if command == "http" else []
    args = build_parser().parse_args([command, *required])
    assert flags.request_limits(args) == DEFAULT_REQUEST_LIMITS
    assert flags.http_limits(args) == DEFAULT_HTTP_LIMITS


def test_flags_set_the_limits() -> None:
    args = build_parser().parse_args(
        ["serve", "--max-prompt-chars", "12", "--http-header-timeout", "2.5", "--request-timeout=9"]
    )
    assert flags.request_limits(args).max_prompt_chars == 12
    assert flags.http_limits(args).header_timeout == 2.5
    assert flags.http_limits(args).request_timeout == 9.0


def test_limits_an_engine_checks_too_may_be_raised_to_its_ceiling_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Raised to what every engine accepts (``SamplingCeilings``), a limit lets requests that
    size through the edge and the sampling parameters' own checks; past it the flag is
    refused at start, instead of requests being refused without naming the flag."""
    args = build_parser().parse_args(["serve", "--max-stop-token-ids", "1024"])
    body = {"prompt": "p", "stop_token_ids": [*range(900)]}
    params = parse_completion_request(body, flags.request_limits(args)).params
    assert len(params.stop_token_ids) == 900
    with pytest.raises(InvalidRequest, match="max_stop_token_ids=64"):
        parse_completion_request(body)  # the defaults: refused at the edge, naming the limit
    for flag, ceiling in (
        ("--max-stop-token-ids", 1024),
        ("--max-stop-strings", 16),
        ("--max-top-logprobs", 20),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", flag, str(ceiling + 1)])
        assert f"must be at most {ceiling} (what an engine accepts)" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_limit_must_be_positive(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-json-depth", value])
    assert "must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "default"), LIMITS)
def test_docs_table_lists_every_limit_with_its_default(flag: str, default: float) -> None:
    rows = [line for line in DOC.read_text().splitlines() if line.startswith(f"| `{flag}` |")]
    assert len(rows) == 1, f"docs/security.md: one table row for {flag}"
    documented = rows[0].split("|")[2].strip()
    assert re.match(rf"{re.escape(str(default))}\b", documented), (flag, default, documented)
