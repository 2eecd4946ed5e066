"""spec.adapters on the one-node cluster: LoRA adapters from a volume, edited without restarts.

With an operator of its own (Helm's own install action, watching this module's namespace
only), in file order:

1. the tiny random Llama and three tiny random PEFT adapters (``tests.lora_adapters``) are
   written to a host directory that a hostPath PersistentVolume and its claim hand to the
   pods as ``spec.modelVolume``;
2. an InferenceDeployment of that model with adapters ``lora-a`` and ``lora-b`` turns Ready,
   and ``status.adapters`` reports both loaded on the engine;
3. through ``kubectl port-forward``, each adapter answers greedily what transformers + peft
   answer with that adapter merged, and the base model what it answers alone (all three
   differ);
4. ``kubectl patch`` of ``spec.adapters`` to ``lora-b`` and ``lora-c``: ``lora-a`` is a 404
   after, ``lora-c`` answers as its merged model does, and no pod was replaced or restarted
   (same UIDs, same restart counts, same workload generations).

The duration from the patch to ``lora-c`` answering is printed in the terminal summary.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import Kubectl, wait_for
from tests.e2e.local_node import TIMINGS, LocalNode, PortForward, cluster_opt_in
from tests.lora_adapters import make_adapter, merged_model, reference_greedy

pytestmark = [pytest.mark.e2e, cluster_opt_in, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
HELM = ROOT / "scripts" / "helm"
CHART = ROOT / "charts" / "dpserve-operator"
CRD_NAME = "inferencedeployments.dpserve.io"
NAME = "lora"
NAMESPACE = "lora"
RELEASE = "lora-dpserve-operator"  # contains the chart name: the objects are named so
OPERATOR_NS = "dpserve-lora-system"
VOLUME = "lora-models"  # the PersistentVolume and its claim
IMAGE = "ghcr.io/dpserve/runtime-cpu:0.1.0"
HTTP_PORT = 8000
MOUNT = "/models"
REGISTER_TIMEOUT = 300.0
ADAPTER_TIMEOUT = 60.0
PROMPT = "hello world"
MAX_TOKENS = 8
# lora-a and lora-b at first; the edit drops lora-a and adds lora-c.
SEEDS = {"lora-a": 11, "lora-b": 12, "lora-c": 13}
JSON = dict[str, Any]


@dataclass
class Setup:
    kubectl: Kubectl
    node: LocalNode
    host_dir: Path

    def helm(self, *args: str) -> str:
        result = subprocess.run(
            [str(HELM), *args],
            env={**os.environ, "KUBECONFIG": str(self.kubectl.kubeconfig),
                 "PYTHON": sys.executable},
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result
        return result.stdout

    def status(self) -> JSON:
        found = self.kubectl.json("get", "infd", NAME, "-n", NAMESPACE)
        return dict(found.get("status") or {})

    def pods(self) -> dict[str, tuple[str, int]]:
        """pod name -> (UID, the container's restart count)."""
        found = self.kubectl.json("get", "pods", "-n", NAMESPACE)["items"]
        return {
            pod["metadata"]["name"]: (
                pod["metadata"]["uid"],
                sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses", [])),
            )
            for pod in found
        }

    def generations(self) -> tuple[int, int]:
        statefulset = self.kubectl.json("get", "statefulset", f"{NAME}-engine", "-n", NAMESPACE)
        deployment = self.kubectl.json("get", "deployment", f"{NAME}-coordinator", "-n", NAMESPACE)
        return statefulset["metadata"]["generation"], deployment["metadata"]["generation"]

    def token(self) -> str:
        secret = self.kubectl.json("get", "secret", f"{NAME}-client-credentials", "-n", NAMESPACE)
        return base64.b64decode(secret["data"]["http-api-token"]).decode().strip()

    def diagnostics(self) -> str:
        pods = self.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
        described = self.kubectl("describe", "infd", NAME, "-n", NAMESPACE, check=False).stdout
        events = self.kubectl("get", "events", "-n", NAMESPACE, check=False).stdout
        operator = self.kubectl(
            "logs", f"deployment/{RELEASE}", "-n", OPERATOR_NS, "--tail=40", check=False
        ).stdout
        return f"{pods}\n{described}\n{events[-3000:]}\n{operator}"


def readable_copy(source: Path, target: Path) -> None:
    """``source`` copied to ``target``, readable by the pods' non-root user (a hostPath
    volume keeps the host's modes; fsGroup does not apply to it)."""
    shutil.copytree(source, target)
    for path in [target, *target.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


@pytest.fixture(scope="module")
def setup(local_node: LocalNode, node_kubectl: Kubectl, tiny_model_path: Path) -> Iterator[Setup]:
    kubectl = node_kubectl
    host_dir = Path(tempfile.mkdtemp(prefix="dpserve-lora-"))
    host_dir.chmod(0o755)
    readable_copy(tiny_model_path, host_dir / "model")
    with tempfile.TemporaryDirectory() as scratch:
        for name, seed in SEEDS.items():
            made = make_adapter(tiny_model_path, Path(scratch) / name, seed=seed)
            readable_copy(made, host_dir / "adapters" / name)
    (host_dir / "adapters").chmod(0o755)
    crd_was_there = kubectl("get", "crd", CRD_NAME, check=False).returncode == 0
    setup = Setup(kubectl, local_node, host_dir)
    setup.helm(
        "install", RELEASE, str(CHART), "--namespace", OPERATOR_NS, "--create-namespace",
        "--set", "watch.allNamespaces=false", "--set", f"watch.namespace={NAMESPACE}",
    )  # fmt: skip
    kubectl.create_namespace(NAMESPACE)
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": VOLUME},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "hostPath": {"path": str(host_dir), "type": "Directory"},
            "claimRef": {"namespace": NAMESPACE, "name": VOLUME},
        },
    }
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": VOLUME, "namespace": NAMESPACE},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": VOLUME,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    kubectl("apply", "-f", "-", input=json.dumps({"kind": "List", "apiVersion": "v1",
                                                  "items": [volume, claim]}))  # fmt: skip
    try:
        yield setup
    finally:
        kubectl("delete", "infd", NAME, "-n", NAMESPACE, "--ignore-not-found",
                "--timeout=180s", timeout=200, check=False)  # fmt: skip
        kubectl("delete", "namespace", NAMESPACE, "--timeout=180s", timeout=200, check=False)
        kubectl("delete", "pv", VOLUME, "--ignore-not-found", "--timeout=60s", check=False)
        setup.helm("uninstall", RELEASE, "--namespace", OPERATOR_NS)
        kubectl("delete", "namespace", OPERATOR_NS, "--timeout=120s", timeout=140, check=False)
        if not crd_was_there:
            kubectl("delete", "crd", CRD_NAME, "--timeout=60s", check=False)
        shutil.rmtree(host_dir, ignore_errors=True)


