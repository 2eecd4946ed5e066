"""``scripts/apt-mirror.sh``: the image and control-plane builds take the Debian mirror from
this machine's apt configuration only (one-line and deb822 sources), and fail with a message
when it names none. Runs the shell function alone against made-up apt directories."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "apt-mirror.sh"


def debian_mirror(apt_etc: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f'set -euo pipefail; source "{SCRIPT}"; debian_mirror'],
        env={"APT_ETC": str(apt_etc), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )


def write(root: Path, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_deb822_sources_skip_disabled_security_and_source_entries(tmp_path: Path) -> None:
    write(
        tmp_path,
        "sources.list.d/debian.sources",
        "Types: deb\nURIs: http://disabled.example/debian\nSuites: bookworm\nEnabled: no\n\n"
        "Types: deb-src\nURIs: http://sources-only.example/debian\nSuites: bookworm\n\n"
        "# the security archive is no mirror of bookworm itself\n"
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n\n"
        "types: deb deb-src\nuris: http://mirror.example/debian/ http://second.example/debian\n"
        "Suites: bookworm\nComponents: main\n",
    )
    result = debian_mirror(tmp_path)
    assert (result.returncode, result.stdout) == (0, "http://mirror.example/debian\n")


def test_one_line_sources_with_options(tmp_path: Path) -> None:
    write(
        tmp_path,
        "sources.list",
        "# deb http://commented.example/debian bookworm main\n"
        "deb-src http://sources-only.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/usr/share/keyrings/x.gpg] https://mirror.example/debian "
        "bookworm main\n",
    )
    write(tmp_path, "sources.list.d/other.list", "deb http://thirdparty.example/apt stable main\n")
    result = debian_mirror(tmp_path)
    assert (result.returncode, result.stdout) == (0, "https://mirror.example/debian\n")


@pytest.mark.parametrize(
    "files",
    [
        {},
        {"sources.list.d/repo.list": "deb http://thirdparty.example/apt stable main\n"},
        {"sources.list.d/x.sources": "Types: deb\nURIs: http://m.example/debian\nEnabled: no\n"},
    ],
    ids=["no-configuration", "no-debian-mirror", "only-disabled"],
)
def test_no_mirror_fails_with_a_message(tmp_path: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        write(tmp_path, name, text)
    result = debian_mirror(tmp_path)
    assert result.returncode != 0 and result.stdout == ""
    assert "no Debian mirror in this machine's apt configuration" in result.stderr
