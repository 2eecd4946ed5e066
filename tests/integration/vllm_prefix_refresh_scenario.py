"""Run by ``test_vllm_prefix_refresh.py`` in vLLM's own install: a cached prefix that a request
waits for in vLLM's queue, while the running request's growth evicts free blocks, with and
without ``VllmRunner._refresh_cached_prefix``. Prints one JSON object: the tokens the waiting
request found cached in each case, and the pool's size.

    python tests/integration/vllm_prefix_refresh_scenario.py MODEL_DIR

The pool holds ``BLOCKS`` blocks of 32 tokens and vLLM runs one request at a time, so the order
of the pool's free queue decides which cached blocks are evicted:
1. prompt P (4 blocks) runs and finishes: P's 4 blocks cached and free;
2. prompt Q (4 other blocks) does the same: Q's are freed after P's, so evicted after them;
3. a long request R arrives, then a request for P (P plus a few tokens), which waits while R
   runs; R's prompt and output need every never-used block and 2 more, taken from the front of
   the free queue;
4. the waiting request runs and reports how many prompt tokens vLLM found cached.
vLLM's own order evicts half of P (P's tail blocks first), so it finds 64 tokens; with the
refresh, P's blocks move behind Q's on arrival and Q's go instead: it finds all 128.
"""

from __future__ import annotations

import json
import sys

from dpserve.engine.runner import RunnerRequest
from dpserve.engine.vllm.engine_args import VllmOptions
from dpserve.engine.vllm.runner import VllmRunner
from dpserve.sampling import SamplingParams

BLOCK = 32
BLOCKS = 15


def prompt(first: int, blocks: int, extra: int = 0) -> list[int]:
    """Token ids of ``blocks`` whole blocks (and ``extra`` tokens), distinct per ``first``."""
    return [3 + (first * 7 + i) % 200 for i in range(blocks * BLOCK + extra)]


def found_cached(runner: VllmRunner, refresh: bool, base: int) -> int:
    if not refresh:
        runner._refresh_cached_prefix = lambda vllm_id: None  # type: ignore[method-assign]
    one = SamplingParams(temperature=0.0, num_tokens_to_generate=1, ignore_eos=True)

    def drain(*requests: RunnerRequest) -> dict[int, int | None]:
        for request in requests:
            runner.add(request)
        cached: dict[int, int | None] = {}
        while runner.has_work():
            for update in runner.step():
                if update.cached_tokens is not None:
                    cached[update.request_id] = update.cached_tokens
        return cached

    p, q = prompt(base + 1, 4), prompt(base + 2, 4)
    drain(RunnerRequest(base + 1, p, one))
    drain(RunnerRequest(base + 2, q, one))
    free = int(runner.stats()["kv_free_blocks"])  # never used, plus P's and Q's cached blocks
    # R: every never-used block and 2 cached ones, its prompt whole blocks, then its output.
    r_blocks = free - 8 + 2
    r_prompt = prompt(base + 3, r_blocks - 1)
    long = SamplingParams(temperature=0.0, num_tokens_to_generate=BLOCK, ignore_eos=True)
    # R first, then the request for P, which waits while R runs (one request at a time).
    waiting = RunnerRequest(base + 4, prompt(base + 1, 4, extra=5), one)
    return drain(RunnerRequest(base + 3, r_prompt, long), waiting)[base + 4] or 0


def main() -> None:
    model = sys.argv[1]
    results = {}
    for index, refresh in enumerate((False, True)):
        runner = VllmRunner(
            VllmOptions(
                model,
                max_num_seqs=1,
                block_size=BLOCK,
                kv_cache_bytes=BLOCKS * BLOCK * 2 * 2 * 64 * 4,  # 2 layers, K and V, 1 head of 64
                eager=True,
            )
        )
        results["blocks"] = int(runner.stats()["kv_blocks"])
        results["refresh" if refresh else "vllm_order"] = found_cached(runner, refresh, index * 10)
        runner.release()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
