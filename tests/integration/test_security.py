"""CURVE roles, admission limits, throw-away keys and the HTTP bearer token, against real
dpserve processes on 127.0.0.1 (see ``docs/security.md``)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from aiohttp.test_utils import TestClient, TestServer

from dpserve import protocol
from dpserve.client import CoordinatorUnavailable, InferenceClient, RequestFailed
from dpserve.engine.fake import fake_token
from dpserve.openai import create_app
from dpserve.protocol import ErrorCode, Header
from dpserve.sampling import SamplingParams
from dpserve.security import api_tokens, key_files, roles
from dpserve.tokenizer import ByteTokenizer
from tests.integration.runtime import DPSERVE, Processes, free_port, wait_for_engines

pytestmark = pytest.mark.timeout(120)

FAST = ("--heartbeat-timeout", "1.5")
ADMIN_TOKEN = "admin-token-9876543210"


def expected_tokens(prompt: str, count: int) -> list[int]:
    return [fake_token(list(prompt.encode()), None, i) for i in range(count)]


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return key_files.generate_credentials(tmp_path / "keys")


@pytest.fixture
def stranger(tmp_path: Path, keys: Path) -> Path:
    """Keys of someone who knows the coordinator's public key but is not allowed in."""
    directory = key_files.generate_credentials(tmp_path / "stranger")
    shutil.copy(keys / "coordinator.key", directory / "coordinator.key")
    return directory


@pytest.fixture
async def admin(port: int, keys: Path) -> AsyncIterator[InferenceClient]:
    client = InferenceClient(port, handshake_timeout=20, credentials=keys)
    yield client
    client.stop()


def start_secure(
    processes: Processes, port: int, keys: Path, engines: int, *extra: str, engine_args=()
) -> None:
    # Debug logging (-v): secrets must stay out of even the most talkative logs.
    processes.spawn(
        f"coordinator-{port}", "-v", "coordinator", "--port", str(port),
        "--credentials", str(keys), *FAST, *extra,
    )  # fmt: skip
    for rank in range(engines):
        processes.spawn(
            f"engine-{rank}", "-v", "engine", "--coordinator", f"tcp://127.0.0.1:{port}",
            "--rank", str(rank), "--fake", "--credentials", str(keys), *engine_args,
        )  # fmt: skip


class RawPeer:
    """A DEALER that sends whatever a test wants, with the CURVE keys of one role."""

    def __init__(self, port: int, keys: key_files.PeerKeys, identity: bytes | None = None) -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.IDENTITY, identity or b"raw-" + uuid.uuid4().bytes)
        roles.secure_peer(self.socket, keys)
        self.socket.connect(f"tcp://127.0.0.1:{port}")

    async def send(self, header: Header, *fields: object) -> None:
        await self.socket.send(protocol.encode(protocol.RECORDS[header](*fields)))

    async def receive(self, timeout: float = 10.0) -> Any:
        return protocol.decode(await asyncio.wait_for(self.socket.recv(), timeout))

    async def receive_until(self, header: Header, timeout: float = 10.0) -> Any:
        """Skip other messages (heartbeat acks, errors for earlier sends) until ``header``;
        returns its record."""
        deadline = time.monotonic() + timeout
        while True:
            record = await self.receive(max(0.1, deadline - time.monotonic()))
            if protocol.header_of(record) is header:
                return record

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


def secret_keys(directory: Path) -> list[str]:
    secrets = []
    for path in directory.rglob("*.key_secret"):
        _public, secret = zmq.auth.load_certificate(path)
        assert secret is not None
        secrets.append(secret.decode())
    assert secrets
    return secrets


def assert_no_secret_in(text: str, *directories: Path) -> None:
    assert text, "expected some log output to search"
    for directory in directories:
        for secret in secret_keys(directory):
            assert secret not in text, f"a secret key of {directory} leaked into a log"


# ------------------------------------------------------------------ authentication


