"""CURVE key material: the credentials directory, its key files, and loading them.

Credentials directory (``dpserve keys generate DIR``; files in pyzmq/czmq certificate format)::

    coordinator.key            coordinator public key: every peer needs it
    coordinator.key_secret     coordinator secret key: only the coordinator (mode 0600)
    engine.key[_secret]        the engines' key pair
    client.key[_secret]        a client key pair: submit, stream, cancel, STATUS
    admin.key[_secret]         an admin key pair: a client that may also PAUSE ... STOP
    allowed/engine/*.key       public keys the coordinator accepts, per role
    allowed/client/*.key
    allowed/admin/*.key

Each process reads only what it needs, so a deployment can hand each one a subset: the
coordinator its secret key and ``allowed/``; an engine ``engine.key_secret`` and
``coordinator.key``; a client ``client.key_secret`` (or ``admin.key_secret``) and
``coordinator.key``. ``key_file_text`` writes a key file's text and ``parse_key_text`` reads
it, for files on disk and for the Kubernetes operator's Secrets alike.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import zmq
from zmq.utils import z85

log = logging.getLogger("dpserve.security")

ENGINE: Final = "engine"
CLIENT: Final = "client"
ADMIN: Final = "admin"
ROLES: Final = (ENGINE, CLIENT, ADMIN)
COORDINATOR: Final = "coordinator"  # the name of the server's key pair
ALLOWED_DIR: Final = "allowed"
ENV_CREDENTIALS: Final = "DPSERVE_CREDENTIALS"

KEY_LENGTH: Final = 40  # a z85-encoded 32-byte CURVE key


class CredentialsError(ValueError):
    """Missing, malformed or unsafe key material."""


@dataclass(frozen=True, slots=True)
class ServerKeys:
    """What the coordinator needs: its key pair and the allowed public keys by role."""

    public: bytes
    secret: bytes = field(repr=False)
    roles: Mapping[bytes, str]  # allowed public key (z85) -> role


@dataclass(frozen=True, slots=True)
class PeerKeys:
    """What an engine or client needs: its own key pair and the coordinator's public key."""

    role: str
    public: bytes
    secret: bytes = field(repr=False)
    server_public: bytes


