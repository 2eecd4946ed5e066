"""The map matches the code: every dotted name that docs/architecture.md gives in backticks or
in its diagram, and every name in the README's module table, must still exist. A name that
was renamed or removed fails here until the page says what the code does; names the pages do
not mention are not checked (new modules need no entry to pass)."""

from __future__ import annotations

import importlib
import inspect
import re
import typing
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"

# Where a short name may live: dpserve itself, one of its packages, or the operator.
PACKAGES = ("coordinator", "engine", "client", "openai", "security", "cli")
ROOTS = ("", "dpserve.", *(f"dpserve.{p}." for p in PACKAGES), "dpserve_operator.")
# Backticked text that names a file, not code.
FILE_SUFFIXES = {"md", "toml", "py", "yaml", "yml", "json", "sh", "txt", "cfg", "gguf"}
DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")
IDENTIFIER = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            return None  # no such module (a missing dependency inside it would raise on)
        raise


def _has(owner: object, name: str) -> bool:
    """``owner.name`` exists, counting what a class's instances get in ``__init__`` or
    declare as annotations (dataclass fields, attributes set on ``self``)."""
    if hasattr(owner, name):
        return True
    if not inspect.isclass(owner):
        return False
    if any(name in getattr(c, "__annotations__", {}) for c in owner.__mro__):
        return True
    try:
        source = inspect.getsource(owner)
    except (OSError, TypeError):
        return False
    return re.search(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]+)?=", source) is not None


def resolves(dotted: str) -> bool:
    """Does ``dotted`` (e.g. ``membership.Membership.check_engines``) name something, under
    one of ``ROOTS``?"""
    for root in ROOTS:
        parts = (root + dotted).split(".")
        for split in range(len(parts), 0, -1):
            module = _import(".".join(parts[:split]))
            if module is None:
                continue
            owner: object = module
            for attribute in parts[split:]:
                if not _has(owner, attribute):
                    break
                owner = getattr(owner, attribute, None)
                owner = typing.get_origin(owner) or owner
            else:
                return True
            break  # the longest importable module lacks it: try the next root
    return False


def _is_code(text: str) -> bool:
    return bool(DOTTED.match(text)) and text.rsplit(".", 1)[1] not in FILE_SUFFIXES


def architecture_names() -> list[str]:
    text = ARCHITECTURE.read_text()
    names = {n for n in re.findall(r"`([^`\n]+)`", text) if _is_code(n.removesuffix("()"))}
    for block in re.findall(r"^```\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        names.update(n for n in re.findall(r"[A-Za-z_][\w.]*\.[A-Za-z_]\w*", block) if _is_code(n))
    return sorted(n.removesuffix("()") for n in names)


def readme_names() -> list[tuple[str, str]]:
    """(module of the row, name) for the README's module table."""
    pairs = []
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        path = re.match(r"`([^`]+)`", cells[0])
        assert path is not None
        base = path.group(1).removesuffix(".py").strip("/").replace("/", ".")
        base = "dpserve_operator" if base == "operator" else base
        for name in re.findall(r"`([^`\n]+)`", cells[1]):
            name = name.removesuffix("()")
            if IDENTIFIER.match(name) and name.rsplit(".", 1)[-1] not in FILE_SUFFIXES:
                pairs.append((base, name))
    return pairs


def test_the_pages_name_code() -> None:
    # The collection itself must find the map: an empty list would pass any code.
    assert len(architecture_names()) > 40
    assert len(readme_names()) > 15


@pytest.mark.parametrize("name", architecture_names())
def test_every_name_in_the_architecture_page_exists(name: str) -> None:
    assert resolves(name), f"docs/architecture.md names `{name}`, which the code lacks"


@pytest.mark.parametrize(("base", "name"), readme_names())
def test_every_name_in_the_readme_module_table_exists(base: str, name: str) -> None:
    assert resolves(f"{base}.{name}"), f"README.md's row for {base} names `{name}`"


def test_a_missing_name_is_caught() -> None:
    assert resolves("membership.Membership.remove_unreachable")
    assert resolves("transport.Transport.unreachable")  # set in __init__
    assert not resolves("membership.Membership.peer_gone")
    assert not resolves("dpserve.http.HttpFront")
    assert not resolves("InferenceClient._on_stream")