async def test_unknown_keys_cannot_connect_submit_or_register(
    processes, admin, port, keys, stranger
):
    start_secure(processes, port, keys, engines=1)
    await admin.start()
    await wait_for_engines(admin, 1)

    for credentials in (stranger, None):  # a key nobody allowed, and no key at all
        outsider = InferenceClient(port, handshake_timeout=1.5, credentials=credentials)
        started = time.monotonic()
        with pytest.raises(CoordinatorUnavailable):
            await outsider.start()
        assert time.monotonic() - started < 5, "a refused handshake must fail fast"

    refused_engine = processes.fake_engine(port, 1, "--credentials", str(stranger))
    # ZMQ does not retry a refused handshake: the engine exits instead of waiting forever.
    assert await asyncio.to_thread(refused_engine.wait, 30) == 1
    assert "refused this engine's CURVE handshake" in processes.log("engine-1")
    status = await admin.get_status()
    assert status["engines"] == 1, "an engine with an unknown key must never register"
    assert status["security"] == "curve"
    assert status["counters"]["auth_denied"] == 2, "one refused client, one refused engine"
    record = await admin.add_request("still fine", SamplingParams(num_tokens_to_generate=3))
    assert record.generated_tokens == expected_tokens("still fine", 3)
    assert_no_secret_in(
        processes.log(f"coordinator-{port}")
        + processes.log("engine-0")
        + processes.log("engine-1"),
        keys,
        stranger,
    )


async def test_roles_decide_what_a_connection_may_do(processes, admin, port, keys):
    start_secure(processes, port, keys, engines=2)
    await admin.start()
    await wait_for_engines(admin, 2)
    user = InferenceClient(port, credentials=key_files.load_peer_keys(keys, key_files.CLIENT))
    await user.start()
    try:
        record = await user.add_request("a user", SamplingParams(num_tokens_to_generate=2))
        assert record.generated_tokens == expected_tokens("a user", 2)
        assert (await user.get_status())["engines"] == 2, "clients may ask for STATUS"
        for signal_of in (user.stop_engines, user.pause_engines):
            with pytest.raises(RequestFailed) as refused:
                await asyncio.wait_for(signal_of(), 10)
            assert refused.value.code == ErrorCode.FORBIDDEN
            assert "admin role" in refused.value.message
    finally:
        user.stop()
    status = await admin.get_status()
    assert status["state"] == "running" and status["engines"] == 2
    assert status["counters"]["forbidden"] == 2
    assert all(engine.poll() is None for engine in processes.started[1:])

    # A client key cannot register as an engine, nor an engine key connect as a client.
    client_peer = RawPeer(port, key_files.load_peer_keys(keys, key_files.CLIENT))
    engine_peer = RawPeer(port, key_files.load_peer_keys(keys, key_files.ENGINE))
    try:
        await client_peer.send(Header.REGISTER, 7, 8, "impostor")
        _ref, code, message = await client_peer.receive_until(Header.ERROR)
        assert code == ErrorCode.FORBIDDEN and "REGISTER" in message
        await engine_peer.send(Header.CONNECT, protocol.PROTOCOL_VERSION)
        _ref, code, message = await engine_peer.receive_until(Header.ERROR)
        assert code == ErrorCode.FORBIDDEN and "CONNECT" in message
        await engine_peer.send(Header.SUBMIT_REQUEST, 1, "x", {})
        ref, code, _message = await engine_peer.receive_until(Header.ERROR)
        assert (ref, code) == (1, ErrorCode.FORBIDDEN)
    finally:
        client_peer.close()
        engine_peer.close()
    assert (await admin.get_status())["engines"] == 2

    await asyncio.wait_for(admin.stop_engines(), 10)  # the admin key may
    for engine in processes.started[1:]:
        assert engine.wait(10) == 0
    assert_no_secret_in(processes.log(f"coordinator-{port}") + processes.log("engine-0"), keys)


