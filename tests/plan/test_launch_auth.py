"""A Ray head started by the generated launch.sh refuses job submissions that carry no token (real Ray, loopback).

Starts `launch.sh head --no-submit` for the cpu plan with its own RAY_TMPDIR, HOME and ports, then submits a
job without the token (refused, and its command never runs), with a wrong token (refused), and reads the job
list with the token (allowed: the refusals are authentication, not a dead server). Its Ray processes are
found by that RAY_TMPDIR and stopped by pid at the end. About a minute on two cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from plan_fixtures import CPU_SPEC, cpu_plan, spec_from
from ranks import free_port

from rlc.compiler.emit import emit_plan_dir
from rlc.compiler.node_setup import RAY_PORTS

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
#: The per-node service ports launch.sh fixes for firewalled clusters (GCS and dashboard have their own variables).
#: The test moves them to free ports: another Ray on this machine (a parallel test's) holds some defaults, e.g.
#: every local Ray's dashboard agent listens on 52365.
NODE_PORT_FLAGS = [
    flag for flag in RAY_PORTS if flag not in ("port", "dashboard-port", "min-worker-port", "max-worker-port")
]


def _pids_with(marker: bytes) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _stop(marker: bytes) -> None:
    """End the Ray processes this test started (they carry its RAY_TMPDIR), by pid."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        pids = _pids_with(marker)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline and _pids_with(marker):
            time.sleep(0.2)


def _request(url: str, token: str | None, body: dict | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _other_address() -> str | None:
    """A non-loopback address of this machine, if it has one."""
    try:
        found = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next((a for a in found if ":" not in a and not a.startswith("127.")), None)


def test_tokenless_job_submission_to_a_launched_head_is_refused(tmp_path: Path) -> None:
    plan_dir = tmp_path / "plan"
    emit_plan_dir(cpu_plan(run_dir=str(tmp_path / "run")), spec_from(CPU_SPEC), plan_dir, provenance={})
    script = plan_dir / "launch.sh"
    text = script.read_text()
    for flag in NODE_PORT_FLAGS:
        fixed = f"--{flag}={RAY_PORTS[flag]}"
        assert fixed in text
        text = text.replace(fixed, f"--{flag}={free_port()}")
    script.write_text(text)
    ray_tmp = tempfile.mkdtemp(prefix="rlc-ray-", dir="/tmp")  # short: Ray's unix sockets live under it
    marker = f"RAY_TMPDIR={ray_tmp}".encode()
    home, stranger = tmp_path / "home", tmp_path / "stranger"
    home.mkdir()
    stranger.mkdir()
    gcs, dashboard = free_port(), free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RLC_"))}
    env = {
        **clean,
        "PATH": f"{BIN}:/usr/bin:/bin",
        "HOME": str(home),
        "RAY_TMPDIR": ray_tmp,
        "RLC_RAY_PORT": str(gcs),
        "RLC_DASHBOARD_PORT": str(dashboard),
        "RLC_PYTHON": sys.executable,
        "RLC_WAIT_TIMEOUT": "180",
    }
    canary = tmp_path / "CANARY"
    try:
        started = subprocess.run(
            ["bash", str(plan_dir / "launch.sh"), "head", "--no-submit"],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert started.returncode == 0, started.stderr[-3000:]
        assert "this run's token is in" in started.stderr and "the cluster is up" in started.stderr
        (token_file,) = (home / ".rlc").glob("ray-token-*")
        token = token_file.read_text()
        jobs = f"http://127.0.0.1:{dashboard}/api/jobs/"
        submit = {"entrypoint": f"touch {canary}"}
        assert _request(jobs, None, submit) == 401
        assert _request(jobs, "0" * 64, submit) == 403
        assert _request(jobs, token, None) == 200  # the server is up; only the token was missing

        # The Ray CLI, as an outsider would use it: no token in the environment, none in ~/.ray.
        outsider = {**clean, "PATH": env["PATH"], "HOME": str(stranger), "RAY_TMPDIR": ray_tmp}
        refused = subprocess.run(
            [
                str(BIN / "ray"),
                "job",
                "submit",
                f"--address=http://127.0.0.1:{dashboard}",
                "--no-wait",
                "--",
                "touch",
                str(canary),
            ],
            env=outsider,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode != 0, refused.stdout + refused.stderr
        assert "401" in refused.stdout + refused.stderr or "auth" in (refused.stdout + refused.stderr).lower()
        time.sleep(2)
        assert not canary.exists(), "a token-less job ran"

        other = _other_address()
        if other is not None:  # the dashboard and job API listen on loopback only
            with socket.socket() as sock:
                sock.settimeout(5)
                assert sock.connect_ex((other, dashboard)) != 0
    finally:
        _stop(marker)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not _pids_with(marker)
