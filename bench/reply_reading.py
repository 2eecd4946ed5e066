"""What reading a chat reply costs the HTTP front's event loop: tool calls and a thought told
from the text, per streamed chunk and for a whole reply (``dpserve/openai/replies.py``).

    python bench/reply_reading.py [--tokens 4000]

A reply of ``--tokens`` chunks of about 4 characters (a token's text) goes through
``StreamedReply`` chunk by chunk, and through ``read_reply`` whole, for each reader. The
baseline, in the same run, is what every streamed chunk costs the front already: its SSE event
(``ChatFormat.chunk`` and ``sse_event``). The
texts are the readers' hard cases: a thought that runs through the whole reply with a
``<`` every few characters (each may begin a tag), and a call whose JSON is most of the reply.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from dpserve.openai.reasoning import Reasoning
from dpserve.openai.replies import StreamedReply, read_reply
from dpserve.openai.responses import ChatFormat, Choice, ResponseIds, sse_event
from dpserve.openai.tools import parse_tool_calling
from dpserve.reply_formats import HERMES, LLAMA3_JSON, QWEN3

IDS = ResponseIds("chatcmpl-bench", 0, "m")
TOOLS: list[Any] = [{"type": "function", "function": {"name": "search"}}]


def texts(tokens: int) -> dict[str, str]:
    words = "".join(f"a<b{i % 10} " for i in range(tokens))  # ~5 characters a token
    arguments = '{"query": "' + "x" * (4 * tokens) + '"}'
    return {
        "thought": "<think>" + words + "</think>Done.",
        "hermes call": "Sure. <tool_call>"
        + f'{{"name": "search", "arguments": {arguments}}}'
        + "</tool_call>",
        "llama3 call": f'{{"name": "search", "parameters": {arguments}}}',
    }


CASES = {
    # name: (reasoning parser, tool-call parser, text)
    "baseline: the chunk's SSE event": (None, None, "thought"),
    "qwen3 thought": (QWEN3, None, "thought"),
    "hermes, text with '<'": (None, HERMES, "thought"),
    "hermes call": (None, HERMES, "hermes call"),
    "llama3_json call": (None, LLAMA3_JSON, "llama3 call"),
    "qwen3 + hermes call": (QWEN3, HERMES, "hermes call"),
}


def chunks_of(text: str, size: int = 4) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    replies = texts(args.tokens)
    print("| reader | chars | chunks | µs a chunk, streamed | ms a whole reply |")
    print("|---|---:|---:|---:|---:|")
    for name, (reasoning_parser, tool_parser, text_name) in CASES.items():
        text = replies[text_name]
        chunks = chunks_of(text)
        reasoning = Reasoning(reasoning_parser) if reasoning_parser else None
        calling = parse_tool_calling({"tools": TOOLS}, tool_parser) if tool_parser else None
        streamed, whole = [], []
        for _ in range(args.repeat):
            start = time.perf_counter()
            if reasoning is None and calling is None:
                for chunk in chunks:
                    sse_event(ChatFormat().chunk(IDS, Choice(0, chunk, None)))
            else:
                reply = StreamedReply(reasoning, calling)
                for chunk in chunks:
                    reply.feed(chunk)
                reply.close("stop")
            streamed.append((time.perf_counter() - start) / len(chunks) * 1e6)
            start = time.perf_counter()
            read_reply(reasoning, calling, text, "stop")
            whole.append((time.perf_counter() - start) * 1e3)
        print(
            f"| {name} | {len(text):,} | {len(chunks):,} | {statistics.median(streamed):.2f} "
            f"| {statistics.median(whole):.2f} |"
        )


if __name__ == "__main__":
    main()
