"""Two nodes as a user runs them: `launch.sh head` and `launch.sh worker` in two network namespaces.

Each node is a network namespace (joined to the other by a veth pair, 10.200.0.1 and 10.200.0.2, and to nothing
else) with its own PID and mount namespace, Ray temp dir and HOME; the filesystem is shared, as a cluster's
shared storage would be. The quickstart compiled for two nodes runs a few steps with the trainer on the head (n0)
and the engines on the worker (n1), the gloo weight broadcast crossing between them; the worker is then killed
(its whole PID namespace, as a node that dies), the run stops with a message naming `launch.sh head --resume`,
and after the worker rejoins, `launch.sh head --resume` runs to the end with every step recorded exactly once.

No RLC_SOCKET_IFNAME is given: launch.sh finds the interface from the route to the head. The worker starts in
another directory than the head, so a relative path resolved by each node on its own would differ.
Needs root (network namespaces); skipped, saying why, where they cannot be made.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from paths import REPO

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
STEPS = 12
HEAD_IP, WORKER_IP = "10.200.0.1", "10.200.0.2"


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _namespaces_unavailable() -> str:
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"rlcprobe{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"this machine cannot create network namespaces: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return ""


class Node:
    """One namespace running launch.sh: its own network, PID and mount namespace, HOME and Ray temp dir."""

    def __init__(self, netns: str, name: str, home: Path, ray_tmp: str) -> None:
        self.netns, self.name, self.home, self.ray_tmp = netns, name, home, ray_tmp
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []

    def start(self, script: str, env: dict[str, str], cwd: Path) -> None:
        # unshare --kill-child: when this process is killed, so is the namespace's init, and with it every process
        # of the node (the PID namespace ends with its init).
        command = [
            "ip", "netns", "exec", self.netns,
            "unshare", "--pid", "--fork", "--mount", "--mount-proc", "--kill-child", "--",
            "bash", "-c", script,
        ]  # fmt: skip
        self.lines = []
        self.proc = subprocess.Popen(
            command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout or []), daemon=True).start()  # type: ignore[union-attr]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def output(self) -> str:
        return "".join(self.lines)


def _environment(node: Node, plan_dir: Path) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RLC_", "GLOO_", "TP_SOCKET"))}
    return {
        **clean,
        "PATH": f"{BIN}:/usr/bin:/bin",
        "HOME": str(node.home),
        "RAY_TMPDIR": node.ray_tmp,
        "RLC_PYTHON": sys.executable,
        "RLC_WAIT_TIMEOUT": "240",
        "RLC_JOIN_BACKOFF": "1",
        "RLC_JOIN_ATTEMPTS": "30",
        # two cores for two Ray nodes, two trainers and two engines: one thread each
        "OMP_NUM_THREADS": "1",
    }


def _ray_processes(netns: str) -> list[str]:
    """The names of the processes left in a node's namespace other than its idle init (`sleep`) and the
    `unshare` that holds it."""
    names = []
    for pid in _ip("netns", "pids", netns).stdout.split():
        with contextlib.suppress(OSError):
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            if name not in ("sleep", "unshare"):
                names.append(name)
    return names


def _steps(metrics: Path) -> list[int]:
    if not metrics.is_file():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(600)
def test_head_and_worker_in_two_namespaces_survive_a_dead_worker_and_resume(tmp_path: Path) -> None:
    why = _namespaces_unavailable()
    if why:
        pytest.skip(why)
    began = time.monotonic()

    def phase(what: str) -> None:
        print(f"[two nodes] {time.monotonic() - began:5.1f} s: {what}", flush=True)

    tag = f"{os.getpid() % 100000}"
    head_ns, worker_ns = f"rlchead{tag}", f"rlcwork{tag}"
    plan_dir = tmp_path / "plan"
    compile_args = [str(BIN / "rlc"), "compile", str(REPO / "examples" / "quickstart.yaml"), "-o", str(plan_dir)]
    for item in ("cluster.nodes=2", f"algorithm.steps={STEPS}", "output.checkpoint_every=2", "output.dir=runs/qs"):
        compile_args += ["--set", item]
    subprocess.run(compile_args, check=True, capture_output=True, text=True, timeout=120)
    run_dir = tmp_path / "runs" / "qs"  # relative to where `launch.sh head` runs
    metrics = run_dir / "metrics.jsonl"
    temps = [tempfile.mkdtemp(prefix="rlc-ray-", dir="/tmp") for _ in range(2)]
    head = Node(head_ns, "head", tmp_path / "home-head", temps[0])
    worker = Node(worker_ns, "worker", tmp_path / "home-worker", temps[1])
    for node in (head, worker):
        node.home.mkdir()
    try:
        for ns in (head_ns, worker_ns):
            assert _ip("netns", "add", ns).returncode == 0
        veth = (f"rlcvh{tag}", f"rlcvw{tag}")
        made = _ip(
            "link", "add", veth[0], "netns", head_ns, "type", "veth", "peer", "name", veth[1], "netns", worker_ns
        )
        assert made.returncode == 0, made.stderr
        for ns, dev, address in ((head_ns, veth[0], HEAD_IP), (worker_ns, veth[1], WORKER_IP)):
            for args in (
                ("addr", "add", f"{address}/24", "dev", dev),
                ("link", "set", dev, "up"),
                ("link", "set", "lo", "up"),
            ):
                assert _ip("-n", ns, *args).returncode == 0

        launch = str(plan_dir / "launch.sh")
        token = head.home / ".rlc"  # the head writes its token here; the worker reads it from the shared filesystem
        head_env = {**_environment(head, plan_dir), "RLC_NODE_IP": HEAD_IP}

        def start_worker() -> None:
            (token_file,) = token.glob("ray-token-*")
            env = {
                **_environment(worker, plan_dir),
                "RLC_NODE_IP": WORKER_IP,
                "RLC_HEAD_ADDR": HEAD_IP,
                "RLC_RAY_TOKEN_FILE": str(token_file),
            }
            # The namespace's init must outlive launch.sh (which returns once Ray runs): it then waits.
            worker.start(f"bash {launch} worker && exec sleep 100000", env, worker.home)

        def wait_for_token() -> None:
            deadline = time.monotonic() + 120
            while not list(token.glob("ray-token-*")) and time.monotonic() < deadline:
                assert head.proc is not None and head.proc.poll() is None, head.output()[-3000:]
                time.sleep(0.5)

        # First run: the worker dies mid-run.
        head.start(f"bash {launch} head", head_env, tmp_path)
        wait_for_token()
        start_worker()
        phase("head and worker started")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(_steps(metrics)) < 3:
            assert head.proc is not None and head.proc.poll() is None, head.output()[-4000:] + worker.output()[-2000:]
            time.sleep(0.2)
        assert len(_steps(metrics)) >= 3, head.output()[-4000:]
        assert len(_steps(metrics)) < STEPS, "the run ended before the worker could be killed"
        phase(f"step {len(_steps(metrics))} recorded: killing the worker")
        worker.kill()
        assert head.proc is not None
        code = head.proc.wait(timeout=180)
        first = head.output()
        (tmp_path / "head-1.log").write_text(first)
        phase("the head stopped")
        print("\n".join(line for line in first.splitlines() if "actors on nodes" in line or "error" in line))
        assert code != 0, first[-4000:]
        assert "collective sockets (gloo/HCCL/NCCL) use interface" in worker.output()
        assert (
            "actors on nodes: n0 (10.200.0.1): rlc-actor-rank0, rlc-actor-rank1; n1 (10.200.0.2): rlc-rollout-0"
            in first
        )
        assert f"{plan_dir.resolve()}/launch.sh head --resume" in first, first[-4000:]
        assert "Traceback" not in first and "a Ray actor of the run died" in first
        record = json.loads((run_dir / "nodes.json").read_text())
        placed = {e["actor"]: (e["node"], e["planned_node"]) for e in record["actors"]}
        assert placed["rlc-actor-rank0"] == ("n0", "n0") and placed["rlc-rollout-1"] == ("n1", "n1")

        # Second run: the worker rejoins, `launch.sh head --resume` runs to the end.
        head.start(f"bash {launch} head --resume", head_env, tmp_path)
        wait_for_token()
        start_worker()
        assert head.proc.wait(timeout=300) == 0, head.output()[-4000:] + worker.output()[-2000:]
        resumed = head.output()
        (tmp_path / "head-2.log").write_text(resumed)
        phase("the resumed run finished")
        assert "reusing the token" in resumed  # the workers' copy still works
        assert "resumed from step-" in resumed and f"done: {STEPS} step(s)" in resumed
        assert _steps(metrics) == list(range(1, STEPS + 1))

        # The head is gone: the worker's Ray (raylet, log monitor, workers) follows within RLC_HEAD_LOSS_S and change.
        deadline = time.monotonic() + 60
        while _ray_processes(worker_ns) and time.monotonic() < deadline:
            time.sleep(1)
        assert _ray_processes(worker_ns) == [], "Ray processes outlived their head on the worker"
        phase("the worker's Ray exited after the head's")
    finally:
        for node in (head, worker):
            node.kill()
        for ns in (head_ns, worker_ns):
            _ip("netns", "del", ns)
        for folder in temps:
            shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(Exception):
            for node in (head, worker):
                if node.proc is not None and node.proc.poll() is None:
                    os.kill(node.proc.pid, signal.SIGKILL)
