"""Running a test file's Triton kernel cases in Triton's interpreter, in a child process.

``TRITON_INTERPRET=1`` only works if it is set before triton is first imported (triton's own
``tl.max``/``tl.sum`` are decorated at import), and it must never leak into a process that runs
the GPU tests. So a kernel test file marks its cases ``interpreter_case`` (they run only where
the variable is set) and has one test, ``test_... = interpreter_run(__file__)``, that runs the
file again in a child process with it set.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_case = pytest.mark.skipif(
    not IN_INTERPRETER,
    reason="a kernel case: run by the file's interpreter test in a child process with "
    "TRITON_INTERPRET=1",
)
TRITON_MISSING = "triton is not installed (pip install '.[test]' brings it for the interpreter)"


def interpreter_run(test_file: str) -> Callable[[], None]:
    """The test that runs ``test_file`` with ``TRITON_INTERPRET=1``: everything in it must pass
    there but this test itself (skipped in the child)."""

    @pytest.mark.skipif(IN_INTERPRETER, reason="this process is already the interpreter run")
    def run_in_the_interpreter() -> None:
        _assert_cases_pass(test_file)

    return run_in_the_interpreter


def _assert_cases_pass(test_file: str) -> None:
    root = Path(__file__).resolve().parents[1]
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
        cwd=root,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    summary = child.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed, 1 skipped", summary), child.stdout[-2000:]
