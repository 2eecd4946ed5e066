"""The CPU engine's environment settings (``cpu_settings``): each bad value refused by name, by
its reader, by an engine before it reads any model and by ``dpserve serve`` before it starts
any engine (one line, exit status 2), the last without loading torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dpserve import cpu_settings

MAX_ROWS = cpu_settings.DECODE_MATMUL_MAX_ROWS
BAD_VALUES = [
    (cpu_settings.ISA_ENV, "sse9", "must be one of auto, portable, avx2, avx512"),
    (cpu_settings.ISA_ENV, "AVX2", "must be one of auto, portable, avx2, avx512"),
    *(
        (cpu_settings.SMALL_BATCH_ROWS_ENV, value, f"must be a whole number from 0 to {MAX_ROWS}")
        for value in (str(MAX_ROWS + 1), "-1", "two", "", "1.5")
    ),
    *((cpu_settings.BF16_DOTS_ENV, value, "must be 0 or 1") for value in ("2", "yes", "", "true")),
]
ENGINE = ["engine", "--model", "/no/such/model", "--coordinator", "tcp://127.0.0.1:1"]
SERVE = ["serve", "--model", "/no/such/model"]


@pytest.mark.parametrize(("name", "value", "rule"), BAD_VALUES)
def test_a_bad_setting_is_refused_by_name_before_any_engine_starts(
    name: str,
    value: str,
    rule: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dpserve.cli import main

    for setting in (cpu_settings.ISA_ENV, cpu_settings.SMALL_BATCH_ROWS_ENV):
        monkeypatch.delenv(setting, raising=False)
    monkeypatch.setenv(cpu_settings.BF16_DOTS_ENV, "0")
    assert cpu_settings.error() is None
    monkeypatch.setenv(name, value)
    why = f"{name} {rule} (got {value!r})"
    assert cpu_settings.error() == why
    assert main(ENGINE) == 2
    assert capsys.readouterr().err.strip() == f"dpserve engine: {why}"
    assert main([*SERVE, "--cpu-weights", "bf16"]) == 2
    assert capsys.readouterr().err.strip() == f"dpserve serve: {why}"


@pytest.mark.parametrize(
    ("name", "value"),
    [(cpu_settings.ISA_ENV, "sse9"), (cpu_settings.SMALL_BATCH_ROWS_ENV, "two")],
)
def test_serve_refuses_without_loading_torch(name: str, value: str) -> None:
    """``dpserve serve`` stays free of torch (its engines load it): its check must be too."""
    script = (
        "import json, sys\n"
        "from dpserve.cli import main\n"
        f"code = main({SERVE!r})\n"
        "print(json.dumps([code, 'torch' in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**_plain_environment(), name: value},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [2, False], done.stderr
    assert f"dpserve serve: {name} must be" in done.stderr


def _plain_environment() -> dict[str, str]:
    import os

    return {
        key: value
        for key, value in os.environ.items()
        if key
        not in (cpu_settings.ISA_ENV, cpu_settings.SMALL_BATCH_ROWS_ENV, cpu_settings.BF16_DOTS_ENV)
    }


def test_the_instruction_path_is_read_once_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every product asks for it, so it is cached; ``error`` reads the environment as it is."""
    monkeypatch.delenv(cpu_settings.ISA_ENV, raising=False)
    cpu_settings.isa_setting.cache_clear()
    try:
        assert cpu_settings.isa_setting() == cpu_settings.ISA_CHOICES.index("auto")
        monkeypatch.setenv(cpu_settings.ISA_ENV, "avx2")
        assert cpu_settings.isa_setting() == cpu_settings.ISA_CHOICES.index("auto")
        assert cpu_settings.isa_named("avx2") == cpu_settings.ISA_CHOICES.index("avx2")
    finally:
        cpu_settings.isa_setting.cache_clear()
