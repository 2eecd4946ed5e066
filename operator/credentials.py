"""CURVE credentials of an InferenceDeployment, as Secrets (pure, no I/O).

The operator generates one key set per InferenceDeployment ``<name>`` (``dpserve keys
generate``'s layout, see ``dpserve.security``) and keeps it in two Secrets it owns:

- ``<name>-credentials``: every key file. Pods mount it through ``items:`` projections that
  rebuild, per pod, just the part of the credentials directory that pod needs:

  - coordinator: ``coordinator.key_secret``, ``allowed/{engine,client,admin}/<role>.key``,
    and ``client.key_secret`` + ``coordinator.key`` for its own HTTP front;
  - engines: ``engine.key_secret`` and ``coordinator.key``.

  The coordinator also gets the HTTP tokens: ``http-api-token`` (``--api-key-file``) and
  ``http-admin-token`` (``--admin-api-key-file``), the only token its front takes for
  loading and unloading LoRA adapters. With ``spec.adapters`` it also gets
  ``admin.key_secret``: its front then connects with the admin role, which loading and
  unloading adapters needs (the operator keeps the adapters through that front, with the
  admin token). Otherwise nothing mounts the admin key pair. Engines cannot read the
  coordinator's secret key.
- ``<name>-client-credentials``: what people and jobs outside the cluster need
  (``client.key[_secret]``, ``admin.key[_secret]``, ``coordinator.key`` and both HTTP
  tokens); mounted by nothing.
  Extracted to a directory, it is a ``--credentials DIR`` for ``dpserve generate``/``http``.

Deleting ``<name>-credentials`` rotates the keys: the operator generates new ones, rewrites
the client Secret, and the pod templates' ``dpserve.io/credentials-hash`` annotation (a hash
of the *public* keys only) changes, which rolls every pod.

Never log, post as an event or put in the status anything of ``key_files``.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from collections.abc import Mapping
from typing import Any

import zmq

from dpserve.security import key_files

MOUNT_PATH = "/etc/dpserve/credentials"
VOLUME_NAME = "credentials"
HASH_ANNOTATION = "dpserve.io/credentials-hash"
COMPONENT = "credentials"  # the Secrets' app.kubernetes.io/component label
# 0440: readable by the pod's fsGroup (the runtime user), by nobody else.
SECRET_FILE_MODE = 0o440

_NAMES = (key_files.COORDINATOR, *key_files.ROLES)
# The HTTP front's bearer token (``--api-key-file``), rotated with the keys.
API_TOKEN_FILE = "http-api-token"
# Its admin token (``--admin-api-key-file``): the only one that loads and unloads adapters.
ADMIN_API_TOKEN_FILE = "http-admin-token"
KEY_FILES = (
    *(f"{n}.key{suffix}" for n in _NAMES for suffix in ("", "_secret")),
    API_TOKEN_FILE,
    ADMIN_API_TOKEN_FILE,
)
CLIENT_KEY_FILES = (
    "coordinator.key", "client.key", "client.key_secret", "admin.key", "admin.key_secret",
    API_TOKEN_FILE, ADMIN_API_TOKEN_FILE,
)  # fmt: skip


def credentials_secret_name(name: str) -> str:
    return f"{name}-credentials"


def client_secret_name(name: str) -> str:
    return f"{name}-client-credentials"


# --------------------------------------------------------------------------- key material


def generate_key_files() -> dict[str, str]:
    """A fresh key set: file name → file text, the files ``dpserve keys generate`` writes
    at the top of its directory (``allowed/`` is built by the pods' projections)."""
    files: dict[str, str] = {}
    for name in _NAMES:
        public, secret = zmq.curve_keypair()
        files[f"{name}.key"] = key_files.key_file_text(public)
        files[f"{name}.key_secret"] = key_files.key_file_text(public, secret)
    files[API_TOKEN_FILE] = _token()
    files[ADMIN_API_TOKEN_FILE] = _token()
    return files


def _token() -> str:
    return secrets.token_urlsafe(32) + "\n"


def with_admin_token(files: Mapping[str, str]) -> dict[str, str] | None:
    """``files`` with a new ``http-admin-token`` when they hold none (a key set generated
    before the token existed: it is added, the keys kept, so upgrading the operator rotates
    nothing); None when they hold one."""
    if files.get(ADMIN_API_TOKEN_FILE, "").strip():
        return None
    return {**files, ADMIN_API_TOKEN_FILE: _token()}


def public_key(text: str) -> str | None:
    """The public key of a key file's text, or None when it holds no valid one."""
    try:
        public, _ = key_files.parse_key_text(text, "key file", secret=False)
    except key_files.CredentialsError:
        return None
    return public.decode()


def valid_key_files(files: Mapping[str, str]) -> bool:
    """Every key file present, each pair consistent (the public key belongs to the secret),
    and an HTTP token."""
    if not files.get(API_TOKEN_FILE, "").strip():
        return False
    for name in _NAMES:
        public_text, secret_text = files.get(f"{name}.key"), files.get(f"{name}.key_secret")
        if public_text is None or secret_text is None:
            return False
        try:
            public, _ = key_files.parse_key_text(public_text, f"{name}.key", secret=False)
            pair, _ = key_files.parse_key_text(secret_text, f"{name}.key_secret", secret=True)
        except key_files.CredentialsError:
            return False
        if pair != public:
            return False
    return True


def credentials_hash(files: Mapping[str, str]) -> str:
    """A short hash of the public keys (never of secret keys): changes when keys rotate."""
    digest = hashlib.sha256()
    for name in _NAMES:
        digest.update(f"{name}={public_key(files[f'{name}.key']) or ''};".encode())
    return digest.hexdigest()[:16]


def decode_secret_data(secret: Mapping[str, Any] | None) -> dict[str, str]:
    data = (secret or {}).get("data") or {}
    decoded: dict[str, str] = {}
    for key, value in data.items():
        try:
            decoded[key] = base64.b64decode(value).decode("ascii")
        except (ValueError, UnicodeDecodeError):
            continue
    return decoded


# --------------------------------------------------------------------------- Secret data


def secret_data(files: Mapping[str, str], keys: tuple[str, ...]) -> dict[str, str]:
    """The ``data`` of a Secret holding ``keys`` of ``files`` (base64, as the API wants)."""
    return {key: base64.b64encode(files[key].encode()).decode() for key in keys}


# --------------------------------------------------------------------------- mounts

# key in <name>-credentials → path under MOUNT_PATH, per component.
COORDINATOR_ITEMS: tuple[tuple[str, str], ...] = (
    ("coordinator.key_secret", "coordinator.key_secret"),
    ("engine.key", f"{key_files.ALLOWED_DIR}/engine/engine.key"),
    ("client.key", f"{key_files.ALLOWED_DIR}/client/client.key"),
    ("admin.key", f"{key_files.ALLOWED_DIR}/admin/admin.key"),
    # The coordinator's HTTP front is a client of its own ZMQ socket.
    ("client.key_secret", "client.key_secret"),
    ("coordinator.key", "coordinator.key"),
    (API_TOKEN_FILE, API_TOKEN_FILE),
    (ADMIN_API_TOKEN_FILE, ADMIN_API_TOKEN_FILE),
)
# The coordinator's items with spec.adapters: its front picks the admin role when the admin
# key pair is in its directory (``key_files.load_peer_keys``).
COORDINATOR_ADMIN_ITEMS: tuple[tuple[str, str], ...] = (
    *COORDINATOR_ITEMS,
    ("admin.key_secret", "admin.key_secret"),
)
ENGINE_ITEMS: tuple[tuple[str, str], ...] = (
    ("engine.key_secret", "engine.key_secret"),
    ("coordinator.key", "coordinator.key"),
)
