"""Tool calling, the request side: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a
chat request -> a ``ToolCalling`` (pure, no I/O).

What each ``tool_choice`` asks of generation, as vLLM does it:

* ``none``: the tools are shown to the model (the chat template renders them) and the reply is
  plain text;
* a named function (``{"type": "function", "function": {"name": ...}}``): the reply is that
  function's arguments, constrained to its ``parameters`` schema (structured output);
* ``required``: the reply is a JSON list of calls ``[{"name", "parameters"}, ...]``, each
  constrained to one tool's schema (one call when ``parallel_tool_calls`` is false);
* ``auto`` (OpenAI's default when tools are given): the model chooses, in its own format, which
  ``--tool-call-parser`` names (``tool_calls.PARSERS``); without that flag it is refused, since
  this server could not tell a call from text.

Sizes need no limit of their own: the tools' text is part of the rendered prompt
(``max_prompt_chars``) and the schema a choice builds is a constraint (``max_constraint_bytes``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Final

from dpserve.openai.errors import InvalidRequest
from dpserve.openai.values import json_type, read_bool

# OpenAI's rule for a function's name.
_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A function without ``parameters`` takes none: an empty object, nothing else.
_NO_PARAMETERS: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {},
    "additionalProperties": False,
}


class ToolChoice(StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "function"  # one function, named in the request


@dataclasses.dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: Mapping[str, Any]  # its JSON schema


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCalling:
    """A chat request's tools and what it asks of them."""

    tools: tuple[Tool, ...]
    # As the chat template takes them: the request's own ``tools`` objects.
    template_tools: tuple[Mapping[str, Any], ...]
    choice: ToolChoice
    named: str | None = None  # the function of ``ToolChoice.NAMED``
    parallel: bool = True
    parser: str | None = None  # ``auto``'s output format (``--tool-call-parser``)

    @property
    def chars(self) -> int:
        """The tools' size as compact JSON: what a template writes of them, about."""
        return len(_compact(self.template_tools))

    @property
    def constrained(self) -> bool:
        """The reply is JSON of a schema this module builds (``constraint``)."""
        return self.choice in (ToolChoice.NAMED, ToolChoice.REQUIRED)

    @property
    def parses_calls(self) -> bool:
        """The reply may hold calls to take out of its text."""
        return self.choice != ToolChoice.NONE

    def constraint(self) -> str | None:
        """The compact JSON schema the reply must follow (guided_json), or None."""
        if self.choice == ToolChoice.NAMED:
            [tool] = [tool for tool in self.tools if tool.name == self.named]
            return _compact(tool.parameters)
        if self.choice == ToolChoice.REQUIRED:
            calls: dict[str, Any] = {
                "type": "array",
                "minItems": 1,
                "items": {"anyOf": [_call_schema(tool) for tool in self.tools]},
            }
            if not self.parallel:
                calls["maxItems"] = 1
            return _compact(calls)
        return None


def parse_tool_calling(body: Mapping[str, Any], parser: str | None) -> ToolCalling | None:
    """The request's tool calling, or None when it sends no tools (then ``tool_choice`` may
    only be ``none``)."""
    tools_value = body.get("tools")
    choice_value = body.get("tool_choice")
    if tools_value is None or tools_value == []:
        if choice_value not in (None, ToolChoice.NONE):
            raise InvalidRequest("tool_choice other than 'none' needs tools", param="tool_choice")
        if body.get("parallel_tool_calls") is not None:
            read_bool(body, "parallel_tool_calls", default=True)
        return None
    tools, template_tools = _tools(tools_value)
    choice, named = _choice(choice_value, {tool.name for tool in tools})
    if choice == ToolChoice.AUTO and parser is None:
        raise InvalidRequest(
            "tool_choice 'auto' (the default when tools are given) needs the server started "
            "with --tool-call-parser (the model's format of a call); send tool_choice "
            "'required', 'none' or a named function, which need no parser",
            param="tool_choice",
            code="unsupported_field",
        )
    calling = ToolCalling(
        tools,
        template_tools,
        choice,
        named,
        read_bool(body, "parallel_tool_calls", default=True),
        parser if choice == ToolChoice.AUTO else None,
    )
    if calling.constrained and _other_constraint(body):
        raise InvalidRequest(
            f"tool_choice {choice_value!r} constrains the reply to a tool call: it cannot be "
            "sent with response_format or guided_* as well",
            param="tool_choice",
        )
    return calling


def _tools(value: object) -> tuple[tuple[Tool, ...], tuple[Mapping[str, Any], ...]]:
    if not isinstance(value, list):
        raise InvalidRequest(f"tools must be a list, got {json_type(value)}", param="tools")
    tools: list[Tool] = []
    for index, entry in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise InvalidRequest(
                f"{where} must be {{type: 'function', function: {{name, description, "
                "parameters}}}",
                param=where,
            )
        function = entry.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest(f"{where}.function must be an object", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequest(
                f"{where}.function.name must be 1-64 letters, digits, '_' or '-'",
                param=f"{where}.function.name",
            )
        if any(tool.name == name for tool in tools):
            raise InvalidRequest(
                f"{where}.function.name {name!r} names a tool twice",
                param=f"{where}.function.name",
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequest(
                f"{where}.function.description must be a string",
                param=f"{where}.function.description",
            )
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequest(
                f"{where}.function.strict must be true or false", param=f"{where}.function.strict"
            )
        parameters = function.get("parameters")
        if parameters is None:
            parameters = _NO_PARAMETERS
        elif not isinstance(parameters, dict):
            raise InvalidRequest(
                f"{where}.function.parameters must be a JSON schema object",
                param=f"{where}.function.parameters",
            )
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"}) or sorted(
            set(entry) - {"type", "function"}
        )
        if unknown:
            raise InvalidRequest(
                f"{where} has an unknown field {unknown[0]!r}", param=where, code="unknown_field"
            )
        tools.append(Tool(name, parameters))
    return tuple(tools), tuple(value)


def _choice(value: object, names: set[str]) -> tuple[ToolChoice, str | None]:
    if value is None:
        return ToolChoice.AUTO, None
    if isinstance(value, str) and value in (ToolChoice.NONE, ToolChoice.AUTO, ToolChoice.REQUIRED):
        return ToolChoice(value), None
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidRequest(
                "tool_choice {type: 'function'} needs function: {name}",
                param="tool_choice.function.name",
            )
        if name not in names:
            raise InvalidRequest(
                f"tool_choice names {name!r}, which is not one of the tools",
                param="tool_choice.function.name",
            )
        return ToolChoice.NAMED, name
    raise InvalidRequest(
        "tool_choice must be 'none', 'auto', 'required' or {type: 'function', function: {name}}",
        param="tool_choice",
    )


def _call_schema(tool: Tool) -> dict[str, Any]:
    """One call in ``required``'s list (vLLM's shape: name and parameters)."""
    return {
        "type": "object",
        "properties": {"name": {"enum": [tool.name]}, "parameters": tool.parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def _other_constraint(body: Mapping[str, Any]) -> bool:
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return True
    return any(
        body.get(key) is not None for key in ("guided_json", "guided_regex", "guided_choice")
    )


def _compact(schema: object) -> str:
    return json.dumps(schema, separators=(",", ":"))
