"""How many CPU cores an engine may use, for sizing torch's thread pool.

torch starts one intra-op thread per core of the machine. Two engines on two cores then run
four busy threads, and each step takes several times longer than with one thread per engine
(issue 9, item 11: 12.4 s instead of 3.9 s for the same 8 streams). An engine uses what it may
actually run on: the cores of its CPU affinity, capped by its container's CPU limit (cgroup v2
``cpu.max``, or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); ``dpserve serve`` divides
that among the engines it starts; ``--torch-threads`` overrides both.

``numa_core_sets`` groups those cores by NUMA node: ``dpserve serve`` starts one engine per
node by default, each pinned to its node's cores. On a CPU the decode step is bound by memory
bandwidth (it streams every weight once per step), and engines that share a node's memory bus
each stream their own copy of the weights: measured on this project's 2-core machine (one
node), one engine on both cores gave more output tok/s and a lower inter-token latency than two
engines of one core at every load (BENCHMARKS.md, CPU serving, run 6).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Final

CGROUP_ROOT = Path("/sys/fs/cgroup")
# vLLM's CPU build binds its workers' compute threads to the cores this names ("auto": its own
# choice, within the process's affinity).
VLLM_THREADS_BIND_ENV: Final = "VLLM_CPU_OMP_THREADS_BIND"
NODE_ROOT = Path("/sys/devices/system/node")


def _own_cgroup_v2_dir(root: Path, proc_cgroup: Path) -> Path | None:
    """This process's cgroup v2 directory (``0::/path`` in /proc/self/cgroup), if any."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return root / line[3:].lstrip("/")
    return None


def _v2_limit(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)


def _v1_limit(root: Path) -> float | None:
    for name in ("cpu", "cpu,cpuacct"):
        try:
            quota = int((root / name / "cpu.cfs_quota_us").read_text())
            period = int((root / name / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota / period if quota > 0 and period > 0 else None
    return None


def cgroup_cpu_limit(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPU limit in cores of this process's cgroup (a container's ``resources.limits.cpu``
    on Kubernetes), or None when there is none."""
    own = _own_cgroup_v2_dir(root, proc_cgroup)
    limits = [_v2_limit(directory) for directory in {own, root} if directory is not None]
    limits.append(_v1_limit(root))
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def usable_cores(limit: float | None = None) -> int:
    """Cores this process may run on: its affinity, capped by ``limit`` (default: the cgroup's
    CPU limit), at least 1."""
    cores = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit() if limit is None else limit
    if limit is not None:
        cores = min(cores, math.floor(limit))
    return max(1, cores)


def torch_threads(requested: int | None) -> tuple[int, str]:
    """The thread count for torch and where it comes from (for the log)."""
    if requested is not None:
        return max(1, requested), "--torch-threads"
    limit = cgroup_cpu_limit()
    if limit is not None and math.floor(limit) < len(os.sched_getaffinity(0)):
        return usable_cores(limit), f"the container's CPU limit of {limit:g}"
    return usable_cores(limit), "the cores this process may run on"


def parse_cpu_list(text: str) -> set[int]:
    """The cores of a sysfs CPU list such as ``0-3,8-11,16``."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def numa_core_sets(root: Path = NODE_ROOT, allowed: set[int] | None = None) -> list[frozenset[int]]:
    """The cores this process may run on (``allowed``, default its affinity), grouped by NUMA
    node in node order; one group when sysfs lists no node (or only one has such cores)."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    nodes: list[tuple[int, frozenset[int]]] = []
    for node in root.glob("node[0-9]*"):
        try:
            cores = parse_cpu_list((node / "cpulist").read_text())
            number = int(node.name[len("node") :])
        except (OSError, ValueError):
            continue
        if cores & allowed:
            nodes.append((number, frozenset(cores & allowed)))
    return [cores for _, cores in sorted(nodes)] or [frozenset(allowed)]


def cpu_thread_binding(threads: int, tensor_parallel_size: int, cores: Sequence[int]) -> str:
    """``VLLM_THREADS_BIND_ENV`` for ``threads`` compute threads per rank: each rank its own
    cores, the first of ``cores`` ("0,1": two threads of one rank; "0|1": one each of two)."""
    wanted = threads * tensor_parallel_size
    if wanted > len(cores):
        raise ValueError(
            f"{threads} thread(s) for each of {tensor_parallel_size} tensor-parallel rank(s) "
            f"need {wanted} cores; this process may use {len(cores)}"
        )
    ordered = sorted(cores)
    ranks = [ordered[rank * threads : (rank + 1) * threads] for rank in range(tensor_parallel_size)]
    return "|".join(",".join(map(str, rank)) for rank in ranks)


def shared_core_bindings(
    cores: Sequence[int], engines: int, tensor_parallel_size: int, threads: int | None
) -> list[str] | None:
    """``VLLM_THREADS_BIND_ENV`` for each of ``engines`` vLLM engines started on the same
    ``cores``, or None where those cannot give every rank of every engine a core of its own.

    Left to itself each vLLM engine binds its workers within its process's affinity, to the
    same first cores as every other engine there: two engines of ``dpserve serve`` on two
    cores ran both workers on core 0 while core 1 only polled (each engine's prefill read
    ~40 and ~430 tokens/s, BENCHMARKS.md). So each engine takes a slice of its own, and of
    its slice, as vLLM does with a machine, one core per rank is left to the engine's process
    (its scheduler polls the workers) where the slice has more cores than ranks; ``threads``
    (``--torch-threads``) per rank instead where given."""
    share = len(cores) // engines
    if share < tensor_parallel_size:
        return None
    if threads is None:
        spare = share - tensor_parallel_size if share > tensor_parallel_size else share
        threads = max(1, spare // tensor_parallel_size)
    if threads * tensor_parallel_size > share:
        return None
    ordered = sorted(cores)
    return [
        cpu_thread_binding(
            threads, tensor_parallel_size, ordered[engine * share : (engine + 1) * share]
        )
        for engine in range(engines)
    ]
