"""README.md's Kubernetes block, extracted from README.md and run as written, on the one-node
cluster: so the README and reality cannot drift.

The block runs with bash (``-e``: the first failing command fails the test) from the clone's
root, as a new user on the documented local path would: a bare ``PATH`` (the block puts
``.venv/bin`` on it itself), ``KUBECONFIG`` set as the preceding README block says, and a
fresh ``HOME`` without ``XDG_RUNTIME_DIR`` (so its credentials land under the test's own
``$HOME/.config``). It must exit 0, answer both requests, and leave nothing behind: no
process of its session (the port-forward), no credentials directory, no file holding a key
in the clone, and on the cluster no operator, CRD, ``dpserve-system`` namespace or child of
``demo``.

The checks on the block's text need no cluster and run everywhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.cluster import Kubectl, wait_for
from tests.e2e.local_node import TIMELINES, TIMINGS, cluster_opt_in

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
OPERATOR_NS = "dpserve-system"
CRD = "inferencedeployments.dpserve.io"
# The block's port-forward binds these on 127.0.0.1, as typed.
FORWARDED_PORTS = (5555, 8000)
BLOCK_TIMEOUT = 900
# Markers of key material: ZMQ's CURVE secret certificates, and the names the Secret uses.
SECRET_MARKERS = (b"secret-key", b"curve")
SECRET_NAMES = ("key_secret", "http-api-token")
SKIPPED_DIRS = {".git", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}


def kubernetes_block() -> str:
    """The ```bash block of README's "On Kubernetes" section that installs the operator."""
    section = README.read_text().split("\n## On Kubernetes\n", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "helm install" in b]
    assert len(blocks) == 1, f"expected one block with `helm install`, found {len(blocks)}"
    return blocks[0]


# --------------------------------------------------------------------------- the text


def test_the_block_runs_as_typed_on_the_local_path() -> None:
    block = kubernetes_block()
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    commands = [line for line in lines if line]
    assert commands[0] == 'export PATH="$PWD/.venv/bin:$PATH"', commands[0]
    assert "sudo" not in block
    # Helm through scripts/helm (the local path has no helm binary), named in the block.
    helm_lines = [c for c in commands if " install " in c or " uninstall " in c]
    assert helm_lines and all(c.startswith("scripts/helm ") for c in helm_lines), helm_lines
    # Nothing that blocks a pasted block (a watch), and every wait bounded.
    kubectl = [c for c in commands if c.startswith("kubectl ")]
    assert not any(re.search(r"(^| )(-w|--watch)( |$)", c) for c in kubectl), kubectl
    waits = [c for c in commands if c.startswith("kubectl wait")]
    assert waits and all("--timeout=" in c for c in waits), waits


def test_the_block_keeps_credentials_out_of_the_clone_and_cleans_up() -> None:
    block = kubernetes_block()
    assert 'creds="${XDG_RUNTIME_DIR:-$HOME/.config}/dpserve/demo-credentials"' in block
    # umask in a subshell: it does not stay in effect in the user's shell.
    assert "(umask 077;" in block and re.search(r"^umask", block, re.M) is None
    assert "admin.key_secret" not in block  # the client key does for generate
    assert "& forward=$!" in block and 'kill $forward; rm -r "$creds"' in block
    for cleanup in ("kubectl delete infd demo", f"kubectl delete namespace {OPERATOR_NS}",
                    f"kubectl delete crd {CRD}"):  # fmt: skip
        assert cleanup in block, cleanup
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "demo-credentials/admin.key_secret"], cwd=ROOT, check=False
    )
    assert ignored.returncode == 0, ".gitignore does not cover demo-credentials/"


def test_the_first_requests_ask_the_instruct_model_greedily() -> None:
    block = kubernetes_block()
    generate = next(line for line in block.splitlines() if line.startswith("dpserve generate"))
    assert "--chat" in generate and "--temperature" not in generate  # greedy by default
    assert '"temperature": 0' in block and "/v1/chat/completions" in block


# --------------------------------------------------------------------------- on the cluster


@pytest.mark.e2e
@cluster_opt_in
@pytest.mark.timeout(BLOCK_TIMEOUT + 600)
def test_the_readme_block_runs_verbatim_on_the_cluster(
    node_kubectl: Kubectl, tmp_path: Path
) -> None:
    kubectl = node_kubectl
    remove_leftovers(kubectl)
    for port in FORWARDED_PORTS:
        assert port_free(port), f"127.0.0.1:{port} is taken: the README's port-forward needs it"
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": str(home),
        "KUBECONFIG": str(kubectl.kubeconfig),
        "LANG": "C.UTF-8",
    }
    started_wall, started = time.time(), time.monotonic()
    process = subprocess.Popen(
        ["bash", "-e", "-c", kubernetes_block()],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the README block ran over {BLOCK_TIMEOUT} s:\n{output[-6000:]}")
    TIMINGS["README Kubernetes block, as typed: start -> end"] = time.monotonic() - started
    left = session_left_running(process.pid)
    print(output)
    assert process.returncode == 0, f"the README block exited {process.returncode}:\n{output}"
    assert not left, f"the block left processes running: {left}"

    # Both requests answered: dpserve generate's text, then curl's JSON.
    generated, _, answered = output.rpartition('{"id"')
    reply, _ = json.JSONDecoder().raw_decode('{"id"' + answered)
    assert reply["choices"][0]["message"]["content"].strip(), reply
    # Greedy, through the chat template: the instruct model answers (not a ramble).
    assert "Paris" in generated, output[-3000:]

    credentials = home / ".config" / "dpserve" / "demo-credentials"
    assert not credentials.exists(), sorted(credentials.iterdir())
    assert (home / ".config" / "dpserve").stat().st_mode & 0o077 == 0
    assert not key_files_in(ROOT, since=started_wall)

    ended = time.monotonic()
    seen: list[str] = []

    def everything_removed() -> bool:
        left = [
            name
            for args in (("get", "crd", CRD), ("get", "namespace", OPERATOR_NS))
            for name in kubectl(*args, "-o", "name", check=False).stdout.split()
        ]
        listed = kubectl("get", "all", "-n", "default", "-o", "name", check=False).stdout
        left += [name for name in listed.split() if "demo-" in name]
        # What is still there, each time it changes: how the garbage collection went.
        line = f"{time.monotonic() - ended:6.1f} s after the block: {' '.join(left) or 'nothing'}"
        if not seen or seen[-1].split(": ", 1)[1] != line.split(": ", 1)[1]:
            seen.append(line)
        return not left

    def diagnostics() -> str:
        return "\n".join(
            kubectl(*args, check=False).stdout
            for args in (
                ("get", "all,events", "-n", "default", "-o", "wide"),
                ("get", "namespaces"),
                ("get", "crd"),
            )
        )

    # Garbage collection is asynchronous: the pods go within their grace period (60 s).
    try:
        wait_for(everything_removed, 180, "the block's objects gone", diagnostics=diagnostics)
    finally:
        TIMELINES["README Kubernetes block: what was left after it"] = seen
    TIMINGS["README Kubernetes block: end -> the cluster empty again"] = time.monotonic() - ended


def remove_leftovers(kubectl: Kubectl) -> None:
    """What an earlier test that failed midway may have left (the block installs from
    scratch: `helm install` of a release that exists fails)."""
    if kubectl("get", "crd", CRD, check=False).returncode == 0:
        kubectl("delete", "infd", "--all", "--all-namespaces", "--timeout=120s",
                check=False, timeout=140)  # fmt: skip
    if kubectl("get", "namespace", OPERATOR_NS, check=False).returncode == 0:
        subprocess.run(
            [str(ROOT / "scripts" / "helm"), "uninstall", "dpserve-operator",
             "--namespace", OPERATOR_NS],
            env={**os.environ, "KUBECONFIG": str(kubectl.kubeconfig)},
            capture_output=True, timeout=300, check=False,
        )  # fmt: skip
        kubectl("delete", "namespace", OPERATOR_NS, "--timeout=120s", check=False, timeout=140)
    kubectl("delete", "crd", CRD, "--ignore-not-found", "--timeout=60s", check=False, timeout=80)


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def session_left_running(session: int) -> list[str]:
    """Processes still in the block's session (its port-forward, if not killed); they are
    killed, and named."""
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) != session:
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
        left.append(f"{entry.name}: {command}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(entry.name), signal.SIGKILL)
    return left


def key_files_in(root: Path, since: float) -> list[str]:
    """Files under ``root`` written since ``since`` that hold key material or are named like
    the Secret's keys (the whole clone, .venv included; .git and caches left out)."""
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in SKIPPED_DIRS]
        fetched = Path(directory) / "demo-credentials"
        if "demo-credentials" in subdirs and fetched.stat().st_mtime >= since:
            found.append(str(fetched))
        for name in files:
            path = Path(directory) / name
            try:
                if path.stat().st_mtime < since:
                    continue
                head = path.read_bytes()[:4096]
            except OSError:
                continue
            if any(part in name for part in SECRET_NAMES) or all(m in head for m in SECRET_MARKERS):
                found.append(str(path))
    return found
