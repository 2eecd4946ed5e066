"""Every package of the source tree is in the wheel: the images install the project with a
plain (non-editable) pip install, where a package missing from pyproject's list is simply
absent (an editable install would hide that)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed_in_pyproject() -> None:
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "dpserve").rglob("__init__.py")
    }
    assert found - listed == set(), "add these to [tool.setuptools] packages"
