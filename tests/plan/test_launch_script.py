"""launch.sh: syntax, shellcheck, and that hostile strings from the spec are only ever data, never code.

Hostile values go into every free-text field of the spec that reaches the script (model path, data file,
teacher path, run dir). The script is run for real on the cpu target with `ray`, `rlc`, `npu-smi` and
`python3` replaced by shims that record their argv, so the test sees exactly what would have been executed.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
from plan_fixtures import A3_SPEC, CPU_SPEC, a2_plan, a3_plan, cpu_plan, spec_from

from rlc.compiler.emit import emit_plan_dir
from rlc.compiler.manifest import read_manifest

HOSTILE = [
    "/m/a b$(touch CANARY)",
    "/d/`touch CANARY`;touch CANARY",
    "/t/'quote\"dq\\back'",
    "runs/x\ny $HOME; rm -rf CANARY && touch CANARY",
    "/u/模型 ünï ☃ | & > CANARY",
]

SHIM = """#!/usr/bin/env bash
# Records its name and argv (NUL-separated, one record per call) and plays a tiny part of the real tool.
{ printf '%s\\0' "$(basename "$0")" "$@"; printf '\\036\\0'; } >>"$RLC_SHIM_LOG"
name="$(basename "$0")"
printf '%s %s %s\\n' "$name" "${RAY_AUTH_MODE:--}" "${RAY_AUTH_TOKEN_PATH:--}" >>"$RLC_SHIM_LOG.env"
case "$name" in
  python3)
    if [[ "${2:-}" == *cluster_resources* ]]; then echo "${RLC_SHIM_CLUSTER:-1 2}"; fi
    ;;
  ray)
    if [[ "${1:-}" == start && "${2:-}" == --address=* && -n "${RLC_SHIM_FAIL_JOINS:-}" ]]; then
      count_file="$RLC_SHIM_LOG.joins"
      count=$(( $(cat "$count_file" 2>/dev/null || echo 0) + 1 ))
      echo "$count" >"$count_file"
      if (( count <= RLC_SHIM_FAIL_JOINS )); then echo "${RLC_SHIM_JOIN_ERROR:-}" >&2; exit 1; fi
    fi
    ;;
esac
exit 0
"""


#: `ip` answers with a canned route (the machine's own routes must not decide what the tests see).
IP_SHIM = """#!/usr/bin/env bash
if [[ -n "${RLC_SHIM_ROUTE:-}" ]]; then printf '%s\\n' "$RLC_SHIM_ROUTE"; fi
"""


def _hostile_cpu_plan_dir(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    model, data, teacher, run_dir = HOSTILE[0], HOSTILE[1], HOSTILE[2], HOSTILE[3]
    spec = spec_from(CPU_SPEC).model_copy(deep=True)
    spec.model.path = model
    spec.data.train = data
    spec.output.dir = run_dir
    plan = cpu_plan(model_path=model, data=data, run_dir=run_dir, teacher_path=teacher, build_tiny=False)
    out = tmp_path / "plan"
    emit_plan_dir(plan, spec, out, provenance={})
    return out, {"model": model, "data": data, "teacher": teacher, "run_dir": run_dir}


def _canaries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*CANARY*") if p.is_file() and p.name == "CANARY"]


def _argv_lines(printed: str, cwd: Path) -> list[list[str]]:
    """Turn each dry-run line (printf %q words) back into argv by letting bash parse it as data."""
    commands: list[list[str]] = []
    for line in printed.splitlines():
        if not line.strip() or line.startswith(("export ", "source ")):
            continue
        parsed = subprocess.run(
            ["bash", "-c", f"printf '%s\\0' {line}"], capture_output=True, cwd=cwd, check=True, timeout=10
        )
        commands.append(parsed.stdout.decode().split("\0")[:-1])
    return commands


def _exported(printed: str, name: str, cwd: Path) -> str:
    """The value a dry run's `export NAME=%q` line sets, read back by bash."""
    line = next(line for line in printed.splitlines() if line.startswith(f"export {name}="))
    script = f'{line}; printf "%s" "${name}"'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=cwd, check=True).stdout


@pytest.fixture
def shims(tmp_path: Path) -> tuple[Path, Path]:
    folder = tmp_path / "shims"
    folder.mkdir()
    for name in ("ray", "rlc", "npu-smi", "python3", "ip"):
        path = folder / name
        path.write_text(IP_SHIM if name == "ip" else SHIM)
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return folder, tmp_path / "calls.log"


