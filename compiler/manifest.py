"""The plan directory's manifest: what was compiled, by which rlc, and the sha256 of every file.

`rlc run` obeys a plan only if the directory is exactly what `rlc compile` wrote (the spirit of
`uv --locked` and Terraform's saved plans): a hand edit, a missing or stray file, an unknown plan format or
an rlc of another major.minor is refused with the file named and the fix. This module is on the start-up
path of `rlc run`, so it imports nothing heavy (hashlib, json, and the plan schema only when loading).

A plan directory holds regular files only: a named pipe would block its reader forever and a device such as
`/dev/zero` never ends, so both are refused by name before anything is read (RLC701). Symbolic links are
followed only to regular files inside the plan directory (a Kubernetes ConfigMap volume links every entry into
its `..data/` folder); one that leads out of it, or nowhere, is refused the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from rlc import __version__
from rlc.compiler.diagnostics import Diagnostic
from rlc.messages import first_line

if TYPE_CHECKING:
    from rlc.schemas.plan import Plan

MANIFEST = "manifest.json"
PLAN_FILE = "plan.json"
#: Plan formats this rlc can run (the schema's PLAN_FORMAT_VERSION and any older ones still readable).
SUPPORTED_FORMATS: tuple[int, ...] = (3,)
#: Entries a Kubernetes ConfigMap volume adds next to the files (atomic-writer internals); never plan content.
_CONFIGMAP_INTERNALS = ".."


def _recompile(plan_dir: Path) -> str:
    return f"recompile with `rlc compile <spec> -o {plan_dir}`"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class SpecialFileError(ValueError):
    """A plan file that is not a regular file (a FIFO, a device, a socket, a directory)."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path) -> IO[bytes]:
    """`path` open for reading, or SpecialFileError when it is not a regular file.

    Opened without blocking (a FIFO's open would wait for a writer) and checked on the open file, so a file
    swapped after an earlier check cannot slip through.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SpecialFileError(f"{path} is {_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_text(path: Path) -> str:
    """The UTF-8 text of a regular file (SpecialFileError for anything else, see `open_regular`)."""
    with open_regular(path) as handle:
        return handle.read().decode("utf-8")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as handle:
        for block in iter(lambda: handle.read(1 << 16), b""):
            digest.update(block)
    return digest.hexdigest()


def not_a_plan_file(plan_dir: Path, name: str) -> str | None:
    """Why `plan_dir/name` cannot be read as a plan file (None when it can): not a regular file, a symbolic link
    out of the plan directory, or a dangling one. Only stat is called, so a FIFO cannot block the check."""
    path = plan_dir / name
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        linked = " (a symbolic link that leads nowhere)" if path.is_symlink() else ""
        return f"{name} cannot be read{linked}: {exc.strerror or exc}"
    real = path.resolve()
    linked = f" (a symbolic link to {real})" if real != path.absolute() else ""
    if not stat.S_ISREG(mode):
        return f"{name}{linked} is {_kind(mode)}, not a regular file"
    try:
        real.relative_to(plan_dir.resolve())
    except ValueError:
        return f"{name}{linked} lies outside the plan directory"
    return None


def dumps_json(data: Any) -> str:
    """Canonical JSON text: sorted keys, two-space indent, UTF-8 kept readable, trailing newline.

    Strict JSON: a NaN or infinity raises ValueError instead of writing `NaN`, which other parsers refuse.
    """
    return json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def major_minor(version: str) -> tuple[str, str]:
    parts = [*version.split("+")[0].split("."), "", ""][:2]
    return parts[0], parts[1]


def build_manifest(files: dict[str, bytes], *, spec_hash: str, plan_hash: str, format_version: int) -> dict[str, Any]:
    """The manifest for a plan directory whose other files (relative path → content) are `files`.

    It keeps a copy of the compiled plan (what `rlc run` reads), so `--allow-modified` can show exactly which
    values a hand edit changed.
    """
    manifest: dict[str, Any] = {
        "plan_format": format_version,
        "rlc_version": __version__,
        "spec_hash": spec_hash,
        "plan_hash": plan_hash,
        "files": {name: sha256_bytes(content) for name, content in sorted(files.items())},
    }
    if PLAN_FILE in files:
        manifest["compiled_plan"] = json.loads(files[PLAN_FILE])
    return manifest


def read_manifest(plan_dir: Path) -> dict[str, Any] | None:
    """The parsed manifest, or None when there is none or it is not a plan manifest."""
    try:
        data = json.loads(read_text(plan_dir / MANIFEST))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict) or "plan_format" not in data:
        return None
    return data


def list_files(plan_dir: Path) -> list[str]:
    """Every file under `plan_dir` as a sorted POSIX relative path.

    Directory symlinks are followed when they stay inside the plan directory (a ConfigMap volume mounts
    `roles/` as a link into `..data/`); one that leads out is listed as an entry itself (`not_a_plan_file` then
    refuses it) rather than walked. The volume's own `..`-prefixed entries are skipped.
    """
    found: list[str] = []
    inside = Path(plan_dir).resolve()
    for root, dirs, files in os.walk(plan_dir, followlinks=True):
        rel_root = Path(root).relative_to(plan_dir)
        if rel_root == Path("."):
            dirs[:] = [d for d in dirs if not d.startswith(_CONFIGMAP_INTERNALS)]
            files = [f for f in files if not f.startswith(_CONFIGMAP_INTERNALS)]
        outward = [d for d in dirs if os.path.islink(os.path.join(root, d)) and not _within(Path(root, d), inside)]
        dirs[:] = [d for d in dirs if d not in outward]
        if len(rel_root.parts) >= 8:  # plans are shallow; this also stops a symlink loop
            dirs[:] = []
        dirs.sort()
        found.extend((rel_root / name).as_posix() for name in [*files, *outward])
    return sorted(found)


def _within(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder)
    except (ValueError, OSError, RuntimeError):
        return False
    return True


def plan_problem(exc: Exception) -> str:
    """One line for why a plan.json does not read: its first validation error, where it is, not pydantic's dump."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError) and exc.errors():
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        return f"{where + ': ' if where else ''}{first['msg']}{more}"
    return first_line(exc)


