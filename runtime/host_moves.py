"""Colocated weight moves through each node's host memory: which trainer rank writes for which engines.

A colocated plan (`schedule.weight_sync: inplace` or `shared_memory`) never uses a broadcast group: a device's
trainer rank and engine worker cannot be two ranks of one NCCL/HCCL group. Instead, on every node the first
trainer rank there gathers the weights and writes them into a folder in that node's /dev/shm, and the engines on
that node load from it: `inplace` as one safetensors file they reload, `shared_memory` as one flat segment their
workers map (`rollout.shared_weights`). Which rank and engine landed on which node is Ray's placement, found at
run time; the path itself is the plan's. A node whose /dev/shm cannot hold the weights is an error with what to
do, not a silent detour through the run directory.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SHM_HEADROOM", "HostMoves", "HostMovesError", "plan_host_moves", "shared_tag", "stale_glob"]

#: /dev/shm must hold the gathered weights with this much room to spare.
SHM_HEADROOM = 1.1
#: The start of a shared-memory run's tag (`shared_tag`), so its folders are ``/dev/shm/rlc-shm-...``.
SHARED_TAG_PREFIX = "shm-"


class HostMovesError(RuntimeError):
    """Colocated weights cannot move through host memory as planned."""


@dataclass(frozen=True)
class HostMoves:
    """Per node: the writing trainer rank, its folder in /dev/shm, and the engines reading from it."""

    dirs: dict[int, str]  # writer rank -> folder
    readers: dict[int, list[int]]  # writer rank -> engine indices

    def folder_for(self, engine: int) -> str:
        for rank, engines in self.readers.items():
            if engine in engines:
                return self.dirs[rank]
        raise KeyError(engine)

    def describe(self) -> str:
        parts = [f"rank {r} → engine(s) {', '.join(map(str, e))} via {self.dirs[r]}" for r, e in self.readers.items()]
        return "; ".join(parts)


def weight_bytes(meta: list[tuple[str, tuple[int, ...], str]]) -> int:
    from rlc.runtime.rollout.weight_sync import dtype_from_str

    return sum(math.prod(shape) * dtype_from_str(dtype).itemsize for _, shape, dtype in meta)


def plan_host_moves(
    ranks: list[dict[str, Any]], engine_nodes: list[list[str]], needed_bytes: int, tag: str
) -> HostMoves:
    """Writers and readers from each trainer rank's ``{rank, node_id, shm_free}`` and each engine's worker nodes
    (one node, or several for an engine across nodes).

    `tag` makes the folders unique to this run (several runs may share a node). An engine across nodes loads
    through every worker at once, each from its own node's /dev/shm, so then every writer uses one folder name
    (one writer per node, so one folder per node still).
    """
    first: dict[str, dict[str, Any]] = {}
    for info in sorted(ranks, key=lambda r: r["rank"]):
        first.setdefault(info["node_id"], info)
    readers: dict[int, list[int]] = {}
    for index, nodes in enumerate(engine_nodes):
        for node in nodes:
            writer = first.get(node)
            if writer is None:
                raise HostMovesError(
                    f"rollout engine {index} runs on a node without a trainer rank, so colocated weights cannot "
                    "reach it through host memory; the plan's placement put every engine beside a trainer rank, so "
                    "Ray placed them apart: check that every node runs `launch.sh`"
                )
            readers.setdefault(writer["rank"], []).append(index)
    want = SHM_HEADROOM * needed_bytes
    for rank in readers:
        info = next(r for r in ranks if r["rank"] == rank)
        if info["shm_free"] < want:
            raise HostMovesError(
                f"/dev/shm on trainer rank {rank}'s node has {info['shm_free'] / 2**30:.2f} GiB free, the colocated "
                f"weight moves need {want / 2**30:.2f} GiB: mount a larger /dev/shm (in Kubernetes an emptyDir with "
                "medium: Memory), or compile with rollout.weight_sync: disk"
            )
    across = any(len(nodes) > 1 for nodes in engine_nodes)
    dirs = {rank: str(Path("/dev/shm") / (f"rlc-{tag}" if across else f"rlc-{tag}-r{rank}")) for rank in readers}
    return HostMoves(dirs, readers)


def shared_tag(run_dir: str | Path, pid: int) -> str:
    """`plan_host_moves`' tag for `shared_memory`: a key of the run directory (the same for every run on it, so a
    later run finds the folders a killed one left: `stale_glob`) and the driver's pid."""
    key = hashlib.sha1(str(Path(run_dir).absolute()).encode()).hexdigest()[:12]
    return f"{SHARED_TAG_PREFIX}{key}-{pid}"


def stale_glob(tag: str) -> str:
    """The /dev/shm folders of every `shared_memory` run on the run directory of `tag` (a `shared_tag`), this run's
    among them: on a node, any other is an earlier run's (the run directory's lock keeps two live runs off one
    directory)."""
    key = tag.removeprefix(SHARED_TAG_PREFIX).split("-")[0]
    return str(Path("/dev/shm") / f"rlc-{SHARED_TAG_PREFIX}{key}-*")
