"""The formats of a tool call that ``--tool-call-parser`` names (``dpserve.openai.tool_calls``
reads them out of replies): names only, so that the CLI lists them without importing the HTTP
front, and the CRD's ``spec.coordinator.toolCallParser`` enum is checked against them."""

from __future__ import annotations

from typing import Final

# <tool_call>{"name": ..., "arguments": {...}}</tool_call>: Hermes 2/3, Qwen2.5, Qwen3.
HERMES: Final = "hermes"
# {"name": ..., "parameters": {...}}; ...: Llama 3.1-3.3 with JSON tool calling.
LLAMA3_JSON: Final = "llama3_json"
TOOL_CALL_PARSERS: Final = (HERMES, LLAMA3_JSON)