def deployment(adapters: list[str]) -> JSON:
    return {
        "apiVersion": "dpserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": f"{MOUNT}/model",
            "image": IMAGE,
            "dataParallelSize": 1,
            "modelVolume": {"claimName": VOLUME, "mountPath": MOUNT},
            "adapters": adapter_list(adapters),
            "engine": {"maxBatchSize": 4, "dtype": "float32", "device": "cpu", "maxLoras": 2,
                       "resources": {"requests": {"cpu": "250m", "memory": "512Mi"},
                                     "limits": {"cpu": "1", "memory": "1Gi"}}},
            "coordinator": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                                          "limits": {"memory": "512Mi"}}},
        },
    }  # fmt: skip


def adapter_list(names: list[str]) -> list[JSON]:
    return [{"name": name, "path": f"{MOUNT}/adapters/{name}"} for name in names]


def loaded(setup: Setup, names: list[str]) -> bool:
    """Every one of ``names`` (in order) loaded, on the one engine (rank 0)."""
    entries = setup.status().get("adapters") or []
    return [(e["name"], e.get("loaded"), e.get("ranks")) for e in entries] == [
        (n, True, [0]) for n in names
    ]


def expected_text(model: Path, adapter: Path | None) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = tokenizer(PROMPT)["input_ids"]
    tokens = reference_greedy(merged_model(model, adapter), prompt, MAX_TOKENS)
    return str(tokenizer.decode(tokens))


