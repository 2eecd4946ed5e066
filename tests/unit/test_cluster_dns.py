"""scripts/cluster_dns.py: the records the one-node cluster's dnsmasq serves."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cluster_dns.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cluster_dns", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def service(name: str, cluster_ip: str, namespace: str = "ns") -> dict:
    return {"metadata": {"name": name, "namespace": namespace}, "spec": {"clusterIP": cluster_ip}}


def endpoints(name: str, *addresses: dict, namespace: str = "ns") -> dict:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "subsets": [{"addresses": list(addresses)}],
    }


def test_cluster_ip_services_headless_services_and_pod_hostnames() -> None:
    dns = load()
    text = dns.hosts_text(
        [service("demo-coordinator", "10.96.0.20"), service("demo-engine", "None")],
        [
            endpoints("demo-coordinator", {"ip": "10.244.0.5"}),
            endpoints(
                "demo-engine",
                {"ip": "10.244.0.6", "hostname": "demo-engine-0"},
                {"ip": "10.244.0.7", "hostname": "demo-engine-1"},
            ),
        ],
    )
    assert text.splitlines() == [  # sorted by name
        # A ClusterIP Service resolves to its ClusterIP, never to its pods.
        "10.96.0.20 demo-coordinator.ns.svc.cluster.local",
        # Each pod with a hostname by name, and a headless Service to its ready endpoints.
        "10.244.0.6 demo-engine-0.demo-engine.ns.svc.cluster.local",
        "10.244.0.7 demo-engine-1.demo-engine.ns.svc.cluster.local",
        "10.244.0.6 demo-engine.ns.svc.cluster.local",
        "10.244.0.7 demo-engine.ns.svc.cluster.local",
    ]


def test_the_file_is_replaced_only_when_its_text_changes(tmp_path: Path) -> None:
    dns = load()
    hosts = tmp_path / "cluster.hosts"
    assert dns.write_if_changed(hosts, "10.96.0.1 kubernetes.default.svc.cluster.local\n")
    inode = hosts.stat().st_ino
    assert not dns.write_if_changed(hosts, "10.96.0.1 kubernetes.default.svc.cluster.local\n")
    assert hosts.stat().st_ino == inode
    assert dns.write_if_changed(hosts, "")
    assert hosts.read_text() == ""
