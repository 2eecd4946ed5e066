"""The pure parts of ``dpserve.security``: key files, roles, bind checks, throw-away keys,
bearer tokens; plus the ZAP authenticator and role-tagged receive on in-process sockets."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth

from dpserve.coordinator import DataParallelInferenceCoordinator
from dpserve.coordinator.transport import receive_with_roles
from dpserve.protocol import CONTROL_SIGNALS, Header
from dpserve.security import api_tokens, bind, key_files, roles, throwaway


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return key_files.generate_credentials(tmp_path / "keys")


# ------------------------------------------------------------------ key files


def test_generate_writes_key_pairs_allowed_dirs_and_private_modes(keys: Path) -> None:
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for name in ("coordinator", *key_files.ROLES):
        secret_file = keys / f"{name}.key_secret"
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
        public, secret = zmq.auth.load_certificate(secret_file)
        assert secret is not None and zmq.curve_public(secret) == public
        assert zmq.auth.load_certificate(keys / f"{name}.key") == (public, None)
    for role in key_files.ROLES:
        assert zmq.auth.load_certificates(keys / "allowed" / role) == {
            zmq.auth.load_certificate(keys / f"{role}.key")[0]: True
        }
    assert not (keys / "allowed" / "coordinator").exists()


def test_generate_refuses_to_replace_keys_unless_forced(keys: Path) -> None:
    before = (keys / "admin.key_secret").read_text()
    with pytest.raises(key_files.CredentialsError, match="--force"):
        key_files.generate_credentials(keys)
    assert (keys / "admin.key_secret").read_text() == before
    key_files.generate_credentials(keys, force=True)
    assert (keys / "admin.key_secret").read_text() != before
    assert stat.S_IMODE((keys / "admin.key_secret").stat().st_mode) == 0o600


def test_secret_files_are_never_readable_by_others_even_with_a_lax_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        directory = key_files.generate_credentials(tmp_path / "lax")
    finally:
        os.umask(old)
    assert stat.S_IMODE((directory / "engine.key_secret").stat().st_mode) == 0o600


def test_server_keys_map_each_allowed_key_to_its_role(keys: Path) -> None:
    server = key_files.load_server_keys(keys)
    assert server.public == zmq.auth.load_certificate(keys / "coordinator.key")[0]
    by_role = {role: key for key, role in server.roles.items()}
    for role in key_files.ROLES:
        assert by_role[role] == zmq.auth.load_certificate(keys / f"{role}.key")[0]


def test_a_key_allowed_as_client_and_admin_is_an_admin(keys: Path) -> None:
    shutil.copy(keys / "client.key", keys / "allowed" / "admin" / "client.key")
    client_key = zmq.auth.load_certificate(keys / "client.key")[0]
    assert key_files.load_server_keys(keys).roles[client_key] == key_files.ADMIN


def test_a_key_allowed_as_engine_and_client_is_refused(keys: Path) -> None:
    shutil.copy(keys / "engine.key", keys / "allowed" / "client" / "engine.key")
    with pytest.raises(key_files.CredentialsError, match="as engine and as client"):
        key_files.load_server_keys(keys)


def test_the_same_engine_key_listed_twice_is_fine(keys: Path) -> None:
    shutil.copy(keys / "engine.key", keys / "allowed" / "engine" / "copy.key")
    assert key_files.ENGINE in key_files.load_server_keys(keys).roles.values()


def test_server_without_allowed_keys_is_refused(keys: Path) -> None:
    shutil.rmtree(keys / "allowed")
    with pytest.raises(key_files.CredentialsError, match="nobody could connect"):
        key_files.load_server_keys(keys)


def test_mismatched_and_malformed_keys_are_refused(keys: Path, tmp_path: Path) -> None:
    other = key_files.generate_credentials(tmp_path / "other")
    text = (keys / "engine.key_secret").read_text()
    foreign_secret = zmq.auth.load_certificate(other / "engine.key_secret")[1]
    own_secret = zmq.auth.load_certificate(keys / "engine.key_secret")[1]
    assert foreign_secret and own_secret
    (keys / "engine.key_secret").write_text(
        text.replace(own_secret.decode(), foreign_secret.decode())
    )
    with pytest.raises(key_files.CredentialsError, match="does not belong"):
        key_files.load_peer_keys(keys, key_files.ENGINE)
    (keys / "allowed" / "client" / "bad.key").write_text('curve\n    public-key = "short"\n')
    with pytest.raises(key_files.CredentialsError, match="40-character"):
        key_files.load_server_keys(keys)


def test_peer_keys_pick_admin_when_present_else_client(keys: Path) -> None:
    coordinator_public = zmq.auth.load_certificate(keys / "coordinator.key")[0]
    peer = key_files.load_peer_keys(keys)
    assert peer.role == key_files.ADMIN and peer.server_public == coordinator_public
    (keys / "admin.key_secret").unlink()
    assert key_files.load_peer_keys(keys).role == key_files.CLIENT
    assert key_files.load_peer_keys(keys, key_files.ENGINE).role == key_files.ENGINE
    with pytest.raises(key_files.CredentialsError, match="unknown role"):
        key_files.load_peer_keys(keys, "root")
    (keys / "coordinator.key").unlink()
    with pytest.raises(key_files.CredentialsError, match=r"coordinator\.key"):
        key_files.load_peer_keys(keys)


def test_a_process_needs_only_its_own_files(keys: Path, tmp_path: Path) -> None:
    engine_only = tmp_path / "engine-only"
    engine_only.mkdir()
    for name in ("engine.key_secret", "coordinator.key"):
        shutil.copy(keys / name, engine_only / name)
    assert key_files.load_peer_keys(engine_only, key_files.ENGINE).role == key_files.ENGINE
    with pytest.raises(key_files.CredentialsError, match=r"client\.key_secret"):
        key_files.load_peer_keys(engine_only)


def test_secrets_stay_out_of_reprs(keys: Path) -> None:
    server = key_files.load_server_keys(keys)
    peer = key_files.load_peer_keys(keys)
    assert server.secret.decode() not in repr(server)
    assert peer.secret.decode() not in repr(peer)
    assert peer.public.decode() in repr(peer)


# ------------------------------------------------------------------ roles


def test_every_message_the_coordinator_handles_belongs_to_some_role() -> None:
    coordinator = DataParallelInferenceCoordinator(None, 0, None)
    try:
        handled = set(coordinator._handlers)
    finally:
        coordinator.stop()
    permitted = set().union(*roles.PERMITTED.values())
    assert permitted == handled
    assert roles.PERMITTED[key_files.CLIENT] < roles.PERMITTED[key_files.ADMIN]
    assert CONTROL_SIGNALS.isdisjoint(roles.PERMITTED[key_files.CLIENT])
    assert roles.PERMITTED[key_files.ENGINE].isdisjoint(
        {Header.CONNECT, Header.SUBMIT_REQUEST, Header.STATUS, *CONTROL_SIGNALS}
    )


def test_forbidden_names_the_id_and_the_missing_role() -> None:
    ref, reason = roles.forbidden(key_files.CLIENT, Header.STOP, [42])
    assert ref == 42 and "admin role" in reason and "client" in reason
    ref, reason = roles.forbidden(key_files.CLIENT, Header.REGISTER, [0, 8, "x"])
    assert ref is None and "REGISTER" in reason  # a rank is not an id to answer to
    ref, _ = roles.forbidden(key_files.ENGINE, Header.SUBMIT_REQUEST, [7, "p", {}])
    assert ref == 7


# ------------------------------------------------------------------ binding


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("*", False),
        ("10.0.0.5", False),
        ("coordinator.example", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert bind.is_loopback(host) is loopback


def test_check_bind() -> None:
    bind.check_bind("127.0.0.1", secured=False, insecure=False)
    bind.check_bind("0.0.0.0", secured=True, insecure=False)
    bind.check_bind("0.0.0.0", secured=False, insecure=True)
    with pytest.raises(bind.InsecureBind, match="--insecure"):
        bind.check_bind("0.0.0.0", secured=False, insecure=False)


# ------------------------------------------------------------------ throw-away keys


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path / "dpserve"


def test_throwaway_keys_are_private_findable_and_removed(runtime: Path) -> None:
    assert throwaway.find_local_credentials(6000) is None
    with throwaway.throwaway_credentials(6000) as directory:
        assert directory.parent == runtime
        assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert throwaway.find_local_credentials(6000) == directory
        assert throwaway.find_local_credentials(6001) is None
        assert key_files.load_peer_keys(directory).role == key_files.ADMIN
    assert not directory.exists()
    assert throwaway.find_local_credentials(6000) is None


def test_keys_left_by_a_dead_serve_are_ignored_then_removed(runtime: Path) -> None:
    with throwaway.throwaway_credentials(6000) as directory:
        stale = directory.with_name(directory.name + "-stale")
        shutil.copytree(directory, stale)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (stale / "owner.pid").write_text(f"{dead.pid}\n")
    assert throwaway.find_local_credentials(6000) is None
    with throwaway.throwaway_credentials(6000):
        assert not stale.exists()


def test_an_unsafe_runtime_dir_is_refused(runtime: Path) -> None:
    runtime.mkdir(mode=0o755)
    runtime.chmod(0o755)
    with pytest.raises(key_files.CredentialsError, match="0700"):
        throwaway.runtime_dir()
    assert throwaway.find_local_credentials(6000) is None  # lookups just find nothing


# ------------------------------------------------------------------ bearer tokens


def test_api_key_file_lists_tokens(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# comment\n\n  first-token  \nsecond-token\n")
    assert api_tokens.load_api_keys(path) == (b"first-token", b"second-token")
    path.write_text("# only a comment\n")
    with pytest.raises(key_files.CredentialsError, match="no token"):
        api_tokens.load_api_keys(path)
    with pytest.raises(key_files.CredentialsError, match="cannot read"):
        api_tokens.load_api_keys(tmp_path / "missing")


@pytest.mark.parametrize(
    ("header", "accepted"),
    [
        ("Bearer first-token", True),
        ("bearer second-token", True),
        ("Bearer  first-token ", True),
        ("Bearer first-token2", False),
        ("Bearer first-toke", False),
        ("Basic first-token", False),
        ("first-token", False),
        ("Bearer ", False),
        ("", False),
        (None, False),
        ("Bearer ünïcode", False),
    ],
)
def test_bearer_token_matches(header: str | None, accepted: bool) -> None:
    assert api_tokens.bearer_token_matches(header, (b"first-token", b"second-token")) is accepted


# ------------------------------------------------------------------ sockets, in process


def test_zap_admits_allowed_keys_and_tags_each_message_with_its_role(
    keys: Path, tmp_path: Path
) -> None:
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    authenticator = roles.secure_server(router, key_files.load_server_keys(keys))
    stranger = key_files.generate_credentials(tmp_path / "stranger")
    shutil.copy(keys / "coordinator.key", stranger / "coordinator.key")
    sockets = [router]
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")

        def dealer(directory: Path, role: str) -> zmq.Socket:
            socket = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.IDENTITY, f"{role}-{len(sockets)}".encode())
            roles.secure_peer(socket, key_files.load_peer_keys(directory, role))
            socket.connect(f"tcp://127.0.0.1:{port}")
            sockets.append(socket)
            return socket

        for role in key_files.ROLES:
            dealer(keys, role).send(role.encode())
        dealer(stranger, key_files.ADMIN).send(b"let me in")
        dealer(keys, key_files.CLIENT).send_multipart([b"two", b"parts"])
        received: list[tuple[bytes, bytes | None, str]] = []
        deadline = time.monotonic() + 10
        while len(received) < 4 and time.monotonic() < deadline:
            if router.poll(200):
                received += receive_with_roles(router, 100)
        router.poll(500)  # time for the stranger's message, were it let through
        received += receive_with_roles(router, 100)
        tagged = {payload: role for _identity, payload, role in received}
        assert tagged == {
            b"engine": "engine",
            b"client": "client",
            b"admin": "admin",
            None: "client",
        }
        assert authenticator.denied >= 1
    finally:
        for socket in sockets:
            socket.close(0)
        authenticator.stop()
        context.term()


def test_one_parser_reads_our_key_files_and_pyzmq_certificates(tmp_path: Path) -> None:
    public, secret = zmq.curve_keypair()
    text = key_files.key_file_text(public, secret)
    assert key_files.parse_key_text(text, "ours", secret=True) == (public, secret)
    assert key_files.parse_key_text(key_files.key_file_text(public), "x", secret=False) == (
        public,
        None,
    )
    # pyzmq writes the same format, with its own header lines.

    _, secret_file = zmq.auth.create_certificates(tmp_path, "peer")
    read = key_files.parse_key_text(Path(secret_file).read_text(), "pyzmq", secret=True)
    assert read == zmq.auth.load_certificate(secret_file)
    with pytest.raises(key_files.CredentialsError, match="no public key"):
        key_files.parse_key_text("curve\n", "empty", secret=False)
    with pytest.raises(key_files.CredentialsError, match="40-character z85"):
        key_files.parse_key_text('public-key = "' + "~" * 40 + '"', "bad", secret=False)
    with pytest.raises(key_files.CredentialsError, match="secret key"):
        key_files.parse_key_text(key_files.key_file_text(public), "public only", secret=True)
    other, _ = zmq.curve_keypair()
    with pytest.raises(key_files.CredentialsError, match="does not belong"):
        key_files.parse_key_text(key_files.key_file_text(other, secret), "mixed", secret=True)
