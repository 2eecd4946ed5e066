"""Cluster DNS records for dnsmasq, from the Services and Endpoints of a cluster.

scripts/local-cluster.sh runs dnsmasq with ``--hostsdir`` on the node IP (the kubelet's
``clusterDNS``) and this loop next to it. dnsmasq re-reads a hosts file in that directory
whenever it changes, so the records follow the cluster within about a poll interval:

* ``<svc>.<ns>.svc.cluster.local`` → the ClusterIP, or for a headless Service every ready
  endpoint address;
* ``<hostname>.<svc>.<ns>.svc.cluster.local`` → an endpoint with a hostname (StatefulSet pods
  behind their headless Service).

The file is replaced atomically, and only when its text changes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kubernetes import client, config

DOMAIN = "cluster.local"


def service_records(service: dict[str, Any]) -> list[tuple[str, str]]:
    meta, spec = service["metadata"], service.get("spec") or {}
    cluster_ip = spec.get("clusterIP")
    if not cluster_ip or cluster_ip == "None":
        return []
    return [(cluster_ip, f"{meta['name']}.{meta['namespace']}.svc.{DOMAIN}")]


def endpoint_records(endpoints: dict[str, Any], headless: bool) -> list[tuple[str, str]]:
    meta = endpoints["metadata"]
    service_name = f"{meta['name']}.{meta['namespace']}.svc.{DOMAIN}"
    records = []
    for subset in endpoints.get("subsets") or []:
        for address in subset.get("addresses") or []:
            if headless:
                records.append((address["ip"], service_name))
            if address.get("hostname"):
                records.append((address["ip"], f"{address['hostname']}.{service_name}"))
    return records


def hosts_text(services: list[dict[str, Any]], endpoints: list[dict[str, Any]]) -> str:
    headless = {
        (s["metadata"]["namespace"], s["metadata"]["name"])
        for s in services
        if (s.get("spec") or {}).get("clusterIP") == "None"
    }
    records: set[tuple[str, str]] = set()
    for service in services:
        records.update(service_records(service))
    for item in endpoints:
        key = (item["metadata"]["namespace"], item["metadata"]["name"])
        records.update(endpoint_records(item, key in headless))
    return "".join(f"{ip} {name}\n" for ip, name in sorted(records, key=lambda r: (r[1], r[0])))


def write_if_changed(path: Path, text: str) -> bool:
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
    return True


def list_items(call: Any) -> list[dict[str, Any]]:
    return list(json.loads(call(_preload_content=False, _request_timeout=10).data)["items"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--hosts-file", type=Path, required=True)
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args()
    config.load_kube_config(config_file=args.kubeconfig)
    core = client.CoreV1Api()
    while True:
        try:
            text = hosts_text(
                list_items(core.list_service_for_all_namespaces),
                list_items(core.list_endpoints_for_all_namespaces),
            )
            if write_if_changed(args.hosts_file, text):
                print(f"cluster DNS: {text.count(chr(10))} records", file=sys.stderr, flush=True)
        except Exception as exc:  # the API server restarting must not end the loop
            print(f"cluster DNS: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
