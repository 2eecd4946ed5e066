"""A prompt the coordinator's tokenizer cannot take fails alone (issue 9: no single request may
take the service down): the batch it arrived in is tokenized again prompt by prompt, the others
are served, and the coordinator keeps running."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from dpserve.client import RequestFailed
from dpserve.coordinator import DataParallelInferenceCoordinator
from dpserve.protocol import ErrorCode
from dpserve.sampling import SamplingParams
from dpserve.tokenizer import ByteTokenizer
from tests.integration.runtime import wait_for_engines

pytestmark = pytest.mark.timeout(60)

POISON = "POISON"


class TokenizerThatFailsOnPoison(ByteTokenizer):
    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if any(POISON in text for text in texts):
            raise ValueError("this tokenizer cannot take that prompt")
        return super().encode_batch(texts)


@pytest.fixture
def coordinator(port: int) -> Iterator[DataParallelInferenceCoordinator]:
    instance = DataParallelInferenceCoordinator(None, 0, TokenizerThatFailsOnPoison(), port)
    thread = threading.Thread(target=instance.start, daemon=True)
    thread.start()
    yield instance
    instance.request_stop()
    thread.join(10)


async def test_a_prompt_the_tokenizer_rejects_fails_alone(coordinator, processes, client, port):
    processes.fake_engine(port, 0)
    await client.start()
    await wait_for_engines(client, 1)
    params = SamplingParams(num_tokens_to_generate=4)
    good = [client.add_request(f"fine {i}", params) for i in range(10)]
    poisoned = client.add_request(f"a {POISON} prompt", params)
    more = [client.add_request(f"fine too {i}", params) for i in range(10)]
    results = await asyncio.wait_for(
        asyncio.gather(*good, poisoned, *more, return_exceptions=True), 30
    )
    failure = results[len(good)]
    assert isinstance(failure, RequestFailed), failure
    assert failure.code == ErrorCode.BAD_REQUEST
    assert "tokenizer cannot encode the prompt" in failure.message
    served = results[: len(good)] + results[len(good) + 1 :]
    assert all(not isinstance(r, BaseException) for r in served), served
    assert all(len(r.generated_tokens) == 4 for r in served)
    # The coordinator is still serving.
    again = await asyncio.wait_for(client.add_request("after", params), 20)
    assert len(again.generated_tokens) == 4
    assert coordinator.status()["inflight"] == 0