def generate_credentials(directory: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Write a coordinator key pair, one key pair per role, and ``allowed/<role>/<role>.key``.
    Refuses to overwrite existing key pairs unless ``force``: replacing them would lock out
    every process that still holds the old ones."""
    root = Path(directory)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    names = (COORDINATOR, *ROLES)
    existing = sorted(p.name for n in names for p in root.glob(f"{n}.key*"))
    if existing and not force:
        raise CredentialsError(
            f"{root} already holds keys ({', '.join(existing)}); "
            "use another directory, or --force to replace them"
        )
    for name in names:
        public, secret = zmq.curve_keypair()
        _write_key_file(root / f"{name}.key", public, None, force)
        _write_key_file(root / f"{name}.key_secret", public, secret, force)
        if name in ROLES:
            allowed = root / ALLOWED_DIR / name
            allowed.mkdir(mode=0o755, parents=True, exist_ok=True)
            _write_key_file(allowed / f"{name}.key", public, None, force)
    return root


def _write_key_file(path: Path, public: bytes, secret: bytes | None, replace: bool) -> None:
    if replace:
        path.unlink(missing_ok=True)
    mode = 0o644 if secret is None else 0o600
    # O_EXCL and the mode at creation: a secret key is never readable by others, not even
    # for the moment between writing and a chmod.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="ascii") as out:
        os.fchmod(fd, mode)  # exactly this mode, whatever the umask
        out.write(key_file_text(public, secret))


def key_file_text(public: bytes, secret: bytes | None = None) -> str:
    """A key file's content (czmq certificate format), as ``dpserve keys generate`` writes
    it: the public key only, or with ``secret`` the key pair. The Kubernetes operator stores
    these texts in Secrets, so a mounted Secret is a credentials directory."""
    kind = "PUBLIC key: share it" if secret is None else "SECRET key: never share it"
    text = f'#   dpserve CURVE {kind}\nmetadata\ncurve\n    public-key = "{public.decode()}"\n'
    if secret is not None:
        text += f'    secret-key = "{secret.decode()}"\n'
    return text


def parse_key_text(text: str, source: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    """The public key of a key file's text, and with ``secret`` its secret key, checked:
    z85 keys of ``KEY_LENGTH`` characters, the public one derived from the secret one.
    Reads what ``key_file_text`` and pyzmq write (``name = "key"``, quotes optional);
    ``source`` names the file in the ``CredentialsError``."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        name, equals, value = line.strip().partition("=")
        if equals and name.strip() in ("public-key", "secret-key"):
            found.setdefault(name.strip(), value.strip(" \t'\""))
    if "public-key" not in found:
        raise CredentialsError(f"cannot read the key file {source}: no public key found")
    public = _z85_key(found["public-key"])
    if public is None:
        raise CredentialsError(f"{source}: the public key is not a {KEY_LENGTH}-character z85 key")
    if not secret:
        return public, None
    secret_key = _z85_key(found.get("secret-key", ""))
    if secret_key is None:
        raise CredentialsError(f"{source} holds no {KEY_LENGTH}-character secret key")
    if zmq.curve_public(secret_key) != public:
        raise CredentialsError(f"{source}: the public key does not belong to the secret key")
    return public, secret_key


def _z85_key(text: str) -> bytes | None:
    """``text`` as key bytes when it is a z85-encoded CURVE key, else None."""
    key = text.encode("ascii", "replace")
    if len(key) != KEY_LENGTH or not text.isascii():
        return None
    try:
        z85.decode(key)
    except (KeyError, ValueError):  # a character outside the z85 alphabet
        return None
    return key


def _read_key_file(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise CredentialsError(f"missing key file {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise CredentialsError(f"cannot read the key file {path}: {exc}") from None
    keys = parse_key_text(text, str(path), secret=secret)
    if secret and path.stat().st_mode & stat.S_IROTH:
        # Not fatal: Kubernetes secret volumes default to 0644. Say so, though.
        log.warning("%s is readable by every user: restrict it (chmod 600)", path)
    return keys


def load_server_keys(directory: str | os.PathLike[str]) -> ServerKeys:
    """The coordinator's secret key and every allowed public key, by role."""
    root = Path(directory)
    public, secret = _read_key_file(root / f"{COORDINATOR}.key_secret", secret=True)
    assert secret is not None
    roles: dict[bytes, str] = {}
    # Admin last: a key listed as client and as admin is an admin (admin includes client).
    for role in (ENGINE, CLIENT, ADMIN):
        allowed = root / ALLOWED_DIR / role
        if not allowed.is_dir():
            continue
        for key_file in sorted(allowed.glob("*.key")):
            key, _ = _read_key_file(key_file, secret=False)
            previous = roles.get(key)
            if previous not in (None, role) and ENGINE in (previous, role):
                raise CredentialsError(
                    f"{key_file}: this key is allowed as {previous} and as {role}; "
                    "engines and clients must use different keys"
                )
            roles[key] = role
    if not roles:
        raise CredentialsError(
            f"no allowed public keys under {root / ALLOWED_DIR}/{{engine,client,admin}}: "
            "nobody could connect"
        )
    return ServerKeys(public, secret, roles)


def load_peer_keys(directory: str | os.PathLike[str], role: str | None = None) -> PeerKeys:
    """An engine's or client's key pair and the coordinator's public key. ``role=None``
    picks ``admin`` when the directory holds the admin key pair, else ``client``."""
    root = Path(directory)
    if role is None:
        role = ADMIN if (root / f"{ADMIN}.key_secret").exists() else CLIENT
    if role not in ROLES:
        raise CredentialsError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    public, secret = _read_key_file(root / f"{role}.key_secret", secret=True)
    assert secret is not None
    server_public, _ = _read_key_file(root / f"{COORDINATOR}.key", secret=False)
    return PeerKeys(role, public, secret, server_public)


def as_server_keys(credentials: ServerKeys | str | os.PathLike[str]) -> ServerKeys:
    return credentials if isinstance(credentials, ServerKeys) else load_server_keys(credentials)


def as_peer_keys(credentials: PeerKeys | str | os.PathLike[str], role: str | None) -> PeerKeys:
    return credentials if isinstance(credentials, PeerKeys) else load_peer_keys(credentials, role)
