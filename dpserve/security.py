"""Who may talk to the coordinator: CURVE keys, roles, admission helpers, HTTP bearer tokens.

The coordinator's ROUTER socket is a CURVE server. pyzmq's ZAP authenticator (a thread in the
coordinator process) accepts a connection only if the peer's public key is listed for one of
three roles, and hands the role back to libzmq as the connection's ``User-Id``; every message
received on that connection then carries it as metadata. The coordinator checks the role of
*every* message against ``PERMITTED``, not only of handshakes: a ROUTER frees an identity when
its connection drops, and any other allowed key may then connect under the same identity (see
``tests/integration/test_security.py``), so a role remembered from CONNECT could be borrowed.

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
``coordinator.key``.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from dpserve.protocol import CONTROL_SIGNALS, Header

log = logging.getLogger("dpserve.security")

ENGINE: Final = "engine"
CLIENT: Final = "client"
ADMIN: Final = "admin"
ROLES: Final = (ENGINE, CLIENT, ADMIN)
COORDINATOR: Final = "coordinator"  # the name of the server's key pair
ALLOWED_DIR: Final = "allowed"
ENV_CREDENTIALS: Final = "DPSERVE_CREDENTIALS"
ENV_API_KEY_FILE: Final = "DPSERVE_API_KEY_FILE"

_CLIENT_HEADERS = frozenset(
    {Header.CONNECT, Header.HEARTBEAT, Header.SUBMIT_REQUEST, Header.CANCEL, Header.STATUS}
)
# role -> the messages a connection with that role may send to the coordinator.
PERMITTED: Final[Mapping[str, frozenset[Header]]] = {
    ENGINE: frozenset(
        {
            Header.REGISTER,
            Header.HEARTBEAT,
            Header.DRAIN,
            Header.DEREGISTER,
            Header.HAND_OFF,
            Header.ENGINE_REPLY,
            Header.CONTROL_ACK,
        }
    ),
    CLIENT: _CLIENT_HEADERS,
    ADMIN: _CLIENT_HEADERS | CONTROL_SIGNALS,
}

# Messages whose first field is the sender's request/control/query id, so a refusal can name it.
_FIRST_FIELD_IS_REF: Final = frozenset(
    {Header.SUBMIT_REQUEST, Header.CANCEL, Header.STATUS, *CONTROL_SIGNALS}
)

_KEY_LENGTH = 40  # a z85-encoded 32-byte CURVE key
_LOG_FIRST, _LOG_EVERY = 10, 1000  # rate limit for repeated warnings


class CredentialsError(ValueError):
    """Missing, malformed or unsafe key material."""


class InsecureBind(ValueError):
    """Binding the coordinator beyond loopback without credentials, and without --insecure."""


# ================================================================== key material


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


def _read_key_file(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise CredentialsError(f"missing key file {path}")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CredentialsError(f"cannot read the key file {path}: {exc}") from None
    if len(public) != _KEY_LENGTH:
        raise CredentialsError(f"{path}: the public key is not a {_KEY_LENGTH}-character z85 key")
    if not secret:
        return public, None
    if secret_key is None or len(secret_key) != _KEY_LENGTH:
        raise CredentialsError(f"{path} holds no {_KEY_LENGTH}-character secret key")
    if zmq.curve_public(secret_key) != public:
        raise CredentialsError(f"{path}: the public key does not belong to the secret key")
    if path.stat().st_mode & stat.S_IROTH:
        # Not fatal: Kubernetes secret volumes default to 0644. Say so, though.
        log.warning("%s is readable by every user: restrict it (chmod 600)", path)
    return public, secret_key


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


# ================================================================== sockets


class RoleAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread, answering with the peer's role as the connection's User-Id."""

    def __init__(self, context: zmq.Context[Any], roles: Mapping[bytes, str]) -> None:
        super().__init__(context, log=logging.getLogger("dpserve.security.zap"))
        self.roles = dict(roles)
        self.denied = 0  # written by the ZAP thread only; read for status

    def curve_user_id(self, client_public_key: bytes) -> str:
        # Only called for keys ``callback`` accepted, so the key is in the map.
        return self.roles[z85.encode(client_public_key)]

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: is this (z85) public key allowed at all?"""
        if key in self.roles:
            return True
        self.denied += 1
        if self.denied <= _LOG_FIRST or self.denied % _LOG_EVERY == 0:
            log.warning(
                "refused CURVE connection #%d: public key %s is not allowed for any role",
                self.denied,
                key.decode("ascii", "replace"),
            )
        return False


def secure_server(socket: zmq.Socket[object], keys: ServerKeys) -> RoleAuthenticator:
    """Make ``socket`` (not yet bound) a CURVE server whose peers the returned, running
    authenticator checks. Stop the authenticator before terminating the context."""
    authenticator = RoleAuthenticator(socket.context, keys.roles)
    # Started before the socket accepts anything: libzmq lets every key in when no ZAP
    # handler is bound in the context.
    authenticator.start()
    authenticator.configure_curve_callback("*", credentials_provider=authenticator)
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True
    return authenticator


def secure_peer(socket: zmq.Socket[object], keys: PeerKeys) -> None:
    """Make ``socket`` (not yet connected) a CURVE client of the coordinator."""
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_serverkey = keys.server_public


def receive_with_roles(
    socket: zmq.Socket[bytes], limit: int
) -> list[tuple[bytes, bytes | None, str]]:
    """Up to ``limit`` waiting messages of a CURVE ROUTER as (identity, payload, role); the
    payload is None for a message that is not exactly one frame after the identity.
    Two ``recv`` calls cost less than one ``recv_multipart``, which pays back most of
    receiving the payload as a ``Frame`` to read its User-Id."""
    batch: list[tuple[bytes, bytes | None, str]] = []
    recv = socket.recv
    try:
        while len(batch) < limit:
            identity = recv(zmq.NOBLOCK)
            frame = recv(zmq.NOBLOCK, copy=False)  # the parts of a message arrive together
            payload: bytes | None = frame.bytes
            if frame.more:
                payload = None
                while recv(zmq.NOBLOCK, copy=False).more:
                    pass
            try:
                # A bytes name: libzmq's string properties come back as str (pyzmq types a
                # str name's result as int | str, covering its int options too).
                role = frame.get(b"User-Id")
            except zmq.ZMQError:  # no User-Id: cannot happen behind our ZAP handler
                role = ""
            batch.append((identity, payload, role))
    except zmq.Again:
        pass
    return batch


def forbidden(role: str, header: Header, fields: Sequence[Any]) -> tuple[int | None, str]:
    """The id to name and the reason for refusing ``header`` from a ``role`` connection."""
    # Any: the fields are decoded MessagePack that no handler has checked; the ref goes back
    # to the peer as it came.
    ref = fields[0] if header in _FIRST_FIELD_IS_REF else None
    if header in CONTROL_SIGNALS:
        return ref, f"{header.name} needs the admin role; this connection has the {role} role"
    return ref, f"{header.name} is not allowed for the {role or 'unknown'} role"


# ================================================================== binding


def is_loopback(host: str) -> bool:
    """Only literal loopback addresses and ``localhost`` count: a name could resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, *, secured: bool, insecure: bool) -> None:
    """Raise ``InsecureBind`` for a plain coordinator reachable from other machines."""
    if secured or insecure or is_loopback(host):
        return
    raise InsecureBind(
        f"refusing to bind the coordinator to {host} without credentials: anyone who can "
        "reach the port could submit work, register as an engine or stop every engine. "
        "Pass --credentials DIR (create one with `dpserve keys generate DIR`), or --insecure "
        "to accept that risk."
    )


