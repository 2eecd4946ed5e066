"""spec.coordinator.limits: dpserve.limits' fields as CR fields and as coordinator flags."""

from __future__ import annotations

import dataclasses

import pytest

from dpserve import flags
from dpserve.cli import build_parser
from dpserve.limits import DEFAULT_ADMISSION_LIMITS, DEFAULT_REQUEST_LIMITS
from dpserve_operator.crd import spec_field
from dpserve_operator.limits import LIMIT_FIELDS, WITHOUT_FLAG, crd_schema, flag
from dpserve_operator.manifests import coordinator_command, engine_command
from dpserve_operator.spec import InvalidSpec, parse_spec

BASE = {"model": "/models/m", "image": "ghcr.io/dpserve/runtime-cpu:0.1.0"}


def coordinator_options() -> set[str]:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return set(commands.choices["coordinator"]._option_string_actions)


def all_limit_fields() -> list[str]:
    return [
        field.name
        for defaults in (DEFAULT_REQUEST_LIMITS, DEFAULT_ADMISSION_LIMITS)
        for field in dataclasses.fields(defaults)
    ]


def test_every_limit_with_a_coordinator_flag_is_a_field() -> None:
    options = coordinator_options()
    offered = {name for name, _ in LIMIT_FIELDS.values()}
    assert offered == set(all_limit_fields()) - WITHOUT_FLAG
    assert {flag(name) for name in offered} <= options
    # When a left-out field gets its flag, it belongs in the spec: this fails to say so.
    assert not {flag(name) for name in WITHOUT_FLAG} & options


def test_the_crd_declares_the_same_fields() -> None:
    # The chart's copy is the same file (tests/unit/test_crd.py).
    assert spec_field("coordinator.limits") == crd_schema()


def test_set_limits_become_flags_the_coordinator_parses() -> None:
    limits = {"maxPromptTokens": 4096, "maxInflightPerClient": 50, "queueTimeout": 2.5}
    spec = parse_spec({**BASE, "coordinator": {"limits": limits}}, name="demo")
    command = coordinator_command(spec)
    assert command[command.index("--max-prompt-tokens") + 1] == "4096"
    assert command[command.index("--max-inflight-per-client") + 1] == "50"
    assert command[command.index("--queue-timeout") + 1] == "2.5"
    args = build_parser().parse_args(command[1:])
    assert (args.limit_max_prompt_tokens, args.max_inflight_per_client) == (4096, 50)
    assert args.queue_timeout == 2.5
    # Unset limits keep dpserve.limits' defaults: no flag at all.
    assert "--max-body-bytes" not in command
    assert build_parser().parse_args(coordinator_command(parse_spec(BASE, name="d"))[1:])


@pytest.mark.parametrize(
    "limits, problem",
    [
        ({"maxPromptTokens": 0}, "spec.coordinator.limits.maxPromptTokens: must be a positive"),
        ({"maxPromptTokens": 1.5}, "maxPromptTokens: must be a positive integer"),
        ({"queueTimeout": True}, "queueTimeout: must be a positive number"),
        ({"maxFoo": 1}, "spec.coordinator.limits.maxFoo: unknown limit"),
        ({"maxStopStrings": 17}, "maxStopStrings: must be at most 16 (what an engine accepts)"),
    ],
)
def test_invalid_limits_are_named(limits: dict[str, object], problem: str) -> None:
    with pytest.raises(InvalidSpec) as raised:
        parse_spec({**BASE, "coordinator": {"limits": limits}}, name="demo")
    assert any(problem in item for item in raised.value.problems), raised.value.problems


def test_structured_output_limits_reach_the_engines_too() -> None:
    # The engines compile the constraints: they enforce the size and time bounds themselves.
    limits = {"maxConstraintBytes": 4096, "constraintCompileTimeout": 1.5, "maxPromptTokens": 64}
    spec = parse_spec({**BASE, "coordinator": {"limits": limits}}, name="demo")
    command = engine_command("demo", "default", spec)
    assert command[command.index("--max-constraint-bytes") + 1] == "4096"
    assert command[command.index("--constraint-compile-timeout") + 1] == "1.5"
    assert "--max-prompt-tokens" not in command  # the coordinator's alone
    args = build_parser().parse_args(command[1:])
    assert flags.constraint_limits(args).max_constraint_bytes == 4096
    assert flags.constraint_limits(args).constraint_compile_timeout == 1.5
    assert flags.constraint_limits(args).constraint_mask_timeout == 0.05  # unset: the default