async def test_a_reused_identity_gets_the_role_of_its_new_connection(processes, admin, port, keys):
    """ROUTER frees an identity when its connection drops, and another allowed key can then
    connect under it: the role must come from each message, not from the handshake."""
    start_secure(processes, port, keys, engines=1)
    await admin.start()
    await wait_for_engines(admin, 1)
    identity = b"shared-" + uuid.uuid4().bytes
    first = RawPeer(port, key_files.load_peer_keys(keys, key_files.ADMIN), identity)
    try:
        await first.send(Header.CONNECT, protocol.PROTOCOL_VERSION)
        await first.receive_until(Header.CONNECT_ACK)
    finally:
        first.close()
    await asyncio.sleep(1.0)  # the coordinator's next poll notices the closed connection
    second = RawPeer(port, key_files.load_peer_keys(keys, key_files.CLIENT), identity)
    try:
        # No CONNECT: the coordinator still knows this identity as the admin's connection.
        await second.send(Header.SUBMIT_REQUEST, 1, "same identity", {"num_tokens_to_generate": 2})
        (results,) = await second.receive_until(Header.RESULTS)
        assert results[0][0] == 1, "the second connection was served under the first one's identity"
        await second.send(Header.STOP, 99)
        ref, code, _message = await second.receive_until(Header.ERROR)
        assert (ref, code) == (99, ErrorCode.FORBIDDEN)
    finally:
        second.close()
    status = await admin.get_status()
    assert status["state"] == "running" and status["engines"] == 1


# ------------------------------------------------------------------ admission limits


async def test_one_client_flooding_hits_its_cap_while_another_is_served(
    processes, admin, port, keys
):
    start_secure(
        processes,
        port,
        keys,
        1,
        "--max-inflight-per-client",
        "50",
        "--max-prompt-tokens",
        "100",
        engine_args=("--step-delay", "0.02"),
    )
    await admin.start()
    await wait_for_engines(admin, 1)
    flooder = InferenceClient(port, credentials=key_files.load_peer_keys(keys, key_files.CLIENT))
    await flooder.start()
    try:
        long = SamplingParams(num_tokens_to_generate=300)
        flood = [flooder.add_request(f"flood {i}", long) for i in range(400)]
        await asyncio.sleep(0.5)
        served = await asyncio.wait_for(
            asyncio.gather(
                *(
                    admin.add_request(f"other {i}", SamplingParams(num_tokens_to_generate=2))
                    for i in range(20)
                )
            ),
            20,
        )
        assert [r.generated_tokens for r in served] == [
            expected_tokens(f"other {i}", 2) for i in range(20)
        ]
        refused = [f.exception() for f in flood if f.done() and f.exception() is not None]
        assert len(refused) == 350, "exactly the requests over the cap are refused"
        assert all(isinstance(e, RequestFailed) and e.code == "overloaded" for e in refused)
        assert "--max-inflight-per-client 50" in refused[0].message
        status = await admin.get_status()
        assert status["limits"]["max_inflight_per_client"] == 50
        assert status["limits"]["max_prompt_tokens"] == 100
    finally:
        flooder.stop()

    with pytest.raises(RequestFailed) as too_long:
        await admin.add_request(list(range(1, 102)))
    assert too_long.value.code == "prompt_too_long" and "at most 100" in too_long.value.message
    with pytest.raises(RequestFailed) as too_long_text:
        await admin.add_request("x" * 101)  # the byte tokenizer: one token per byte
    assert too_long_text.value.code == "prompt_too_long"
    record = await admin.add_request("y" * 100, SamplingParams(num_tokens_to_generate=1))
    assert len(record.prompt_tokens) == 100, "a prompt at the limit is accepted"


