"""The operator's CURVE credentials: key generation, the Secrets, per-pod mounts, rotation."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import zmq
from zmq.utils import z85

from dpserve.security import key_files
from dpserve_operator import credentials, handlers, manifests, rbac
from dpserve_operator.spec import parse_spec

NAME, NAMESPACE = "demo", "inference"
SPEC = {"model": "smollm2-135m-instruct", "image": "ghcr.io/dpserve/runtime-cpu:0.1.0"}
MOUNT = "/etc/dpserve/credentials"
SECRET_KEY_LINE = "secret-key"


@pytest.fixture(scope="module")
def files() -> dict[str, str]:
    return credentials.generate_key_files()


def secret_keys(files: dict[str, str]) -> list[str]:
    """Every z85 secret key in ``files``."""
    found = []
    for text in files.values():
        for line in text.splitlines():
            if SECRET_KEY_LINE in line:
                found.append(line.split('"')[1])
    return found


def decoded(secret: dict[str, Any]) -> dict[str, str]:
    return credentials.decode_secret_data(secret)


def workloads(files: dict[str, str]) -> dict[str, dict[str, Any]]:
    objects = manifests.all_children(
        NAME,
        NAMESPACE,
        parse_spec(SPEC, name=NAME),
        credentials_hash=credentials.credentials_hash(files),
    )
    by_kind = {obj["kind"]: obj for obj in objects if obj["kind"] in ("Deployment", "StatefulSet")}
    return {"coordinator": by_kind["Deployment"], "engine": by_kind["StatefulSet"]}


def project(secret: dict[str, Any], volume: dict[str, Any], root: Path) -> Path:
    """What the kubelet does with a secret volume's ``items``."""
    data = decoded(secret)
    for item in volume["secret"]["items"]:
        target = root / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(data[item["key"]])
        target.chmod(volume["secret"]["defaultMode"])
    return root


def credentials_volume(workload: dict[str, Any]) -> dict[str, Any]:
    (volume,) = [
        v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "credentials"
    ]
    return volume


# --------------------------------------------------------------------------- key material


def test_generated_keys_are_valid_z85_pairs(files: dict[str, str]) -> None:
    assert sorted(files) == sorted(credentials.KEY_FILES)
    assert credentials.valid_key_files(files)
    for name in ("coordinator", "engine", "client", "admin"):
        public = credentials.public_key(files[f"{name}.key"])
        assert public is not None and len(public) == 40
        assert len(z85.decode(public)) == 32
        (secret,) = secret_keys({name: files[f"{name}.key_secret"]})
        assert len(z85.decode(secret)) == 32
        assert zmq.curve_public(secret.encode()).decode() == public
        assert SECRET_KEY_LINE not in files[f"{name}.key"]
    # Four distinct key pairs, and a fresh set every time.
    assert len(set(secret_keys(files))) == 4
    assert set(secret_keys(credentials.generate_key_files())).isdisjoint(secret_keys(files))


def test_invalid_key_sets_are_detected(files: dict[str, str]) -> None:
    assert not credentials.valid_key_files({})
    assert not credentials.valid_key_files({k: v for k, v in files.items() if k != "admin.key"})
    swapped = {**files, "engine.key": files["client.key"]}
    assert not credentials.valid_key_files(swapped)
    other = credentials.generate_key_files()
    mismatched = {**files, "engine.key_secret": other["engine.key_secret"]}
    assert not credentials.valid_key_files(mismatched)
    garbled = {**files, "coordinator.key_secret": files["coordinator.key_secret"][:-10]}
    assert not credentials.valid_key_files(garbled)


def test_the_hash_covers_public_keys_only(files: dict[str, str]) -> None:
    digest = credentials.credentials_hash(files)
    assert len(digest) == 16 and digest == credentials.credentials_hash(dict(files))
    assert credentials.credentials_hash(credentials.generate_key_files()) != digest
    # The secret files do not enter the hash.
    only_public = {k: v for k, v in files.items() if not k.endswith("_secret")}
    blanked = {**only_public, **{k: "" for k in files if k.endswith("_secret")}}
    assert credentials.credentials_hash(blanked) == digest