def _error(code: str, message: str, file: str, hint: str, severity: str = "error") -> Diagnostic:
    return Diagnostic(code, message, path=file, severity=severity, hint=hint, file=file)  # type: ignore[arg-type]


def verify_plan_dir(plan_dir: Path, *, allow_modified: bool = False) -> list[Diagnostic]:
    """Check a plan directory against its manifest; an empty list means `rlc run` may use it.

    Errors: no manifest, unknown plan format, rlc of another major.minor, a missing, modified or extra file,
    a plan.json that is not the compiled plan the manifest records although its hash in `files` was made to
    match (`compiled_plan_differences`). With `allow_modified`, modified and extra files (and such a plan.json)
    are warnings instead (a deliberate local experiment); missing files and version problems stay errors.
    """
    plan_dir = Path(plan_dir)
    where = str(plan_dir)
    if not plan_dir.is_dir():
        return [_error("RLC701", f"plan directory {where} does not exist", where, "run `rlc compile` first")]
    special = {name: why for name in list_files(plan_dir) if (why := not_a_plan_file(plan_dir, name))}
    if MANIFEST in special:
        return _special_files(plan_dir, special)
    manifest = read_manifest(plan_dir)
    if manifest is None:
        return [
            _error(
                "RLC701",
                f"{MANIFEST} is missing or unreadable; {where} is not a compiled plan",
                str(plan_dir / MANIFEST),
                # compile refuses to write over a folder without a manifest, so point at a new one
                f"compile the spec into a new folder (`rlc compile <spec> -o {plan_dir.name}-new`)",
            )
        ]
    recompile = _recompile(plan_dir)
    found: list[Diagnostic] = []
    manifest_file = str(plan_dir / MANIFEST)
    fmt = manifest.get("plan_format")
    if fmt not in SUPPORTED_FORMATS:
        supported = ", ".join(str(v) for v in SUPPORTED_FORMATS)
        found.append(
            _error(
                "RLC702",
                f"plan format {fmt!r} is not supported by rlc {__version__} (supported: {supported})",
                manifest_file,
                f"{recompile}, or use the rlc that compiled it",
            )
        )
    version = str(manifest.get("rlc_version", ""))
    if major_minor(version) != major_minor(__version__):
        found.append(
            _error(
                "RLC703",
                f"plan was compiled by rlc {version or '?'} but this is rlc {__version__} (major.minor must match)",
                manifest_file,
                f"{recompile} with rlc {__version__}, or install rlc {version}",
            )
        )
    listed: dict[str, str] = {str(k): str(v) for k, v in manifest["files"].items()}
    found += _special_files(plan_dir, special)
    present = set(list_files(plan_dir)) - {MANIFEST} - set(special)
    changed = "warning" if allow_modified else "error"
    for name in sorted(listed):
        file = str(plan_dir / name)
        if name in special:
            continue
        if name not in present:
            found.append(_error("RLC704", f"{name} is missing from the plan", file, recompile))
        elif sha256_file(plan_dir / name) != listed[name]:
            found.append(
                _error(
                    "RLC705",
                    f"{name} changed after compile (sha256 mismatch)",
                    file,
                    f"{recompile}, or pass --allow-modified to run it anyway",
                    changed,
                )
            )
    for name in sorted(present - set(listed)):
        found.append(
            _error(
                "RLC706",
                f"{name} is not part of the compiled plan",
                str(plan_dir / name),
                f"remove it, or {recompile}",
                changed,
            )
        )
    plan_file = str(plan_dir / PLAN_FILE)
    if PLAN_FILE in listed and PLAN_FILE in present and not any(d.file == plan_file for d in found):
        found += _rehashed_plan(plan_dir, manifest, changed)
    return found