async def test_hostile_authenticated_peer_cannot_stop_serving(processes, admin, port, keys):
    start_secure(processes, port, keys, engines=2)
    await admin.start()
    await wait_for_engines(admin, 2)
    hostile = RawPeer(port, key_files.load_peer_keys(keys, key_files.CLIENT))
    rng = random.Random(4321)
    junk = [
        lambda: rng.randbytes(rng.randint(0, 64)),
        lambda: msgpack.packb([rng.randint(-5, 200), *rng.choices([1, "x", None, b"y"], k=3)]),
        lambda: msgpack.packb([int(Header.ENGINE_REPLY), [[1, b"abcd", None, "stop", None, 0.1]]]),
        lambda: msgpack.packb([int(Header.REGISTER), 0, 8, "x"]),
        lambda: msgpack.packb([int(Header.STOP), rng.randint(0, 9)]),
        lambda: msgpack.packb([int(Header.CONTROL_ACK), 44, 1]),
        lambda: msgpack.packb({"not": "a list"}),
        lambda: msgpack.packb([int(Header.SUBMIT_REQUEST), 1, 2, 3]),
    ]
    served = []

    async def keep_serving() -> None:
        for i in range(100):
            served.append(
                await admin.add_request(f"during {i}", SamplingParams(num_tokens_to_generate=2))
            )

    serving = asyncio.create_task(keep_serving())
    try:
        await hostile.send(Header.CONNECT, protocol.PROTOCOL_VERSION)
        for i in range(10_000):
            frames = [junk[i % len(junk)]()] if i % 97 else [b"two", b"frames"]
            await hostile.socket.send_multipart(frames)
            if i % 500 == 0:
                await asyncio.sleep(0)
        await asyncio.wait_for(serving, 60)
    finally:
        hostile.close()
    assert served[-1].generated_tokens == expected_tokens("during 99", 2)
    status = await admin.get_status()
    assert status["state"] == "running" and status["engines"] == 2
    assert status["counters"]["bad_messages"] >= 3000
    assert status["counters"]["forbidden"] >= 3000  # ENGINE_REPLY, REGISTER, STOP, CONTROL_ACK
    assert processes.started[0].poll() is None


# ------------------------------------------------------------------ binding and keys