# --------------------------------------------------------------------------- Secrets


@pytest.mark.parametrize("version", ["1.25", kubernetes_validate.latest_version()])
def test_secrets_validate_strictly(files: dict[str, str], version: str) -> None:
    for secret in (
        manifests.credentials_secret(NAME, NAMESPACE, files),
        manifests.client_credentials_secret(NAME, NAMESPACE, files),
    ):
        kubernetes_validate.validate(secret, version, strict=True)


def test_credentials_secret_holds_every_key_and_no_secret_in_metadata(
    files: dict[str, str],
) -> None:
    secret = manifests.credentials_secret(NAME, NAMESPACE, files)
    assert secret["metadata"]["name"] == "demo-credentials"
    assert secret["metadata"]["labels"]["app.kubernetes.io/instance"] == NAME
    assert secret["type"] == "Opaque"
    assert decoded(secret) == files
    metadata = json.dumps(secret["metadata"])
    assert secret["metadata"]["annotations"] == {
        credentials.HASH_ANNOTATION: credentials.credentials_hash(files)
    }
    for key in secret_keys(files):
        assert key not in metadata


def test_client_secret_is_a_client_credentials_directory(
    files: dict[str, str], tmp_path: Path
) -> None:
    secret = manifests.client_credentials_secret(NAME, NAMESPACE, files)
    assert secret["metadata"]["name"] == "demo-client-credentials"
    data = decoded(secret)
    assert sorted(data) == sorted(credentials.CLIENT_KEY_FILES)
    assert "coordinator.key_secret" not in data and "engine.key_secret" not in data
    for name, text in data.items():
        path = tmp_path / name
        path.write_text(text)
        path.chmod(0o600)
    admin = key_files.load_peer_keys(tmp_path)
    assert admin.role == "admin"
    assert admin.server_public.decode() == credentials.public_key(files["coordinator.key"])
    assert key_files.load_peer_keys(tmp_path, "client").role == "client"


# --------------------------------------------------------------------------- mounts


def test_commands_use_the_mounted_credentials_and_never_insecure(files: dict[str, str]) -> None:
    for workload in workloads(files).values():
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        command = container["command"]
        assert "--insecure" not in command
        assert command[command.index("--credentials") + 1] == MOUNT
        assert {"name": "credentials", "mountPath": MOUNT, "readOnly": True} in (
            container["volumeMounts"]
        )
        volume = credentials_volume(workload)
        assert volume["secret"]["secretName"] == "demo-credentials"
        assert volume["secret"]["defaultMode"] == 0o440


def test_engine_pods_get_only_the_engine_key_pair_and_the_coordinator_public_key(
    files: dict[str, str], tmp_path: Path
) -> None:
    volume = credentials_volume(workloads(files)["engine"])
    items = {item["key"]: item["path"] for item in volume["secret"]["items"]}
    assert items == {"engine.key_secret": "engine.key_secret", "coordinator.key": "coordinator.key"}
    directory = project(manifests.credentials_secret(NAME, NAMESPACE, files), volume, tmp_path)
    mounted = "".join(p.read_text() for p in directory.rglob("*") if p.is_file())
    (engine_secret,) = secret_keys({"e": files["engine.key_secret"]})
    assert [k for k in secret_keys(files) if k in mounted] == [engine_secret]
    keys = key_files.load_peer_keys(directory, "engine")
    assert keys.public.decode() == credentials.public_key(files["engine.key"])
    with pytest.raises(key_files.CredentialsError):
        key_files.load_server_keys(directory)


