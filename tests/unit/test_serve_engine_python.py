"""``dpserve serve --backend vllm`` asks the engines' Python whether it can import vLLM and
dpserve before starting any engine: one that cannot is refused in a second, with what it lacks
and how to get vLLM's install (``make vllm``), instead of engines that die at start until serve
counts a crash loop (~30 s of tracebacks). Real interpreters, no mocks: this install's (no vLLM
in it), one with no site-packages at all (no dpserve either), a path that is no program, and
vLLM's own install, which passes. ``dpserve engine --backend vllm`` in a Python without vLLM
says so in one line."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

from dpserve.cli import main
from dpserve.cli.common import VLLM_INSTALL_HINT
from dpserve.cli.serve import _vllm_python_error
from dpserve.local import child_environment


def refusal(capsys: pytest.CaptureFixture[str], engine_python: str) -> str:
    started = time.monotonic()
    code = main(["serve", "--backend", "vllm", "--engine-python", engine_python, "--insecure"])
    assert time.monotonic() - started < 30  # refused before any engine could start
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dpserve serve: --backend vllm runs its engines with {engine_python}")
    assert "`make vllm`" in err and "--engine-python" in err and "DPSERVE_VLLM_PYTHON" in err
    return err


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None,
    reason="this install has vLLM: the default install never does (vLLM has its own)",
)
def test_a_python_without_vllm_is_refused_naming_vllm(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert "and it cannot import vllm." in refusal(capsys, sys.executable)


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None,
    reason="this install has vLLM: the default install never does (vLLM has its own)",
)
def test_an_engine_without_vllm_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # `dpserve engine --backend vllm` started by hand in the default install: one line, as
    # every other refusal of the engine command, not an import traceback from the runner.
    assert main(["engine", "--backend", "vllm", "--coordinator", "5999", "--model", "x"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"dpserve engine: --backend vllm needs vLLM, which {sys.executable} cannot import: "
        f"{VLLM_INSTALL_HINT}\n"
    )


def test_a_python_without_dpserve_is_refused_naming_dpserve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The interpreter behind this virtualenv with site-packages off (-S): as a vLLM virtualenv
    # whose editable dpserve points at a checkout that was removed, dpserve is not importable.
    bare = tmp_path / "python"
    bare.write_text(f'#!/bin/sh\nexec "{sys._base_executable}" -S "$@"\n')
    bare.chmod(0o755)
    err = refusal(capsys, str(bare))
    assert "it cannot import dpserve (No module named 'dpserve')" in err


def test_a_path_that_is_no_program_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refusal(capsys, str(tmp_path / "no-such-python"))
    assert "it cannot be run ([Errno 2] No such file or directory" in err


def test_vllms_own_install_passes(vllm_python: str) -> None:
    # In the engines' environment (PYTHONSAFEPATH: the working directory, here this
    # repository's root with its dpserve/, is not on the path), as the engines would import.
    assert _vllm_python_error(vllm_python, child_environment()) is None