def test_non_loopback_bind_needs_credentials_or_insecure(processes, port):
    refused = subprocess.run(
        [DPSERVE, "coordinator", "--host", "0.0.0.0", "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "--credentials" in refused.stderr and "--insecure" in refused.stderr

    insecure = processes.coordinator(port, "--host", "0.0.0.0", "--insecure")
    deadline = time.monotonic() + 30
    while "listening on port" not in processes.log(f"coordinator-{port}"):
        assert insecure.poll() is None, processes.log(f"coordinator-{port}")
        assert time.monotonic() < deadline, "the --insecure coordinator did not start"
        time.sleep(0.1)
    assert "WITHOUT credentials" in processes.log(f"coordinator-{port}")


def test_keys_generate_writes_the_documented_layout(tmp_path: Path):
    directory = tmp_path / "creds"
    result = subprocess.run(
        [DPSERVE, "keys", "generate", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for name in ("coordinator", "engine", "client", "admin"):
        assert stat.S_IMODE((directory / f"{name}.key_secret").stat().st_mode) == 0o600
        assert stat.S_IMODE((directory / f"{name}.key").stat().st_mode) == 0o644
    for role in key_files.ROLES:
        (allowed,) = (directory / "allowed" / role).iterdir()
        assert allowed.read_text() == (directory / f"{role}.key").read_text()
    assert_no_secret_in(result.stdout + result.stderr, directory)
    server = key_files.load_server_keys(directory)
    assert sorted(server.roles.values()) == ["admin", "client", "engine"]

    before = (directory / "engine.key").read_text()
    again = subprocess.run(
        [DPSERVE, "keys", "generate", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 2 and "--force" in again.stderr
    assert (directory / "engine.key").read_text() == before, "nothing is overwritten"
    forced = subprocess.run(
        [DPSERVE, "keys", "generate", str(directory), "--force"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert forced.returncode == 0
    assert (directory / "engine.key").read_text() != before


@pytest.mark.timeout(180)
def test_serve_without_flags_uses_throwaway_keys_on_loopback(tmp_path: Path):
    port, http_port = free_port(), free_port()
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    env.pop(key_files.ENV_CREDENTIALS, None)
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        serve = subprocess.Popen(
            [DPSERVE, "-v", "serve", "--fake", "--data-parallel-size", "1", "--port", str(port),
             "--http-port", str(http_port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "Press Ctrl-C to stop." not in log.read_text(errors="replace"):
            assert serve.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        (line,) = [ln for ln in log.read_text().splitlines() if "throw-away keys in" in ln]
        key_dir = Path(line.split("throw-away keys in ")[1].split(" (removed on exit)")[0])
        assert key_dir.parent == runtime / "dpserve"
        assert stat.S_IMODE(key_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(key_dir.parent.stat().st_mode) == 0o700
        assert _listening_addresses(port) == {"127.0.0.1"}, "ZMQ must listen on loopback only"
        assert _listening_addresses(http_port) == {"127.0.0.1"}

        assert asyncio.run(_plain_client_refused(port)), "no keys, no connection"
        generated = subprocess.run(
            [DPSERVE, "generate", "Hello", "--address", f"127.0.0.1:{port}", "--max-tokens", "4"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert generated.returncode == 0, generated.stderr
        assert generated.stdout.strip() == bytes(expected_tokens("Hello", 4)).decode()
        secrets = secret_keys(key_dir)

        serve.send_signal(signal.SIGINT)
        assert serve.wait(60) == 0
        assert not key_dir.exists(), "the throw-away keys must be removed on exit"
        text = log.read_text(errors="replace")
        assert "coordinator" in text and "engine rank 0" in text
        for secret in secrets:
            assert secret not in text
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


async def _plain_client_refused(port: int) -> bool:
    client = InferenceClient(port, handshake_timeout=1.5)
    try:
        await client.start()
    except CoordinatorUnavailable:
        return True
    client.stop()
    return False


def _listening_addresses(port: int) -> set[str]:
    """Local IPv4/IPv6 addresses with a listening TCP socket on ``port`` (from /proc)."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        if not os.path.exists(table):
            continue
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            address, _, hex_port = fields[1].partition(":")
            if int(hex_port, 16) != port or fields[3] != "0A":  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word in host (little-endian) order.
            words = [raw[i : i + 4][::-1] for i in range(0, width // 2, 4)]
            packed = b"".join(words)
            if len(packed) == 4:
                found.add(".".join(str(b) for b in packed))
            else:
                found.add(str(ipaddress.ip_address(packed)))
    return found


# ------------------------------------------------------------------ HTTP bearer token


def _http(url: str, token: str | None = None, body: dict | None = None) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            payload = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as error:
        payload, status = error.read().decode(), error.code
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload


@pytest.fixture
def front(processes: Processes, port: int, keys: Path, tmp_path: Path) -> Iterator[str]:
    """``dpserve coordinator --http-port --credentials --api-key-file --admin-api-key-file``
    and one engine."""
    token_file = tmp_path / "api-keys"
    token_file.write_text("# rotated weekly\nold-token-0123456789\nsecret-token-abcdef\n")
    admin_file = tmp_path / "admin-api-keys"
    admin_file.write_text(f"{ADMIN_TOKEN}\n")
    http_port = free_port()
    start_secure(
        processes,
        port,
        keys,
        1,
        "--http-port",
        str(http_port),
        "--api-key-file",
        str(token_file),
        "--admin-api-key-file",
        str(admin_file),
    )
    base = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if _http(f"{base}/ready")[0] == 200:
                break
        except OSError:
            pass
        assert processes.started[0].poll() is None, processes.log(f"coordinator-{port}")
        assert time.monotonic() < deadline, "the HTTP front did not become healthy"
        time.sleep(0.2)
    yield base


def test_bearer_token_guards_the_api_but_not_health_or_metrics(front: str):
    body = {"prompt": "Hi", "max_tokens": 3}
    status, missing = _http(f"{front}/v1/completions", None, body)
    assert status == 401
    assert missing["error"]["code"] == "invalid_api_key"
    assert missing["error"]["type"] == "invalid_request_error"
    assert _http(f"{front}/v1/completions", "secret-token-abcdeX", body)[0] == 401
    assert _http(f"{front}/v1/models", "")[0] == 401
    status, completion = _http(f"{front}/v1/completions", "secret-token-abcdef", body)
    assert status == 200, completion
    assert completion["choices"][0]["text"] == bytes(expected_tokens("Hi", 3)).decode()
    assert _http(f"{front}/v1/models", "old-token-0123456789")[0] == 200, "every listed token"
    # As X-Api-Key (what the operator sends through the API server's service proxy).
    for token, expected in (("secret-token-abcdef", 200), ("secret-token-abcdeX", 401)):
        request = urllib.request.Request(f"{front}/v1/models", headers={"X-Api-Key": token})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == expected
        except urllib.error.HTTPError as error:
            assert error.code == expected
    assert _http(f"{front}/livez")[0] == 200
    status, metrics = _http(f"{front}/metrics")
    assert status == 200
    assert "dpserve_limit_prompt_tokens 32768.0" in metrics
    assert "dpserve_limit_inflight_per_client 10000.0" in metrics


LOAD = ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/adapters/a"})
UNLOAD = ("/v1/unload_lora_adapter", {"lora_name": "a"})


def test_only_the_admin_token_loads_and_unloads_adapters(front: str):
    for endpoint, body in (LOAD, UNLOAD):
        status, refused = _http(f"{front}{endpoint}", "secret-token-abcdef", body)
        assert status == 403, refused
        assert refused["error"]["code"] == "admin_api_key_required"
        assert refused["error"]["type"] == "invalid_request_error"
        assert "--admin-api-key-file" in refused["error"]["message"]
        assert _http(f"{front}{endpoint}", None, body)[0] == 401
        assert _http(f"{front}{endpoint}", "admin-token-987654321X", body)[0] == 401
    # The admin token passes the front; the (fake) engine then has no LoRA support: a 400
    # with its reason, from past the front's check.
    status, answer = _http(f"{front}{LOAD[0]}", ADMIN_TOKEN, LOAD[1])
    assert status == 400 and "serves no LoRA adapters" in str(answer), answer
    # The admin token may use the rest of the API too.
    assert _http(f"{front}/v1/models", ADMIN_TOKEN)[0] == 200


async def _statuses(zmq_port: int, keys: api_tokens.ApiKeys, token: str | None) -> dict[str, int]:
    """The front's status for each API path with ``keys`` configured and ``token`` sent (a
    real aiohttp server and requests; the coordinator is real too)."""
    client = InferenceClient(zmq_port, handshake_timeout=20)
    await client.start()
    try:
        app = create_app(client, ByteTokenizer(), "m", api_keys=keys)
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        async with TestClient(TestServer(app)) as http:
            found = {}
            for endpoint, body in (LOAD, UNLOAD):
                response = await http.post(endpoint, json=body, headers=headers)
                found[endpoint] = response.status
            found["/v1/models"] = (await http.get("/v1/models", headers=headers)).status
            found["/metrics"] = (await http.get("/metrics")).status
            return found
    finally:
        client.stop()


async def test_the_admin_endpoints_need_an_admin_token_once_any_key_is_configured(
    processes: Processes, port: int
):
    processes.coordinator(port, *FAST)
    processes.fake_engine(port, 0)
    plain_only = api_tokens.ApiKeys(api=(b"plain",))
    admin_only = api_tokens.ApiKeys(admin=(b"root",))
    both = api_tokens.ApiKeys(api=(b"plain",), admin=(b"root",))
    load, unload, models = LOAD[0], UNLOAD[0], "/v1/models"
    # An API token never loads; without an admin key configured nobody does through HTTP.
    found = await _statuses(port, plain_only, "plain")
    assert (found[load], found[unload], found[models]) == (403, 403, 200)
    # With admin keys alone the rest of the API stays open, as without keys.
    found = await _statuses(port, admin_only, None)
    assert (found[load], found[unload], found[models], found["/metrics"]) == (401, 401, 200, 200)
    found = await _statuses(port, both, "root")
    assert found[load] not in (401, 403) and found[models] == 200  # past the front's check
    found = await _statuses(port, both, "plain")
    assert (found[load], found[unload], found[models]) == (403, 403, 200)
    # No keys at all: as before, the front checks nothing (loopback; the coordinator's roles
    # still apply).
    client = InferenceClient(port, handshake_timeout=20)
    await client.start()
    try:
        async with TestClient(TestServer(create_app(client, ByteTokenizer(), "m"))) as http:
            response = await http.post(load, json=LOAD[1])
            assert response.status not in (401, 403)
    finally:
        client.stop()


def test_api_keys_are_never_shown():
    keys = api_tokens.ApiKeys(api=(b"plain-secret",), admin=(b"admin-secret",))
    assert "secret" not in repr(keys) and "secret" not in str(keys)