def test_the_coordinator_pod_gets_its_secret_key_and_the_allowed_keys(
    files: dict[str, str], tmp_path: Path
) -> None:
    volume = credentials_volume(workloads(files)["coordinator"])
    items = {item["key"]: item["path"] for item in volume["secret"]["items"]}
    assert "admin.key_secret" not in items and "engine.key_secret" not in items
    directory = project(manifests.credentials_secret(NAME, NAMESPACE, files), volume, tmp_path)
    server = key_files.load_server_keys(directory)
    assert server.public.decode() == credentials.public_key(files["coordinator.key"])
    assert {role: key.decode() for key, role in server.roles.items()} == {
        role: credentials.public_key(files[f"{role}.key"]) for role in ("engine", "client", "admin")
    }
    # Its HTTP front connects with the client key (not admin: there is none).
    assert key_files.load_peer_keys(directory).role == "client"
    # And takes both HTTP tokens, each from its file: the API token and the admin token
    # that alone loads and unloads adapters.
    (container,) = workloads(files)["coordinator"]["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    for flag, file in (
        ("--api-key-file", credentials.API_TOKEN_FILE),
        ("--admin-api-key-file", credentials.ADMIN_API_TOKEN_FILE),
    ):
        path = Path(command[command.index(flag) + 1])
        assert path == Path(MOUNT) / file
        assert (directory / file).read_text() == files[file]
    tokens = {files[credentials.API_TOKEN_FILE], files[credentials.ADMIN_API_TOKEN_FILE]}
    assert len(tokens) == 2


def test_a_key_set_without_the_admin_token_gets_one_and_nothing_else_changes(
    files: dict[str, str],
) -> None:
    assert credentials.with_admin_token(files) is None
    older = {k: v for k, v in files.items() if k != credentials.ADMIN_API_TOKEN_FILE}
    assert credentials.valid_key_files(older), "still a valid key set: not regenerated"
    completed = credentials.with_admin_token(older)
    assert completed is not None
    token = completed.pop(credentials.ADMIN_API_TOKEN_FILE)
    assert completed == older and len(token.strip()) >= 40
    assert credentials.with_admin_token({**older, credentials.ADMIN_API_TOKEN_FILE: " \n"})


def test_pod_templates_carry_the_public_key_hash(files: dict[str, str]) -> None:
    digest = credentials.credentials_hash(files)
    for workload in workloads(files).values():
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations == {credentials.HASH_ANNOTATION: digest}
    rotated = workloads(credentials.generate_key_files())
    for kind, workload in workloads(files).items():
        assert workload["spec"]["template"] != rotated[kind]["spec"]["template"]
    # User annotations stay alongside.
    spec = parse_spec({**SPEC, "podTemplate": {"metadata": {"annotations": {"a": "b"}}}}, name=NAME)
    deployment = manifests.coordinator_deployment(NAME, NAMESPACE, spec, credentials_hash=digest)
    assert deployment["spec"]["template"]["metadata"]["annotations"] == {
        "a": "b",
        credentials.HASH_ANNOTATION: digest,
    }


# --------------------------------------------------------------------------- operator


def test_rbac_grants_exactly_the_secret_verbs_used() -> None:
    verbs = {verb for group, resource, verb in rbac.PERMISSIONS if resource == "secrets"}
    assert verbs == {"get", "create", "update"}
    assert not any(group == "" and resource == "secrets" and verb in ("list", "watch", "delete")
                   for group, resource, verb in rbac.PERMISSIONS)  # fmt: skip


@pytest.mark.parametrize(
    ("status", "converged"),
    [
        ({"phase": "Ready", "registeredEngines": 2, "observedGeneration": 3}, True),
        ({"phase": "Ready", "registeredEngines": 1, "observedGeneration": 3}, False),
        ({"phase": "Progressing", "registeredEngines": 2, "observedGeneration": 3}, False),
        ({"phase": "Ready", "registeredEngines": 2, "observedGeneration": 2}, False),
        ({}, False),
    ],
)
def test_status_refreshes_fast_until_converged(status: dict[str, Any], converged: bool) -> None:
    spec = parse_spec({**SPEC, "dataParallelSize": 2}, name=NAME)
    assert handlers.converged(status, spec, 3) is converged
    assert handlers.converged(status, None, 3) is False
    assert handlers.STATUS_TICK_SECONDS < handlers.STATUS_REFRESH_SECONDS


def test_secret_data_is_base64_of_the_files(files: dict[str, str]) -> None:
    data = credentials.secret_data(files, ("coordinator.key",))
    assert base64.b64decode(data["coordinator.key"]).decode() == files["coordinator.key"]