def compiled_plan_differences(plan_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """How plan.json differs from the manifest's own record of the compiled plan (empty when it does not).

    The manifest keeps `plan_hash` (the sha256 of plan.json as compiled) and, since value-by-value reports,
    `compiled_plan` (a copy of it), next to the per-file hashes: a plan.json edited and rehashed in `files`
    still differs from both. A manifest without `compiled_plan` predates it; every manifest has `plan_hash`.
    """
    path = plan_dir / PLAN_FILE
    reasons: list[str] = []
    expected = manifest.get("plan_hash")
    if not isinstance(expected, str) or not expected:
        reasons.append(f"{MANIFEST} has lost its plan_hash")
    elif sha256_file(path) != expected:
        reasons.append("its sha256 is not the manifest's plan_hash")
    if "compiled_plan" in manifest:
        try:
            current = json.loads(read_text(path))
        except (OSError, ValueError):
            current = None
        if current != manifest["compiled_plan"]:
            reasons.append("its values differ from the manifest's copy of the compiled plan")
    return reasons


def _rehashed_plan(plan_dir: Path, manifest: dict[str, Any], severity: str) -> list[Diagnostic]:
    """RLC705 for a plan.json whose hash in `files` matches but which is not the plan the compiler wrote."""
    reasons = compiled_plan_differences(plan_dir, manifest)
    if not reasons:
        return []
    return [
        _error(
            "RLC705",
            f"{PLAN_FILE} is not the plan rlc compile wrote, although its sha256 in {MANIFEST} matches (the "
            f"manifest was edited to fit): {'; '.join(reasons)}",
            str(plan_dir / PLAN_FILE),
            f"{_recompile(plan_dir)}, or pass --allow-modified to run it anyway",
            severity,
        )
    ]


def _special_files(plan_dir: Path, special: dict[str, str]) -> list[Diagnostic]:
    """RLC701 errors for files no plan holds (never downgraded by --allow-modified: reading them would hang)."""
    hint = f"replace it with the compiled file, or {_recompile(plan_dir)}"
    return [
        _error("RLC701", f"{why}; a plan directory holds regular files only", str(plan_dir / name), hint)
        for name, why in sorted(special.items())
    ]


def load_plan(plan_dir: Path) -> Plan:
    """The Plan in `plan_dir/plan.json` (call verify_plan_dir first; this only parses and validates)."""
    from rlc.schemas.plan import Plan

    return Plan.model_validate_json(read_text(Path(plan_dir) / PLAN_FILE))
