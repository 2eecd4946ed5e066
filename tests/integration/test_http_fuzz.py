"""Issue 9, "Also": a property test over HTTP bodies against a real front with fake engines.

Every answer is a 2xx, or a 4xx JSON body in OpenAI's error shape; never a 5xx. Afterwards the
server still serves and ``/metrics`` shows nothing in flight. Bodies mix well-formed fields
(sampling parameters over their whole range: tiny, huge, subnormal, boundary values) with
arbitrary JSON, unknown fields and raw bytes. Bounded: about 200 examples, a few seconds.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.http_support import Cluster, error_of, http_json, metric, start_cluster
from tests.integration.runtime import Processes
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(180)

MAX_NEW_TOKENS = 64  # the fuzzed front's --max-new-tokens: every accepted request is short

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
numbers = st.one_of(
    st.floats(min_value=0, max_value=2, allow_subnormal=True),
    st.sampled_from([0, 1e-300, 5e-324, 1e-50, 1e-5, 0.99999, 1, 2, 1e308, -1e-9, -0.0]),
    st.integers(min_value=-3, max_value=3),
)
texts = st.text(max_size=30)  # includes lone surrogates: json.dumps writes them as escapes


def message_lists(content: st.SearchStrategy) -> st.SearchStrategy:
    role = st.sampled_from(["user", "system", "assistant"])
    return st.lists(st.fixed_dictionaries({"role": role, "content": content}), max_size=3)


def bodies(wild: bool) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    """Completion and chat bodies: with ``wild``, any field may hold arbitrary JSON and
    unknown fields appear; without, every field holds a value of its own kind."""

    def field(strategy: st.SearchStrategy) -> st.SearchStrategy:
        return strategy | json_values if wild else strategy

    fields = {
        "model": field(st.just("fake")),
        "max_tokens": field(st.integers(min_value=-1, max_value=MAX_NEW_TOKENS + 1)),
        "temperature": field(numbers),
        "top_p": field(numbers),
        "top_k": field(st.integers(min_value=-2, max_value=300)),
        "seed": field(st.integers(min_value=-1, max_value=2**64)),
        "stop": field(st.lists(texts, max_size=3) | texts),
        "stream": field(st.booleans()),
        "stream_options": field(
            st.fixed_dictionaries(
                {},
                optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()},
            )
        ),
        "logprobs": field(st.booleans() | st.integers(min_value=-1, max_value=2)),
        "ignore_eos": field(st.booleans()),
        "min_tokens": field(st.integers(min_value=-1, max_value=8)),
        "n": field(st.integers(min_value=0, max_value=3)),
        "user": field(texts),
        "presence_penalty": field(st.floats(min_value=-3, max_value=3)),
        "frequency_penalty": field(st.floats(min_value=-3, max_value=3)),
        "repetition_penalty": field(numbers),
        "response_format": field(
            st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "yaml"}])
            | st.builds(
                lambda schema: {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": schema},
                },
                st.sampled_from(
                    [{"type": "object"}, {"type": "integer", "minimum": 0}, {"type": 5}]
                )
                | json_values,
            )
        ),
        "guided_choice": field(st.lists(texts, max_size=3)),
        "guided_regex": field(st.sampled_from(["[0-9]+", "(a|b", "x{2,}"])),
    }
    extra = {"unknown_field": json_values} if wild else {}
    prompts = st.text(min_size=0 if wild else 1, max_size=30) | st.lists(
        st.integers(min_value=-1 if wild else 0, max_value=300), min_size=0 if wild else 1
    )
    completion = st.fixed_dictionaries(
        {"prompt": field(prompts | st.lists(prompts, max_size=3))},
        optional={
            **fields,
            **extra,
            "echo": field(st.booleans()),
            "best_of": field(st.integers(min_value=0, max_value=4)),
            "logprobs": field(st.booleans() | st.integers(min_value=-1, max_value=21)),
        },
    )
    chat = st.fixed_dictionaries(
        {"messages": field(message_lists(texts | json_values if wild else texts))},
        optional={
            **fields,
            **extra,
            "max_completion_tokens": fields["max_tokens"],
            "logprobs": field(st.booleans()),
            "top_logprobs": field(st.integers(min_value=-1, max_value=21)),
        },
    )
    return completion, chat


def as_requests(completion: st.SearchStrategy, chat: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(st.just("/v1/completions"), completion.map(json.dumps)) | st.tuples(
        st.just("/v1/chat/completions"), chat.map(json.dumps)
    )


requests = (
    as_requests(*bodies(wild=False))
    | as_requests(*bodies(wild=True))
    | st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.text())
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    processes = Processes(tmp_path_factory.mktemp("http-fuzz"))
    try:
        yield start_cluster(
            processes, f"--max-new-tokens={MAX_NEW_TOKENS}", "--request-timeout=20", step_delay=0
        )
    finally:
        processes.cleanup()


def post(url: str, body: str) -> tuple[int, str, bytes]:
    data = body.encode("utf-8", "surrogatepass")
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.headers.get("Content-Type", ""), reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("Content-Type", ""), error.read()


def check_answer(status: int, content_type: str, payload: bytes) -> None:
    assert status < 500, (status, payload[:500])
    if status >= 400:
        error = error_of(json.loads(payload))
        assert error["type"] == "invalid_request_error", error
    elif content_type.startswith("text/event-stream"):
        events = [line[6:] for line in payload.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert json.loads(payload)["choices"], payload[:500]


def test_fuzzed_bodies_get_2xx_or_4xx_in_openai_shape(cluster: Cluster) -> None:
    fuzz_the_front(cluster.base_url, examples=200)


def fuzz_the_front(base_url: str, examples: int) -> None:
    """``examples`` fuzzed requests to the front at ``base_url``: each a 2xx or a 4xx in
    OpenAI's shape, both kinds reached; then the front is ready with nothing in flight."""

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(requests)
    def one_request(request: tuple[str, str]) -> None:
        endpoint, body = request
        answer = post(f"{base_url}{endpoint}", body)
        statuses.add(answer[0] // 100)
        check_answer(*answer)

    statuses: set[int] = set()
    one_request()
    assert statuses == {2, 4}, f"the fuzz must reach accepted and refused requests: {statuses}"

    # Still up, and nothing left in flight anywhere.
    assert http_json(f"{base_url}/ready")[0] == 200

    def idle() -> bool:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        return (
            metric(text, "dpserve_coordinator_inflight_requests") == 0
            and metric(text, "dpserve_http_inflight_requests") == 0
        )

    wait_until(idle, 10, "nothing in flight")
