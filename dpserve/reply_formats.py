"""How a model writes tool calls and reasoning into its replies, as the HTTP front reads them
(``--tool-call-parser``, ``--reasoning-parser``): names only, so that the CLI lists them without
importing the HTTP front, and the CRD's enums are checked against them. The readers are
``dpserve.openai.tool_calls`` and ``dpserve.openai.reasoning``."""

from __future__ import annotations

import dataclasses
from typing import Final

# <tool_call>{"name": ..., "arguments": {...}}</tool_call>: Hermes 2/3, Qwen2.5, Qwen3.
HERMES: Final = "hermes"
# {"name": ..., "parameters": {...}}; ...: Llama 3.1-3.3 with JSON tool calling.
LLAMA3_JSON: Final = "llama3_json"
TOOL_CALL_PARSERS: Final = (HERMES, LLAMA3_JSON)

# <think>...</think> first (the opening tag optional): DeepSeek-R1 and its distills, QwQ.
DEEPSEEK_R1: Final = "deepseek_r1"
# The same, unless the request turned thinking off (chat_template_kwargs.enable_thinking
# false); a <tool_call> also ends the thought: Qwen3.
QWEN3: Final = "qwen3"
REASONING_PARSERS: Final = (DEEPSEEK_R1, QWEN3)


@dataclasses.dataclass(frozen=True, slots=True)
class ReplyParsers:
    """The formats a server reads out of chat replies; None: not read."""

    tool_calls: str | None = None  # --tool-call-parser: tool_choice auto's calls
    reasoning: str | None = None  # --reasoning-parser: the thought, as message.reasoning


NO_REPLY_PARSERS: Final = ReplyParsers()
