"""The throw-away keys of one ``dpserve serve``: fresh credentials in this user's private
runtime directory, removed when the serve ends, and found again by ``dpserve generate`` and
``dpserve http`` on the same machine and port."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from dpserve.security.key_files import CredentialsError, generate_credentials


def runtime_dir(create: bool = True) -> Path:
    """This user's private directory for the keys of running ``dpserve serve`` instances:
    ``$XDG_RUNTIME_DIR/dpserve``, else ``<tmp>/dpserve-<uid>``. Refused unless it is a real
    directory owned by this user and closed to everyone else."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        path = Path(xdg) / "dpserve"
    else:
        path = Path(tempfile.gettempdir()) / f"dpserve-{os.getuid()}"
    if create:
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
    try:
        info = path.lstat()
    except FileNotFoundError:
        return path
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise CredentialsError(
            f"{path} must be a directory owned by you with mode 0700 (it holds private keys)"
        )
    return path


@contextlib.contextmanager
def throwaway_credentials(port: int) -> Iterator[Path]:
    """Fresh keys for one ``dpserve serve`` on ``port``, in a private directory that is
    removed on exit. The directory records its owner's pid, so that ``dpserve generate`` and
    ``dpserve http`` can find the keys of a live serve on this port (``find_local_credentials``)
    and ignore those a killed one left behind."""
    base = runtime_dir()
    for stale in _serve_dirs(base, port):
        if not _owner_alive(stale):
            shutil.rmtree(stale, ignore_errors=True)
    directory = Path(tempfile.mkdtemp(prefix=f"serve-{port}-", dir=base))  # mode 0700
    try:
        generate_credentials(directory)
        (directory / "owner.pid").write_text(f"{os.getpid()}\n")
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def find_local_credentials(port: int) -> Path | None:
    """The keys of a live ``dpserve serve`` of this user on ``port``, if there is one."""
    try:
        base = runtime_dir(create=False)
    except CredentialsError:
        return None
    live = [d for d in _serve_dirs(base, port) if _owner_alive(d)]
    return max(live, key=lambda d: d.stat().st_mtime, default=None)


def _serve_dirs(base: Path, port: int) -> list[Path]:
    return [d for d in base.glob(f"serve-{port}-*") if d.is_dir()] if base.is_dir() else []


def _owner_alive(directory: Path) -> bool:
    try:
        pid = int((directory / "owner.pid").read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True