def complete(port: int, token: str, model: str) -> tuple[int, JSON]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def base_model(port: int, token: str) -> str:
    """The base model's name in ``/v1/models`` (the one without a parent), after checking
    that both adapters are listed with it as their parent."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        models = json.loads(response.read())["data"]
    (base,) = [model["id"] for model in models if model["parent"] is None]
    parents = {model["id"]: model["parent"] for model in models if model["parent"] is not None}
    assert parents == {"lora-a": base, "lora-b": base}, models
    name: str = base
    return name


def text_of(port: int, token: str, model: str) -> str:
    status, reply = complete(port, token, model)
    assert status == 200, reply
    text: str = reply["choices"][0]["text"]
    return text


def test_two_adapters_from_the_volume_are_loaded(setup: Setup) -> None:
    setup.kubectl("apply", "-f", "-", input=json.dumps(deployment(["lora-a", "lora-b"])))
    wait_for(
        lambda: setup.status().get("phase") == "Ready",
        REGISTER_TIMEOUT,
        "the engine registered",
        diagnostics=setup.diagnostics,
    )
    wait_for(
        lambda: loaded(setup, ["lora-a", "lora-b"]),
        ADAPTER_TIMEOUT,
        "status.adapters: lora-a and lora-b loaded on rank 0",
        diagnostics=setup.diagnostics,
    )
    statefulset = setup.kubectl.json("get", "statefulset", f"{NAME}-engine", "-n", NAMESPACE)
    command = statefulset["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--enable-lora" in command and command[command.index("--max-loras") + 1] == "2"
    assert "lora-a" not in json.dumps(statefulset["spec"]["template"])


def test_each_adapter_answers_as_its_merged_model(setup: Setup, tiny_model_path: Path) -> None:
    token = setup.token()
    adapters = setup.host_dir / "adapters"
    with PortForward(setup.kubectl, NAMESPACE, f"svc/{NAME}-coordinator", [HTTP_PORT]) as pf:
        port = pf.local_ports[HTTP_PORT]
        base = text_of(port, token, base_model(port, token))
        answers = {name: text_of(port, token, name) for name in ("lora-a", "lora-b")}
    assert base == expected_text(tiny_model_path, None)
    for name, text in answers.items():
        assert text == expected_text(tiny_model_path, adapters / name), name
    assert len({base, *answers.values()}) == 3, (base, answers)


def test_the_api_token_cannot_load_adapters(setup: Setup) -> None:
    """Only the admin token (the operator's) loads and unloads; the API token gets a 403."""
    body = {"lora_name": "lora-x", "lora_path": f"{MOUNT}/adapters/lora-a"}
    with PortForward(setup.kubectl, NAMESPACE, f"svc/{NAME}-coordinator", [HTTP_PORT]) as pf:
        request = urllib.request.Request(
            f"http://127.0.0.1:{pf.local_ports[HTTP_PORT]}/v1/load_lora_adapter",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json",
                     "Authorization": f"Bearer {setup.token()}"},
        )  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 403
    assert json.loads(refused.value.read())["error"]["code"] == "admin_api_key_required"


def test_an_edit_unloads_and_loads_without_restarting_a_pod(
    setup: Setup, tiny_model_path: Path
) -> None:
    pods, generations = setup.pods(), setup.generations()
    token = setup.token()
    started = time.monotonic()
    patch = json.dumps({"spec": {"adapters": adapter_list(["lora-b", "lora-c"])}})
    setup.kubectl("patch", "infd", NAME, "-n", NAMESPACE, "--type=merge", "-p", patch)
    with PortForward(setup.kubectl, NAMESPACE, f"svc/{NAME}-coordinator", [HTTP_PORT]) as pf:
        port = pf.local_ports[HTTP_PORT]
        wait_for(
            lambda: complete(port, token, "lora-c")[0] == 200,
            ADAPTER_TIMEOUT,
            "lora-c answering after the patch",
            diagnostics=setup.diagnostics,
        )
        TIMINGS["kubectl patch spec.adapters -> the new adapter answers"] = (
            time.monotonic() - started
        )
        wait_for(
            lambda: complete(port, token, "lora-a")[0] == 404,
            ADAPTER_TIMEOUT,
            "lora-a a 404 after the patch",
            diagnostics=setup.diagnostics,
        )
        status, refused = complete(port, token, "lora-a")
        answer = text_of(port, token, "lora-c")
        kept = text_of(port, token, "lora-b")
    assert status == 404 and refused["error"]["code"] == "model_not_found", refused
    assert answer == expected_text(tiny_model_path, setup.host_dir / "adapters" / "lora-c")
    assert kept == expected_text(tiny_model_path, setup.host_dir / "adapters" / "lora-b")
    wait_for(
        lambda: loaded(setup, ["lora-b", "lora-c"]),
        ADAPTER_TIMEOUT,
        "status.adapters: lora-b and lora-c loaded",
        diagnostics=setup.diagnostics,
    )
    assert setup.pods() == pods, "no pod replaced or restarted"
    assert setup.generations() == generations, "no workload changed"