def _calls(log: Path) -> list[list[str]]:
    if not log.exists():
        return []
    records = log.read_bytes().decode().split("\x1e\0")
    return [r.split("\0")[:-1] for r in records if r]


def _run_script(plan_dir: Path, args: list[str], shims: tuple[Path, Path], cwd: Path, **env: str):
    folder, log = shims
    environ = {
        "PATH": f"{folder}:/usr/bin:/bin",
        "HOME": str(cwd),
        "RLC_SHIM_LOG": str(log),
        "RLC_ASCEND_HOME": str(cwd / "no-ascend"),
        **env,
    }
    return subprocess.run(
        ["bash", str(plan_dir / "launch.sh"), *args], capture_output=True, text=True, cwd=cwd, env=environ, timeout=30
    )


@pytest.mark.parametrize("make", [a2_plan, a3_plan, cpu_plan], ids=["a2", "a3", "cpu"])
def test_bash_syntax_and_shellcheck(tmp_path: Path, make) -> None:
    plan = make()
    spec = spec_from(A3_SPEC if plan.target == "a3" else CPU_SPEC)
    emit_plan_dir(plan, spec, tmp_path / "plan", provenance={})
    script = tmp_path / "plan" / "launch.sh"
    assert os.access(script, os.X_OK)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (CI installs it)")
    result = subprocess.run(["shellcheck", "--severity=style", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_hostile_strings_shellcheck_clean(tmp_path: Path) -> None:
    plan_dir, _ = _hostile_cpu_plan_dir(tmp_path)
    assert subprocess.run(["bash", "-n", str(plan_dir / "launch.sh")]).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (CI installs it)")
    result = subprocess.run(["shellcheck", str(plan_dir / "launch.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_help_and_usage_errors(tmp_path: Path, shims) -> None:
    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    shown = _run_script(tmp_path / "plan", ["--help"], shims, tmp_path)
    assert shown.returncode == 0 and "launch.sh head|worker [stop] [--dry-run]" in shown.stdout
    assert _run_script(tmp_path / "plan", [], shims, tmp_path).returncode == 2
    bad = _run_script(tmp_path / "plan", ["head", "--bogus"], shims, tmp_path)
    assert bad.returncode == 2 and "unknown argument" in bad.stderr
    assert _calls(shims[1]) == []


def test_dry_run_prints_hostile_strings_literally_and_runs_nothing(tmp_path: Path, shims) -> None:
    plan_dir, hostile = _hostile_cpu_plan_dir(tmp_path)
    result = _run_script(plan_dir, ["head", "--dry-run"], shims, tmp_path)
    assert result.returncode == 0, result.stderr
    assert _calls(shims[1]) == [], "dry run executed a command"
    assert _canaries(tmp_path) == []
    commands = _argv_lines(result.stdout, tmp_path)
    assert _canaries(tmp_path) == []
    words = [word for argv in commands for word in argv]
    for value in (hostile["model"], hostile["data"], hostile["teacher"], hostile["run_dir"]):
        assert value in words, f"{value!r} did not reach a command literally"
    assert ["ray", "stop"] not in commands  # Ray's own stop ends every Ray process on the machine
    stop = commands[-1]
    assert stop[:2] == ["python3", "-c"] and "RLC_CLUSTER_MARK" in stop[2] and stop[3].endswith("-head-0")
    submit = next(argv for argv in commands if argv[:3] == ["ray", "job", "submit"])
    run_dir = str(tmp_path / hostile["run_dir"])  # relative: taken from where launch.sh runs
    assert submit[-6:] == ["--", "rlc", "run", str(plan_dir.resolve()), "--run-dir", run_dir]


def test_dry_run_npu_plan_with_hostile_teacher_paths(tmp_path: Path, shims) -> None:
    teachers = (HOSTILE[0], HOSTILE[4])
    spec = spec_from(A3_SPEC).model_copy(deep=True)
    assert spec.distill is not None
    for teacher, path in zip(spec.distill.teachers, teachers, strict=True):
        teacher.model.path = path
    emit_plan_dir(a3_plan(teacher_paths=teachers), spec, tmp_path / "plan", provenance={})
    result = _run_script(tmp_path / "plan", ["worker", "--dry-run"], shims, tmp_path)
    assert result.returncode == 0, result.stderr
    assert _calls(shims[1]) == [] and _canaries(tmp_path) == []
    commands = _argv_lines(result.stdout, tmp_path)
    words = [word for argv in commands for word in argv]
    assert all(t in words for t in teachers)
    assert ["npu-smi", "info", "-l"] in commands
    join = next(argv for argv in commands if argv[:2] == ["ray", "start"])
    # a3 spans two nodes: the worker is n1 and declares it, so the plan's n1 roles land here
    assert '--resources={"NPU": 16, "rlc_node_n1": 1000}' in join and "--address=<RLC_HEAD_ADDR>:6379" in join
    assert _exported(result.stdout, "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES", tmp_path) == "1"
    assert _exported(result.stdout, "ASCEND_RT_VISIBLE_DEVICES", tmp_path) == ",".join(str(i) for i in range(16))


def test_real_run_on_cpu_passes_hostile_strings_as_argv(tmp_path: Path, shims) -> None:
    plan_dir, hostile = _hostile_cpu_plan_dir(tmp_path)
    result = _run_script(plan_dir, ["head"], shims, tmp_path)
    assert result.returncode == 0, result.stderr
    assert _canaries(tmp_path) == []
    calls = _calls(shims[1])
    names = [c[0] for c in calls]
    assert names == ["python3", "ray", "python3", "ray", "python3"], calls
    preflight = calls[0]
    assert preflight[2:] == [
        preflight[2],
        "ray,torch,vllm",
        hostile["run_dir"],
        hostile["model"],
        hostile["data"],
        hostile["teacher"],
    ]
    head = calls[1]
    assert head[1:3] == ["start", "--head"]
    assert '--resources={"rlc_device": 2}' in head and "--port=6379" in head
    submit = calls[3]
    assert submit[1:3] == ["job", "submit"]
    assert submit[-6:] == ["--", "rlc", "run", str(plan_dir.resolve()), "--run-dir", str(tmp_path / hostile["run_dir"])]
    metadata = next(a for a in submit if a.startswith("--metadata-json="))
    manifest = read_manifest(plan_dir)
    assert manifest is not None and manifest["plan_hash"] in metadata
    assert calls[4][1] == "-c" and "RLC_CLUSTER_MARK" in calls[4][2]  # stops only what it started


def test_npu_preflight_refuses_a_node_without_devices(tmp_path: Path, shims) -> None:
    if list(Path("/dev").glob("davinci[0-9]*")):
        pytest.skip("this machine has NPUs")
    emit_plan_dir(a2_plan(), spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    result = _run_script(tmp_path / "plan", ["head"], shims, tmp_path, RLC_WAIT_TIMEOUT="0", RLC_SHIM_CLUSTER="1 8")
    # a2 on a machine without /dev/davinci*: the device preflight refuses before Ray starts
    assert result.returncode == 1
    assert "the plan needs 8" in result.stderr
    assert [c[0] for c in _calls(shims[1])] == ["npu-smi"]


def test_cpu_head_timeout_message(tmp_path: Path, shims) -> None:
    plan = cpu_plan()
    plan.cluster.nodes, plan.cluster.total_devices = 2, 4
    emit_plan_dir(plan, spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    result = _run_script(tmp_path / "plan", ["head"], shims, tmp_path, RLC_WAIT_TIMEOUT="0", RLC_SHIM_CLUSTER="1 2")
    assert result.returncode == 1
    assert "nodes 1/2, rlc_device 2/4; missing 1 node(s) and 2 rlc_device" in result.stderr


def test_worker_retries_then_joins(tmp_path: Path, shims) -> None:
    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    env = {"RLC_HEAD_ADDR": "10.0.0.1", "RLC_JOIN_BACKOFF": "0", "RLC_SHIM_FAIL_JOINS": "2", "RAY_AUTH_TOKEN": "t"}
    result = _run_script(tmp_path / "plan", ["worker"], shims, tmp_path, **env)
    assert result.returncode == 0, result.stderr
    joins = [c for c in _calls(shims[1]) if c[:2] == ["ray", "start"]]
    assert len(joins) == 3 and "--address=10.0.0.1:6379" in joins[0]
    assert "join attempt 2/8 failed" in result.stderr


def test_worker_gives_up_after_attempts(tmp_path: Path, shims) -> None:
    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    env = {"RLC_HEAD_ADDR": "10.0.0.1", "RLC_JOIN_BACKOFF": "0", "RLC_SHIM_FAIL_JOINS": "99", "RLC_JOIN_ATTEMPTS": "3"}
    result = _run_script(tmp_path / "plan", ["worker"], shims, tmp_path, RAY_AUTH_TOKEN="t", **env)
    assert result.returncode == 1
    assert "could not join the Ray head at 10.0.0.1:6379 after 3 attempts" in result.stderr
    missing = _run_script(tmp_path / "plan", ["worker"], shims, tmp_path, RAY_AUTH_TOKEN="t")
    assert missing.returncode == 1 and "RLC_HEAD_ADDR" in missing.stderr


def test_hostile_environment_values_are_data(tmp_path: Path, shims) -> None:
    plan = cpu_plan()
    plan.env = {"RLC_TEST_VALUE": HOSTILE[0] + "\n" + HOSTILE[1]}
    emit_plan_dir(plan, spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    result = _run_script(tmp_path / "plan", ["head", "--dry-run"], shims, tmp_path)
    assert result.returncode == 0 and _canaries(tmp_path) == []
    assert _exported(result.stdout, "RLC_TEST_VALUE", tmp_path) == plan.env["RLC_TEST_VALUE"]
    assert _canaries(tmp_path) == []


# ----------------------------------------------------------------------------------------- authentication


def _auth_env(log: Path) -> list[list[str]]:
    """name, RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH as each shimmed command saw them."""
    path = Path(f"{log}.env")
    return [line.split(" ") for line in path.read_text().splitlines()] if path.exists() else []


def test_head_generates_a_private_token_reuses_it_and_uses_it(tmp_path: Path, shims) -> None:
    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    result = _run_script(tmp_path / "plan", ["head"], shims, tmp_path)
    assert result.returncode == 0, result.stderr
    tokens = list((tmp_path / ".rlc").glob("ray-token-rlc-quickstart-*"))
    assert len(tokens) == 1
    token_file = tokens[0]
    first = token_file.read_text()
    assert len(first) == 64 and int(first, 16) >= 0  # 256 random bits, hex
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert f"this run's token is in {token_file}" in result.stderr and "RLC_RAY_TOKEN_FILE" in result.stderr
    assert f"scp {token_file} <worker>:{token_file}" in result.stderr
    # Every Ray command (start, the readiness probe, job submit, stop) ran with token auth and that file.
    seen = _auth_env(shims[1])
    assert [name for name, _, _ in seen] == ["python3", "ray", "python3", "ray", "python3"]
    assert all(mode == "token" and path == str(token_file) for _, mode, path in seen), seen
    head = _calls(shims[1])[1]
    assert "--dashboard-host=127.0.0.1" in head
    # A restart reuses the token the workers already have; --new-token replaces it.
    again = _run_script(tmp_path / "plan", ["head"], shims, tmp_path)
    assert again.returncode == 0 and token_file.read_text() == first
    assert "reusing the token" in again.stderr
    fresh = _run_script(tmp_path / "plan", ["head", "--new-token"], shims, tmp_path)
    assert fresh.returncode == 0 and token_file.read_text() != first
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600


def test_given_token_file_is_used_and_workers_need_one(tmp_path: Path, shims) -> None:
    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    secret = tmp_path / "secret-token"
    secret.write_text("f" * 64)
    env = {"RLC_RAY_TOKEN_FILE": str(secret), "RLC_HEAD_ADDR": "10.0.0.1"}
    worker = _run_script(tmp_path / "plan", ["worker"], shims, tmp_path, **env)
    assert worker.returncode == 0, worker.stderr
    assert {(mode, path) for _, mode, path in _auth_env(shims[1])} == {("token", str(secret))}
    assert not (tmp_path / ".rlc").exists()  # nothing generated when a token is given
    refused = _run_script(tmp_path / "plan", ["worker"], shims, tmp_path, RLC_HEAD_ADDR="10.0.0.1")
    assert refused.returncode == 1 and "needs the head's Ray token" in refused.stderr
    empty = tmp_path / "empty-token"
    empty.write_text("")
    bad = _run_script(tmp_path / "plan", ["head"], shims, tmp_path, RLC_RAY_TOKEN_FILE=str(empty))
    assert bad.returncode == 1 and "is missing or empty" in bad.stderr


def test_worker_finds_the_token_in_a_shared_home(tmp_path: Path, shims) -> None:
    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    assert _run_script(tmp_path / "plan", ["head"], shims, tmp_path).returncode == 0
    (token_file,) = (tmp_path / ".rlc").glob("ray-token-*")
    worker = _run_script(tmp_path / "plan", ["worker"], shims, tmp_path, RLC_HEAD_ADDR="10.0.0.1")
    assert worker.returncode == 0, worker.stderr
    assert [e for e in _auth_env(shims[1]) if e[0] == "ray"][-1] == ["ray", "token", str(token_file)]


def test_dashboard_host_no_submit_and_opting_out(tmp_path: Path, shims) -> None:
    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    result = _run_script(tmp_path / "plan", ["head", "--no-submit"], shims, tmp_path, RLC_DASHBOARD_HOST="0.0.0.0")
    assert result.returncode == 0, result.stderr
    calls = _calls(shims[1])
    assert [c[0] for c in calls] == ["python3", "ray", "python3"]  # no job submitted, Ray left running
    assert "--dashboard-host=0.0.0.0" in calls[1]
    assert "ray job submit --address=http://127.0.0.1:8265" in result.stderr
    off = _run_script(tmp_path / "plan", ["head", "--dry-run"], shims, tmp_path, RLC_RAY_AUTH="disabled")
    assert off.returncode == 0 and "authentication is off" in off.stderr
    assert _exported(off.stdout, "RAY_AUTH_MODE", tmp_path) == "disabled"
    typo = _run_script(tmp_path / "plan", ["head"], shims, tmp_path, RLC_RAY_AUTH="tokn")
    assert typo.returncode == 1 and "must be token or disabled" in typo.stderr


def test_dry_run_shows_auth_without_writing_a_token(tmp_path: Path, shims) -> None:
    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    result = _run_script(tmp_path / "plan", ["head", "--dry-run"], shims, tmp_path)
    assert result.returncode == 0, result.stderr
    assert _exported(result.stdout, "RAY_AUTH_MODE", tmp_path) == "token"
    assert "write a new random token" in result.stdout
    assert not list((tmp_path / ".rlc").glob("ray-token-*"))
    worker = _run_script(tmp_path / "plan", ["worker", "--dry-run"], shims, tmp_path)
    assert worker.returncode == 0
    assert _exported(worker.stdout, "RAY_AUTH_TOKEN_PATH", tmp_path) == "<RLC_RAY_TOKEN_FILE>"


# ----------------------------------------------------------------------------------------- what a stop ends


def _sleeper(**env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "300"], env={"PATH": "/usr/bin:/bin", **env})


@pytest.mark.parametrize("role", ["head", "worker"])
def test_stop_ends_only_the_processes_this_node_s_launch_started(tmp_path: Path, shims, role: str) -> None:
    import sys

    plan = cpu_plan()
    plan.cluster.nodes, plan.cluster.total_devices = 2, 4
    emit_plan_dir(plan, spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    shown = _run_script(tmp_path / "plan", [role, "stop", "--dry-run"], shims, tmp_path)
    assert shown.returncode == 0, shown.stderr
    mark = _argv_lines(shown.stdout, tmp_path)[-1][-2]
    assert mark.endswith(f"-{role}-{os.getuid()}")
    # A marked process (a raylet) with a child started without the environment (as Ray starts its agents).
    ours = subprocess.Popen(
        ["bash", "-c", "env -i sleep 300 & wait"], env={"PATH": "/usr/bin:/bin", "RLC_CLUSTER_MARK": mark}
    )
    other_cluster = _sleeper(RLC_CLUSTER_MARK=mark.replace("rlc-", "rlc-other-"))
    other_role = _sleeper(RLC_CLUSTER_MARK=mark.replace(f"-{role}-", "-nobody-"))
    unmarked = _sleeper()
    deadline = time.monotonic() + 10
    children = Path(f"/proc/{ours.pid}/task/{ours.pid}/children")
    while not children.read_text().split() and time.monotonic() < deadline:
        time.sleep(0.1)
    (agent,) = map(int, children.read_text().split())
    try:
        stopped = _run_script(tmp_path / "plan", [role, "stop"], shims, tmp_path, RLC_PYTHON=sys.executable)
        assert stopped.returncode == 0, stopped.stderr
        assert ours.wait(timeout=15) is not None
        assert "stopped 2 process(es)" in stopped.stderr
        assert not Path(f"/proc/{agent}").exists() or "Z" in Path(f"/proc/{agent}/stat").read_text().split(")")[-1][:3]
        for bystander in (other_cluster, other_role, unmarked):
            assert bystander.poll() is None, "a stop ended a process this launch.sh did not start"
    finally:
        for process in (ours, other_cluster, other_role, unmarked):
            process.kill()
            process.wait()


def test_ray_processes_carry_the_mark_and_a_worker_outlives_its_head_briefly(tmp_path: Path, shims) -> None:
    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    result = _run_script(tmp_path / "plan", ["worker", "--dry-run"], shims, tmp_path, RLC_HEAD_LOSS_S="7")
    assert result.returncode == 0, result.stderr
    assert _exported(result.stdout, "RLC_CLUSTER_MARK", tmp_path).endswith(f"-worker-{os.getuid()}")
    assert _exported(result.stdout, "RAY_gcs_rpc_server_reconnect_timeout_s", tmp_path) == "7"


# ----------------------------------------------------------------------------------------- sockets, nodes


def test_socket_interface_follows_the_route_to_the_head(tmp_path: Path, shims) -> None:
    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    route = "10.0.0.1 dev eth7 src 10.0.0.2 uid 0 \\    cache"
    env = {"RLC_HEAD_ADDR": "10.0.0.1", "RLC_SHIM_ROUTE": route}
    found = _run_script(tmp_path / "plan", ["worker", "--dry-run"], shims, tmp_path, **env)
    assert found.returncode == 0, found.stderr
    assert _exported(found.stdout, "GLOO_SOCKET_IFNAME", tmp_path) == "eth7"
    assert _exported(found.stdout, "TP_SOCKET_IFNAME", tmp_path) == "eth7"
    assert "use interface eth7" in found.stderr
    chosen = _run_script(tmp_path / "plan", ["worker", "--dry-run"], shims, tmp_path, RLC_SOCKET_IFNAME="ib0", **env)
    assert _exported(chosen.stdout, "GLOO_SOCKET_IFNAME", tmp_path) == "ib0"
    loopback = {**env, "RLC_SHIM_ROUTE": "local 10.0.0.1 dev lo src 10.0.0.1 uid 0"}
    local = _run_script(tmp_path / "plan", ["worker", "--dry-run"], shims, tmp_path, **loopback)
    assert local.returncode == 0 and "export GLOO_SOCKET_IFNAME=" not in local.stdout
    head = _run_script(
        tmp_path / "plan",
        ["head", "--dry-run"],
        shims,
        tmp_path,
        RLC_SHIM_ROUTE="default via 10.0.0.254 dev eno1 proto dhcp",
    )
    assert _exported(head.stdout, "GLOO_SOCKET_IFNAME", tmp_path) == "eno1"


def test_each_node_declares_its_plan_node(tmp_path: Path, shims) -> None:
    plan = cpu_plan()
    plan.cluster.nodes, plan.cluster.total_devices = 3, 6
    emit_plan_dir(plan, spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    head = _argv_lines(_run_script(tmp_path / "plan", ["head", "--dry-run"], shims, tmp_path).stdout, tmp_path)
    start = next(argv for argv in head if argv[:3] == ["ray", "start", "--head"])
    assert '--resources={"rlc_device": 2, "rlc_node_n0": 1000}' in start
    unnamed = _run_script(tmp_path / "plan", ["worker", "--dry-run"], shims, tmp_path)
    assert unnamed.returncode == 1 and "set RLC_NODE_RANK" in unnamed.stderr  # three nodes: which worker is this?
    second = _run_script(tmp_path / "plan", ["worker", "--dry-run"], shims, tmp_path, RLC_NODE_RANK="2")
    join = next(argv for argv in _argv_lines(second.stdout, tmp_path) if argv[:2] == ["ray", "start"])
    assert '--resources={"rlc_device": 2, "rlc_node_n2": 1000}' in join
    wrong = _run_script(tmp_path / "plan", ["worker", "--dry-run"], shims, tmp_path, RLC_NODE_RANK="3")
    assert wrong.returncode == 1 and "expected 1..2" in wrong.stderr
    single = tmp_path / "single"
    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), single, provenance={})
    one = _argv_lines(_run_script(single, ["head", "--dry-run"], shims, tmp_path).stdout, tmp_path)
    assert '--resources={"rlc_device": 2}' in next(argv for argv in one if argv[:2] == ["ray", "start"])


# ----------------------------------------------------------------------------------------- resume, tokens


def test_resume_and_overwrite_reach_rlc_run_with_a_new_submission_each_time(tmp_path: Path, shims) -> None:
    import json

    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    ids = []
    for flag in ("--resume", "--overwrite"):
        result = _run_script(tmp_path / "plan", ["head", flag], shims, tmp_path)
        assert result.returncode == 0, result.stderr
        submit = [c for c in _calls(shims[1]) if c[1:3] == ["job", "submit"]][-1]
        assert submit[-1] == flag and submit[-6:-3] == ["rlc", "run", str((tmp_path / "plan").resolve())]
        ids.append(next(a for a in submit if a.startswith("--submission-id=")))
        env = json.loads(next(a for a in submit if a.startswith("--runtime-env-json=")).split("=", 1)[1])
        resume = env["env_vars"]["RLC_RESUME_COMMAND"]
        assert resume == f"{(tmp_path / 'plan').resolve()}/launch.sh head --resume"
    assert len(set(ids)) == 2, "a submission id was reused (Ray refuses a second job under one id)"
    both = _run_script(tmp_path / "plan", ["head", "--resume", "--overwrite"], shims, tmp_path)
    assert both.returncode == 2 and "pass one of them" in both.stderr
    worker = _run_script(tmp_path / "plan", ["worker", "--resume"], shims, tmp_path)
    assert worker.returncode == 2 and "for `launch.sh head`" in worker.stderr


def test_a_refused_token_stops_the_join_at_once_with_the_copy_command(tmp_path: Path, shims) -> None:
    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    token = tmp_path / "token"
    token.write_text("0" * 64)
    env = {
        "RLC_HEAD_ADDR": "10.0.0.1",
        "RLC_RAY_TOKEN_FILE": str(token),
        "RLC_JOIN_BACKOFF": "0",
        "RLC_SHIM_FAIL_JOINS": "99",
        # what Ray 2.60's `ray start --address` prints when the head refuses the token
        "RLC_SHIM_JOIN_ERROR": "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication "
        "token is missing or incorrect.",
    }
    result = _run_script(tmp_path / "plan", ["worker"], shims, tmp_path, **env)
    assert result.returncode == 1
    assert len([c for c in _calls(shims[1]) if c[:2] == ["ray", "start"]]) == 1, "a refused token was retried"
    (default,) = [line for line in result.stderr.splitlines() if "refused this node's Ray token" in line]
    assert "scp 10.0.0.1:~/.rlc/ray-token-rlc-quickstart-" in default and f" {token}`" in default


def test_a_worker_s_leftovers_are_stopped_once_its_raylet_exits(tmp_path: Path, shims) -> None:
    import sys

    emit_plan_dir(cpu_plan(), spec_from(CPU_SPEC), tmp_path / "plan", provenance={})
    shown = _run_script(tmp_path / "plan", ["worker", "--dry-run"], shims, tmp_path, RAY_AUTH_TOKEN="t")
    watch = _argv_lines(shown.stdout, tmp_path)[-1]
    assert watch[-1] == "watch" and watch[0] == "python3"
    mark = watch[-3]
    raylet = tmp_path / "raylet"  # a process named like Ray's raylet
    shutil.copy(shutil.which("sleep") or "/bin/sleep", raylet)
    node = subprocess.Popen([str(raylet), "300"], env={"RLC_CLUSTER_MARK": mark})
    agent = _sleeper(RLC_CLUSTER_MARK=mark)  # e.g. Ray's runtime-env agent, which outlives the raylet
    bystander = _sleeper()
    watcher = subprocess.Popen([sys.executable, *watch[1:]], stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        assert watcher.poll() is None and agent.poll() is None  # the raylet lives: nothing is stopped
        node.kill()
        node.wait()
        assert watcher.wait(timeout=30) == 0
        assert agent.wait(timeout=5) is not None and bystander.poll() is None
    finally:
        for process in (node, agent, bystander, watcher):
            process.kill()
            process.wait()
