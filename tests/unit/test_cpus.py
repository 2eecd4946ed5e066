"""Engines size torch's threads from the cores they may use, container limits included."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dpserve.engine import cpus


def cgroup_v2(tmp_path: Path, cpu_max: str, own: str = "") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    directory = root / own
    directory.mkdir(parents=True)
    (directory / "cpu.max").write_text(cpu_max + "\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"0::/{own}\n")
    return root, proc


def test_cgroup_v2_limit_of_a_kubernetes_container(tmp_path):
    root, proc = cgroup_v2(tmp_path, "150000 100000")  # resources.limits.cpu: 1500m
    assert cpus.cgroup_cpu_limit(root, proc) == 1.5
    assert cpus.usable_cores(1.5) == 1  # a fractional core is not a thread of its own


def test_cgroup_v2_nested_group_and_no_limit(tmp_path):
    root, proc = cgroup_v2(tmp_path, "200000 100000", own="kubepods/pod1/engine")
    (root / "cpu.max").write_text("max 100000\n")
    assert cpus.cgroup_cpu_limit(root, proc) == 2.0
    unlimited, proc = cgroup_v2(tmp_path / "other", "max 100000")
    assert cpus.cgroup_cpu_limit(unlimited, proc) is None


def test_cgroup_v1_quota_and_period(tmp_path):
    root = tmp_path / "cgroup"
    (root / "cpu,cpuacct").mkdir(parents=True)
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("300000\n")
    (root / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpus.cgroup_cpu_limit(root, tmp_path / "missing") == 3.0
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpus.cgroup_cpu_limit(root, tmp_path / "missing") is None


def test_at_least_one_thread_and_the_flag_wins():
    assert cpus.usable_cores(0.2) == 1
    assert cpus.usable_cores(10_000) == len(os.sched_getaffinity(0))
    assert cpus.torch_threads(3) == (3, "--torch-threads")


def test_cpu_lists_as_sysfs_writes_them() -> None:
    assert cpus.parse_cpu_list("0-3,8-9,12\n") == {0, 1, 2, 3, 8, 9, 12}
    assert cpus.parse_cpu_list("5") == {5}


def sysfs_nodes(tmp_path: Path, lists: dict[int, str]) -> Path:
    root = tmp_path / "node"
    for number, cpulist in lists.items():
        (root / f"node{number}").mkdir(parents=True)
        (root / f"node{number}" / "cpulist").write_text(cpulist + "\n")
    (root / "possible").write_text("0-1\n")  # a file beside the nodes, not a node
    return root


def test_cores_are_grouped_by_numa_node_in_node_order(tmp_path: Path) -> None:
    root = sysfs_nodes(tmp_path, {10: "8-11", 2: "4-7", 0: "0-3"})
    assert cpus.numa_core_sets(root, allowed=set(range(12))) == [
        frozenset({0, 1, 2, 3}),
        frozenset({4, 5, 6, 7}),
        frozenset({8, 9, 10, 11}),
    ]
    # Only the cores this process may use count; a node with none of them is no group.
    assert cpus.numa_core_sets(root, allowed={1, 2, 9}) == [
        frozenset({1, 2}),
        frozenset({9}),
    ]


def test_without_nodes_in_sysfs_all_allowed_cores_are_one_group(tmp_path: Path) -> None:
    assert cpus.numa_core_sets(tmp_path / "absent", allowed={0, 1}) == [frozenset({0, 1})]


def test_a_binding_gives_each_tensor_parallel_rank_cores_of_its_own() -> None:
    assert cpus.cpu_thread_binding(2, 1, [3, 1, 2, 0]) == "0,1"
    assert cpus.cpu_thread_binding(1, 2, [4, 5]) == "4|5"
    with pytest.raises(ValueError, match="need 4 cores"):
        cpus.cpu_thread_binding(2, 2, [0, 1, 2])


def test_vllm_engines_sharing_cores_each_bind_a_slice_of_their_own() -> None:
    # Two engines on two cores: a core each (left to vLLM, both bound to core 0).
    assert cpus.shared_core_bindings([0, 1], 2, 1, None) == ["0", "1"]
    # Slices wider than their ranks leave one core per rank to the engine's process.
    assert cpus.shared_core_bindings(range(8), 2, 1, None) == ["0,1,2", "4,5,6"]
    assert cpus.shared_core_bindings(range(8), 2, 2, None) == ["0|1", "4|5"]
    # --torch-threads per rank instead, within the slice.
    assert cpus.shared_core_bindings(range(8), 2, 1, 4) == ["0,1,2,3", "4,5,6,7"]
    # Every slice disjoint from the others, whatever the order the affinity lists.
    bindings = cpus.shared_core_bindings([7, 6, 5, 4, 3, 2, 1, 0], 4, 1, None)
    assert bindings == ["0", "2", "4", "6"]


def test_too_few_cores_for_a_slice_each_leave_the_binding_to_vllm() -> None:
    assert cpus.shared_core_bindings([0, 1], 3, 1, None) is None
    assert cpus.shared_core_bindings([0, 1, 2, 3], 2, 4, None) is None
    assert cpus.shared_core_bindings(range(8), 2, 1, 5) is None