# ================================================================== throw-away keys


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


# ================================================================== HTTP bearer tokens


def load_api_keys(path: str | os.PathLike[str]) -> tuple[bytes, ...]:
    """Accepted bearer tokens: one per line (several allow rotation); blank lines and
    ``#`` comments are ignored."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CredentialsError(f"cannot read the API key file {path}: {exc}") from None
    tokens = tuple(
        line.strip().encode()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    if not tokens:
        raise CredentialsError(f"the API key file {path} holds no token")
    return tokens


def bearer_token_matches(authorization: str | None, tokens: tuple[bytes, ...]) -> bool:
    """Does an ``Authorization`` header carry one of ``tokens``? Every token is compared in
    constant time, so the answer's timing tells nothing about how close a guess was."""
    if not authorization:
        return False
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    candidate = presented.strip().encode("utf-8", "replace")
    matched = False
    for token in tokens:
        matched |= hmac.compare_digest(candidate, token)
    return matched


__all__ = [
    "ADMIN",
    "CLIENT",
    "ENGINE",
    "PERMITTED",
    "ROLES",
    "CredentialsError",
    "InsecureBind",
    "PeerKeys",
    "RoleAuthenticator",
    "ServerKeys",
    "as_peer_keys",
    "as_server_keys",
    "bearer_token_matches",
    "check_bind",
    "find_local_credentials",
    "forbidden",
    "generate_credentials",
    "is_loopback",
    "key_file_text",
    "load_api_keys",
    "load_peer_keys",
    "load_server_keys",
    "receive_with_roles",
    "runtime_dir",
    "secure_peer",
    "secure_server",
    "throwaway_credentials",
]
