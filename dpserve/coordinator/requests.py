"""The coordinator's record of every request it has accepted and not yet answered."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dpserve.tokenizer import IncrementalDetokenizer


@dataclass(slots=True, eq=False)
class InflightRequest:
    request_id: int
    client: bytes
    client_request_id: int
    prompt_tokens: bytes  # packed int32
    params: dict[str, Any]  # validated SamplingParams.serialize() form, forwarded to engines as is
    stream: bool
    received_at: float
    engine: bytes | None = None
    dispatched_at: float | None = None
    # Tokens streamed back so far: a re-dispatched request continues after them.
    generated: bytearray = field(default_factory=bytearray)
    logprobs: bytearray | None = None
    prompt_logprobs: bytes | None = None  # packed, from the engine's first update
    # The text of ``generated``, in the deltas the engines sent with the tokens.
    text: list[str] = field(default_factory=list)
    # Only for engines that send no text: the coordinator decodes their tokens itself.
    detokenizer: IncrementalDetokenizer | None = None
    # Engines that died while this request was in flight there, before it produced a token
    # there (a request that is what kills engines is failed after AdmissionLimits'
    # max_dispatch_attempts of them).
    engines_died: int = 0
    progressed: bool = False  # the current engine returned tokens for it


class RequestTable:
    """Requests by server id and by (client, client request id), plus the wait queue of
    requests no engine could take yet (oldest first)."""

    def __init__(self, first_id: int) -> None:
        self.by_id: dict[int, InflightRequest] = {}
        self.by_client_key: dict[tuple[bytes, int], int] = {}
        self.queue: deque[int] = deque()
        self.next_request_id = first_id

    def __len__(self) -> int:
        return len(self.by_id)

    def new_id(self) -> int:
        request_id = self.next_request_id
        self.next_request_id += 1
        return request_id

    def add(self, request: InflightRequest) -> None:
        self.by_id[request.request_id] = request
        self.by_client_key[(request.client, request.client_request_id)] = request.request_id

    def find(self, client: bytes, client_request_id: int) -> InflightRequest | None:
        request_id = self.by_client_key.get((client, client_request_id))
        return None if request_id is None else self.by_id.get(request_id)

    def pop(self, request_id: int) -> InflightRequest | None:
        request = self.by_id.pop(request_id, None)
        if request is not None:
            del self.by_client_key[(request.client, request.client_request_id)]
        return request

    def of_client(self, client: bytes) -> list[InflightRequest]:
        return [r for r in self.by_id.values() if r.client == client]
